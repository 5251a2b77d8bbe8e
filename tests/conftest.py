"""Shared fixtures. Session-scoped models are shared by every test: read them, never mutate them."""

import inspect
import os

if os.environ.get("PYTEST_XDIST_WORKER"):
    # `make test` runs pytest-xdist workers side by side: each takes its share of the cores (and passes it on to the
    # pipelines it starts), so that two workers never oversubscribe two cores
    _share = max(1, (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
    os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = str(_share)
    import torch

    torch.set_num_threads(_share)

import pytest

from sacpolicy.models import EMBEDDED_TARGET, load_model


def pytest_addoption(parser):
    """Where the tiny models of the tests run: ``--device cuda --dtype bfloat16`` (or ``SACPOLICY_TEST_DEVICE`` /
    ``SACPOLICY_TEST_DTYPE``) runs the decoder's exactness tests on a GPU (``scripts/gpu_check.sh``)."""
    parser.addoption("--device", default=os.environ.get("SACPOLICY_TEST_DEVICE", "cpu"),
                     help="device of the tiny_target / tiny_draft fixtures (default cpu)")
    parser.addoption("--dtype", default=os.environ.get("SACPOLICY_TEST_DTYPE", "float32"),
                     help="dtype of the tiny_target / tiny_draft fixtures (default float32)")


SLOW_FIXTURES = {"embedded", "smoke_run"}  # the real 135M model; a whole smoke pipeline in a subprocess


def _is_slow(item) -> bool:
    """Loads the real embedded model, runs a pipeline, or starts a process (a script, DDP, vLLM)."""
    if SLOW_FIXTURES & set(getattr(item, "fixturenames", ())):
        return True
    try:
        source = inspect.getsource(item.function)
    except (OSError, TypeError, AttributeError):
        return False
    return "subprocess" in source or "Popen" in source


def pytest_collection_modifyitems(config, items):
    """Marks ``slow`` what a developer's quick loop (``pytest -m "not slow"``) leaves out; ``make test`` runs all.
    The vLLM engines first: the longest test (one worker) then overlaps the rest of the suite on the other worker
    instead of running after it."""
    for item in items:
        if item.get_closest_marker("slow") is None and _is_slow(item):
            item.add_marker(pytest.mark.slow)
    items.sort(key=lambda item: item.get_closest_marker("vllm") is None)


@pytest.fixture(scope="session")
def embedded():
    """The real embedded SmolLM2-135M target on CPU/float32 (first run converts the GGUF once, ~20 s)."""
    return load_model(EMBEDDED_TARGET, device="cpu", dtype="float32")


@pytest.fixture(scope="session")
def tiny_device(request) -> dict:
    """{"device", "dtype"} of the tiny models: CPU/float32 (exact everywhere) unless ``--device`` / ``--dtype``."""
    return {"device": request.config.getoption("--device"), "dtype": request.config.getoption("--dtype")}


@pytest.fixture(scope="session")
def tiny_target(tiny_device):
    """Random-init 4-layer Llama sharing the embedded tokenizer; CPU/float32 so results are exact everywhere."""
    return load_model("tiny:llama-4l", **tiny_device, seed=0)


@pytest.fixture(scope="session")
def tiny_draft(tiny_device):
    """Random-init 1-layer Llama sharing the embedded tokenizer, a different seed from tiny_target."""
    return load_model("tiny:llama-1l", **tiny_device, seed=1)


def tiny_head_dir(target, out_dir, vocab: int = 256, seed: int = 0):
    """An EAGLE-3 head for ``target`` (untrained: the target's own layer and rows, as training starts) saved to
    ``out_dir/head``; aux layers 0, 1, 2 (a 4-layer target has no room for the default [2, L // 2, L - 3])."""
    import torch

    from sacpolicy.decoding.eagle3 import Eagle3Config, vocab_hash
    from sacpolicy.training.eagle3 import init_head, save_head

    config = Eagle3Config.from_target(target.model.config, vocab, aux_layer_ids=[0, 1, 2], verifier=target.spec,
                                      vocab_hash=vocab_hash(target.tokenizer))
    head = init_head(target, config, torch.arange(vocab) * 7 + 3, seed=seed)
    return save_head(head, out_dir / "head", {"test": "untrained"})
