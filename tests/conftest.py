"""Shared fixtures. Session-scoped models are shared by every test: read them, never mutate them."""

import pytest

from sacpolicy.models import EMBEDDED_TARGET, load_model


@pytest.fixture(scope="session")
def embedded():
    """The real embedded SmolLM2-135M target on CPU/float32 (first run converts the GGUF once, ~20 s)."""
    return load_model(EMBEDDED_TARGET, device="cpu", dtype="float32")


@pytest.fixture(scope="session")
def tiny_target():
    """Random-init 4-layer Llama sharing the embedded tokenizer; CPU/float32 so results are exact everywhere."""
    return load_model("tiny:llama-4l", device="cpu", dtype="float32", seed=0)


@pytest.fixture(scope="session")
def tiny_draft():
    """Random-init 1-layer Llama sharing the embedded tokenizer, a different seed from tiny_target."""
    return load_model("tiny:llama-1l", device="cpu", dtype="float32", seed=1)
