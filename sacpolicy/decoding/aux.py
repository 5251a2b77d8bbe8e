"""The target's hidden states at the few layers feature drafters read (EAGLE-3 aux features), captured with forward
pre-hooks on those decoder layers only: ``output_hidden_states`` would materialise every layer.

Layer id i means the input of decoder layer i (HF ``output_hidden_states[i]``), the convention vLLM, speculators and
SGLang use for ``eagle_aux_hidden_state_layer_ids``."""

from __future__ import annotations

import torch
from torch import nn


class AuxCapture:
    """``with capture: target(...)`` keeps the hidden states entering decoder layers ``layers`` during that pass;
    ``rows(layers, m)`` / ``batch(layers)`` read them back concatenated in the order asked for."""

    def __init__(self, target: nn.Module, layers):
        self.layers = sorted(set(int(i) for i in layers))
        self._last: dict[int, torch.Tensor] = {}
        self._blocks, self._handles = [], []
        if not self.layers:
            return
        blocks = getattr(getattr(target, "model", None), "layers", None)
        if blocks is None:
            raise ValueError(f"feature drafters read decoder-layer inputs (.model.layers); {type(target).__name__} "
                             "has another layout: use token-level drafters with this target")
        bad = [i for i in self.layers if not 0 <= i < len(blocks)]
        if bad:
            raise ValueError(f"aux layers {bad} are out of range: the target has layers 0..{len(blocks) - 1}; use a "
                             "head trained for this target (or aux layer ids inside that range)")
        self._blocks = [blocks[i] for i in self.layers]

    def batch(self, layers) -> torch.Tensor:
        """[B, T, len(layers) * H]: the last pass's hidden states at ``layers``, in that order."""
        return torch.cat([self._last[i] for i in layers], dim=-1)

    def rows(self, layers, m: int | None = None, row: int = 0, start: int = 0,
             columns: list[int] | None = None) -> torch.Tensor:
        """[m, len(layers) * H]: m positions of sequence ``row`` of the last pass from position ``start`` on (the first
        m by default; a left-padded prefill's row starts after its pads), or its positions ``columns`` (a token tree's
        accepted path), a tensor of their own:
        concatenating only that row's positions, not the batch's and then slicing, which would copy the whole batch
        once per row and keep it alive as long as a drafter holds the slice (a row feeding its drafter one step's
        states while decoding autoregressively held [B, T, 3H] per step)."""
        if columns is not None:
            at = torch.tensor(columns, device=self._last[layers[0]].device)
        else:
            at = slice(start, None if m is None else start + m)
        return torch.cat([self._last[i][row, at] for i in layers], dim=-1)

    def __enter__(self):
        for i, block in zip(self.layers, self._blocks):
            self._handles.append(block.register_forward_pre_hook(self._hook(i), with_kwargs=True))
        return self

    def __exit__(self, *exc):
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _hook(self, i: int):
        def hook(module, args, kwargs):
            self._last[i] = args[0] if args else kwargs["hidden_states"]
        return hook


def aux_pass(model: nn.Module, ids: torch.Tensor, keep: int, layers) -> tuple[torch.Tensor, AuxCapture]:
    """One target pass over ``ids`` [N] without a cache: (logits of the last ``keep`` positions [keep, V], the
    capture holding the hidden states at ``layers``)."""
    capture = AuxCapture(model, layers)
    with capture:
        logits = model(input_ids=ids.view(1, -1), logits_to_keep=keep).logits[0]
    return logits, capture
