"""Target and draft models from one spec string (``load_model``); see ``sacpolicy.models.loading``.

- ``loading``: spec parsing, tiny presets, loading a model and its tokenizer, tokenizer checks.
- ``embedded``: the GGUF files shipped in pip packages (whole, or in chunk packages joined once and checked).
- ``gguf``: a GGUF file dequantized once into a cached Hugging Face directory.
- ``cache``: what both share (the cache root, the default target's spec, the spec errors), so neither imports the
  other for it.
"""

from sacpolicy.models.cache import EMBEDDED_TARGET, ModelSpecError, TokenizerMismatchError, cache_root
from sacpolicy.models.loading import (
    EMBEDDED_MODELS,
    TINY_PRESETS,
    LoadedModel,
    check_tokenizers_compatible,
    eos_token_ids,
    load_model,
    load_tokenizer,
    model_dir,
    resolve_device,
    resolve_dtype,
    served_model,
)

__all__ = [
    "EMBEDDED_MODELS", "EMBEDDED_TARGET", "TINY_PRESETS", "LoadedModel", "ModelSpecError", "TokenizerMismatchError",
    "cache_root", "check_tokenizers_compatible", "eos_token_ids", "load_model", "load_tokenizer", "model_dir",
    "resolve_device", "resolve_dtype", "served_model",
]
