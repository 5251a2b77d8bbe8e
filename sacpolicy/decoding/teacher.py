"""Teacher forcing: what a drafter proposes at every position of a sequence the target wrote, given the true prefix
(the traces' ``teacher_forced`` rows). A drafter with a faster pass of its own implements ``TeacherForcing`` (one
batched forward for a model draft); the others are asked position by position (``propose_each``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from sacpolicy.decoding.protocols import feature_layers
from sacpolicy.decoding.types import DraftRow

__all__ = ["TeacherForced", "TeacherForcing", "propose_each", "teacher_force"]


@dataclass
class TeacherForced:
    """What a drafter proposes at each generated position of a sequence the target wrote, given the true prefix
    (row g: the proposal made on top of ``ids[:start + g]``).

    ``tokens`` [G, w] long, -1 after a proposal's end. ``chained=False`` (w = 1): the drafter's next token after an
    accepted one is its proposal from the next row (a token-level model reads only tokens, which equal the target's
    once accepted), so accepted runs are read down the rows. ``chained=True``: row g is the whole block the drafter
    would propose from there (n-gram copies, feature heads whose later tokens read the draft's own features).
    ``logits`` [G, V]: the raw draft logits of each row's first token (None for deterministic proposals);
    ``confidence`` [G, 3]: (top-1, entropy, margin) of it, when ``logits`` is None. ``block_confidence``: for a
    chained deterministic drafter whose proposed tokens each have a confidence of their own (the suffix drafter), row
    g's per token (lists of (top-1, entropy, margin), one per proposed token); None: every token has its row's.
    """

    tokens: torch.Tensor
    chained: bool
    logits: torch.Tensor | None = None
    confidence: torch.Tensor | None = None
    block_confidence: list[list[tuple[float, float, float]]] | None = None

    def proposal_confidence(self, g: int) -> list[list[float]] | None:
        """Row g's ``block_confidence`` as the traces' ``proposal_confidence`` column holds it (None: none)."""
        return None if self.block_confidence is None else [list(c) for c in self.block_confidence[g]]


@runtime_checkable
class TeacherForcing(Protocol):
    """A drafter with its own teacher-forced pass (one batched forward for a model draft); the others are teacher
    forced by proposing at each position (``teacher_force``)."""

    def teacher_force(self, ids: torch.Tensor, start: int, k_max: int,
                      aux: torch.Tensor | None = None) -> TeacherForced:
        """Proposals at every position ``start .. len(ids) - 1`` given the true prefix (see ``TeacherForced``);
        ``aux`` [len(ids), A]: the target's hidden states at ``aux_layers`` for feature drafters."""
        ...


def teacher_force(drafter, ids: torch.Tensor, start: int, k_max: int,
                  aux: torch.Tensor | None = None) -> TeacherForced:
    """``drafter``'s proposals at every position ``start .. len(ids) - 1`` given the true prefix (``TeacherForced``):
    its own pass (``TeacherForcing``), else ``propose`` asked position by position, each on a new state (chained
    blocks). ``aux`` [len(ids), A]: the target's hidden states at the drafter's ``aux_layers``."""
    if isinstance(drafter, TeacherForcing):
        return drafter.teacher_force(ids, start, k_max, aux)
    return propose_each(drafter, ids, start, k_max, aux)


def propose_each(drafter, ids: torch.Tensor, start: int, k_max: int,
                 aux: torch.Tensor | None = None) -> TeacherForced:
    """Teacher forcing by proposing: at each position ``start .. len(ids) - 1``, ``propose`` on the true prefix with
    a new state (fed the features of the prefix first, for feature drafters)."""
    features = aux is not None and bool(feature_layers(drafter))
    rows = []
    for g in range(start, ids.shape[0]):
        state = drafter.new_state()
        if features:
            drafter.extend_features(state, aux[: g - 1])
        block = drafter.propose([DraftRow(state, ids[:g], k_max)])[0]
        row = torch.full((k_max,), -1, dtype=torch.long, device=ids.device)
        row[: block.k] = block.tokens
        conf = block.confidence[0] if block.confidence is not None and block.k else None
        rows.append((row, block.k, conf))
    tokens = torch.stack([r[0] for r in rows]) if rows else torch.empty(0, k_max, dtype=torch.long)
    conf = torch.tensor([[0.0, 0.0, 0.0] if n == 0 else ([1.0, 0.0, 1.0] if c is None else c.tolist())
                         for _, n, c in rows]).view(-1, 3)
    return TeacherForced(tokens, chained=True, confidence=conf)
