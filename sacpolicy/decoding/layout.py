"""Which attention each layer of a model runs (read once from its config), and the masks a batch passes it.

The decoder runs two kinds of attention layers: full attention (Llama, Qwen3, ...) and sliding-window attention
(Mistral's every layer; Qwen2 with ``use_sliding_window``; Gemma 2 and 3, whose local layers slide and whose global
layers attend everything, per ``layer_types``). Its caches keep every committed token's keys and values for both kinds
(``ragged.new_cache``): transformers' sliding-window cache keeps only the last ``window - 1`` tokens and cannot roll
back once full, while speculative decoding rolls back every rejected draft and moves a token tree's accepted path.
With every token kept, a rollback is a crop and a path move a gather, as on a full-attention layer, and the window
lives in the mask alone: a query at position p reads the keys at positions in (p - window, p] (transformers'
``sliding_window_overlay``). The price: a sliding layer's cache grows with the context as a full layer's does.

How the mask reaches the model: models whose config lists ``layer_types`` (Gemma 2/3, Qwen2/3, Cohere2, ...) take
``attention_mask`` as a dict keyed by layer type (``"full_attention"``, ``"sliding_attention"``) and hand each layer
its type's mask; models without it (Mistral, Mixtral, Phi-3, Starcoder2) slide every layer by ``config.sliding_window``
and take one mask. A model of full-attention layers only gets the one mask it always got. Any other kind of layer
(chunked attention, linear attention and state-space layers, bidirectional attention) is refused by
``attention_layout`` when the decoder is built, with the family's name and the layer kinds it cannot run.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["FULL", "SLIDING", "AttentionLayout", "attention_layout", "layer_types"]

FULL, SLIDING = "full_attention", "sliding_attention"  # transformers' names of the two layer types


@dataclass(frozen=True)
class AttentionLayout:
    """What a batch's masks must say for a model: ``window`` (its sliding layers' window; None: every layer attends
    its whole context, the one mask decoding always passed) and ``by_type`` (the model takes ``attention_mask`` as
    {layer type: mask})."""

    window: int | None = None
    by_type: bool = False

    def mask(self, allowed: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor, dtype: torch.dtype):
        """The ``attention_mask`` of a pass: ``allowed`` [B, T, K] bool (which keys each of the T queries may read
        under full attention), ``q_pos`` [B, T] and ``k_pos`` [B, K] the positions of queries and keys in their
        row's sequence. -> the additive float mask [B, 1, T, K] (0 or the dtype's minimum) for full attention only;
        with a window, its sliding one (keys within ``window`` positions of the query, q_pos - k_pos < window) alone
        or, ``by_type``, both keyed by layer type. Every query reads at least itself, so none has all keys masked."""
        full = _additive(allowed, dtype) if self.window is None or self.by_type else None
        if self.window is None:
            return full
        near = (q_pos[:, :, None] - k_pos[:, None, :]) < self.window
        sliding = _additive(allowed & near, dtype)
        return {FULL: full, SLIDING: sliding} if self.by_type else sliding


def _additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    mask = torch.zeros(allowed.shape[0], 1, *allowed.shape[1:], dtype=dtype, device=allowed.device)
    return mask.masked_fill_(~allowed[:, None], torch.finfo(dtype).min)


def _text_config(config):
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config


def layer_types(config) -> list[str]:
    """The type of each decoder layer of a model of this config: its ``layer_types`` when it lists them, else every
    layer sliding when it has a ``sliding_window`` (Mistral's convention), chunked when it has an
    ``attention_chunk_size``, full otherwise. [] without a config (a toy model)."""
    if config is None:
        return []
    text = _text_config(config)
    listed = getattr(text, "layer_types", None)
    if listed is not None:
        return list(listed)
    n = int(getattr(text, "num_hidden_layers", 0) or 0)
    if getattr(text, "sliding_window", None) is not None:
        return [SLIDING] * n
    if getattr(text, "attention_chunk_size", None) is not None:
        return ["chunked_attention"] * n
    return [FULL] * n


def attention_layout(config, role: str = "target") -> AttentionLayout:
    """The ``AttentionLayout`` of a model of this config (None: a model without one, full attention), or a
    ValueError naming the family and what the decoder cannot run in it: layers other than full and sliding-window
    attention, bidirectional attention, a sliding layer without a window. ``role``: the model's, in the message."""
    if config is None:
        return AttentionLayout()
    text = _text_config(config)
    name = getattr(text, "model_type", None) or type(config).__name__
    types = layer_types(config)
    other = sorted(set(types) - {FULL, SLIDING})
    why = None
    if other:
        why = (f"its layers include {other}, whose caches the decoder cannot roll back or batch (it runs "
               f"{FULL!r} and {SLIDING!r} layers)")
    elif getattr(text, "use_bidirectional_attention", False) or not getattr(text, "is_causal", True):
        why = "it attends bidirectionally, and speculative decoding needs a causal language model"
    elif getattr(text, "is_encoder_decoder", False):
        why = "it is an encoder-decoder model, and the decoder runs decoder-only causal language models"
    if why is not None:
        raise ValueError(f"the speculative decoder cannot run a {name!r} {role}: {why}. Supported: decoder-only models "
                         "of full and sliding-window attention (Llama, Mistral, Qwen2, Qwen3, Gemma 2/3, ...); pick "
                         f"one of those as the {role}")
    if SLIDING not in types:
        return AttentionLayout()
    window = getattr(text, "sliding_window", None)
    if not isinstance(window, int) or window < 1:
        raise ValueError(f"{name!r} config lists {SLIDING!r} layers but its sliding_window is {window!r}: set it to "
                         "the window the model was trained with")
    return AttentionLayout(window, by_type=getattr(text, "layer_types", None) is not None)
