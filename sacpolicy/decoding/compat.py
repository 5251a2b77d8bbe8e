"""What differs between the transformers releases sacpolicy supports (>= 5.0; vLLM pins some below 5.20)."""

from __future__ import annotations

import inspect

_CACHE_KEYWORD: dict[type, str] = {}


def cache_keyword(model) -> str:
    """The keyword a model's ``forward`` takes its KV cache by: ``cache`` in newer transformers releases,
    ``past_key_values`` before (a release that knows both takes ``cache`` and warns about the other)."""
    cls = type(model)
    if cls not in _CACHE_KEYWORD:
        params = inspect.signature(cls.forward).parameters
        _CACHE_KEYWORD[cls] = "cache" if "cache" in params else "past_key_values"
    return _CACHE_KEYWORD[cls]


def with_cache(model, cache) -> dict:
    """``model(input_ids=..., **with_cache(model, cache), use_cache=True)`` in any supported release."""
    return {cache_keyword(model): cache}
