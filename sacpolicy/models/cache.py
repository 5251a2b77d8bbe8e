"""What ``loading`` and ``gguf`` share, so neither imports the other's module to get it: the cache root converted
models live under, the default target's spec and the errors a model spec raises."""

from __future__ import annotations

import os
import pathlib

EMBEDDED_TARGET = "embedded:smollm2-135m-instruct"


class ModelSpecError(ValueError):
    """A model spec names nothing loadable: unknown kind, missing or corrupt file or directory."""


class TokenizerMismatchError(ValueError):
    """Target and draft tokenizers differ, so draft token ids would mean different text to the target."""


def cache_root() -> pathlib.Path:
    """Where converted models live: $SACPOLICY_CACHE if set, else ~/.cache/sacpolicy."""
    env = os.environ.get("SACPOLICY_CACHE")
    return pathlib.Path(env).expanduser() if env else pathlib.Path.home() / ".cache" / "sacpolicy"
