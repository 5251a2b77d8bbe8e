"""The decoder's state read into THE feature row (``sacpolicy.runtime.features.feature_row``, which the exported
runtime shares): live decoding and trace replay call ``token_features``.

Features of a drafted token, known the moment it is drafted: the draft's confidence in it and in the previous
drafted token of the block, its position in the block, the context length, the recent acceptance of this drafter,
which drafter, the serving load, the prompt category when known, and whether the other drafters' peeked proposals
start with this drafter's first token (``agree``: +1 for each that does, -1 for each that starts with another).
Before drafting, ``token=None`` gives the same vector with the confidence unknown (what a k or drafter choice can
see).
"""

from __future__ import annotations

from sacpolicy.decoding.types import DecodeState, DraftToken
from sacpolicy.runtime.features import (
    CATEGORIES,
    FEATURE_NAMES,
    FEATURE_VERSION,
    RowContext,
    accept_rate,
    agreement,
    category_index,
    feature_row,
    feature_spec,
    feature_vector,
)

__all__ = ["CATEGORIES", "FEATURE_NAMES", "FEATURE_VERSION", "category_index", "feature_spec", "feature_vector",
           "row_context", "token_features"]


def row_context(state: DecodeState, drafter: str | None) -> RowContext:
    """The ``load`` feature is the request's signal, not the live batch size: acceptance does not depend on how many
    rows share the target pass, the cost of the pass does, and the learned rule reads that from the cost model at the
    live batch size (``DecodeState.batch_size``)."""
    drafters = state.request.drafters
    history = state.accept_history.get(drafter) if drafter is not None else None
    return RowContext(context_len=state.context_len, drafter_index=drafters.index(drafter) if drafter in drafters else -1,
                      accept_ema=accept_rate(history),
                      load=state.request.load, category=state.request.category, peek=state.peeks.get(drafter),
                      agree=agreement(state.peeks, drafter))


def token_features(state: DecodeState, token: DraftToken | None, prev_top1: float | None, *,
                   drafter: str | None = None, position: int | None = None) -> list[float]:
    """The feature vector of ``token`` (drafted at ``token.position`` of the block by ``state.drafter``), or, with
    ``token=None``, of a token still to be drafted at ``position`` by ``drafter`` (see ``feature_row``)."""
    ctx = row_context(state, drafter if drafter is not None else state.drafter)
    if token is None:
        return feature_row(ctx, position, None, prev_top1)
    return feature_row(ctx, token.position, (token.top1, token.entropy, token.margin), prev_top1)
