"""THE feature function: live decoding, trace replay and the exported runtime all call ``token_features``.

Features of a drafted token, known the moment it is drafted: the draft's confidence in it and in the previous
drafted token of the block, its position in the block, the context length, the recent acceptance of this drafter,
which drafter, the serving load, and the prompt category when known. A stop rule or k predictor reads these and
nothing else, so a policy trained on traces behaves the same when it decodes live.
"""

from __future__ import annotations

import math

from sacpolicy.policy.base import DecodeState, DraftToken

FEATURE_VERSION = 1
FEATURE_NAMES = (
    "top1", "entropy", "margin", "prev_top1", "position", "log_context_len", "accept_ema", "has_accept_ema",
    "drafter_index", "load", "category_index",
)
# Prompt categories of the embedded prompt sets; anything else (or unknown) maps to "other".
CATEGORIES = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities", "code", "other")


def category_index(category: str | None) -> int:
    return CATEGORIES.index(category) if category in CATEGORIES else CATEGORIES.index("other")


def token_features(state: DecodeState, token: DraftToken, prev_top1: float | None) -> list[float]:
    """The feature vector of ``token`` (drafted at ``token.position`` of the block by ``state.drafter``).

    ``prev_top1`` is the previous drafted token's top-1 probability in this block (None at position 0: then the
    feature is 1.0, "nothing doubtful drafted yet").
    """
    drafter = state.drafter
    ema = state.accept_ema.get(drafter) if drafter is not None else None
    drafters = state.request.drafters
    return [
        float(token.top1),
        float(token.entropy),
        float(token.margin),
        1.0 if prev_top1 is None else float(prev_top1),
        float(token.position),
        math.log1p(state.context_len + token.position),
        0.0 if ema is None else float(ema),
        0.0 if ema is None else 1.0,
        float(drafters.index(drafter)) if drafter in drafters else -1.0,
        float(state.request.load),
        float(category_index(state.request.category)),
    ]
