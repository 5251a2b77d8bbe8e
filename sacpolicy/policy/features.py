"""THE feature function, read from the decoder's state: live decoding and trace replay call ``token_features``; it
fills ``sacpolicy.runtime.features.feature_vector`` (the definition the exported runtime shares).

Features of a drafted token, known the moment it is drafted: the draft's confidence in it and in the previous
drafted token of the block, its position in the block, the context length, the recent acceptance of this drafter,
which drafter, the serving load, and the prompt category when known. Before drafting, ``token=None`` gives the same
vector with the confidence unknown (what a k or drafter choice can see).
"""

from __future__ import annotations

from sacpolicy.policy.base import DecodeState, DraftToken
from sacpolicy.runtime.features import (
    CATEGORIES,
    FEATURE_NAMES,
    FEATURE_VERSION,
    category_index,
    feature_spec,
    feature_vector,
)

__all__ = ["CATEGORIES", "FEATURE_NAMES", "FEATURE_VERSION", "category_index", "feature_spec", "feature_vector",
           "token_features"]


def token_features(state: DecodeState, token: DraftToken | None, prev_top1: float | None, *,
                   drafter: str | None = None, position: int | None = None) -> list[float]:
    """The feature vector of ``token`` (drafted at ``token.position`` of the block by ``state.drafter``), or, with
    ``token=None``, of a token still to be drafted at ``position`` by ``drafter``: its confidence is unknown, unless
    the drafter peeked (``state.peeks``), whose one proposal gives every token of the block the same confidence."""
    drafter = drafter if drafter is not None else state.drafter
    drafters = state.request.drafters
    if token is None and state.peeks.get(drafter) is not None:
        conf = state.peeks[drafter]
        token = DraftToken(position, *conf)
        prev_top1 = conf[0] if position > 0 else None
    return feature_vector(
        position=token.position if token is not None else position,
        context_len=state.context_len,
        drafter_index=drafters.index(drafter) if drafter in drafters else -1,
        top1=None if token is None else token.top1,
        entropy=None if token is None else token.entropy,
        margin=None if token is None else token.margin,
        prev_top1=prev_top1,
        accept_ema=state.accept_ema.get(drafter) if drafter is not None else None,
        load=state.request.load,
        category=state.request.category,
    )
