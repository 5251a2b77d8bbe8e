"""THE feature vector of a drafted token. Live decoding, trace replay, training and the exported runtime all build it
here (``sacpolicy.policy.features.token_features`` reads a ``DecodeState`` into these arguments), so a predictor sees
the same numbers wherever it runs. numpy-free plain Python: production decoders call it per drafted token.

A token's draft confidence (top-1 probability, entropy, top-1/top-2 margin) is known once it is drafted. Before
drafting (choosing k or the drafter) it is not, unless the drafter can peek at its proposal (the n-gram drafter's
match length, the suffix drafter's frequency estimate of each token it would propose): pass ``top1=None`` and the
three confidence features are NaN with ``conf_known = 0``; predictors are trained on both forms of every example, so
one predictor serves the stop rule and the planner.

A peek (``Peek``) is the confidence of each token the drafter would propose now, in order: as many as it can propose
(at most ``PEEK_MAX``), so a planner also knows how long the proposal is and drafts no position beyond it, and the
token it would propose first. Where two drafters peek, ``agree`` counts the others whose proposal starts with the
same token, less those whose proposal starts with another: two drafters that read the context differently and still
agree are right far more often (on the suffix pool's traces the n-gram drafter's first token was accepted 74% of the
time when the suffix drafter proposed the same one, 14% when it proposed another; docs/benchmarks.md, "Drafters that
agree").
"""

from __future__ import annotations

import math
from dataclasses import dataclass

FEATURE_VERSION = 6  # 3: a peeked proposal's confidence is known before drafting; 4: accept_ema per token at risk;
# 5: a peek gives each proposed token its own confidence (the suffix drafter's differ along its proposal); 6: agree
FEATURE_NAMES = (
    "top1", "entropy", "margin", "conf_known", "prev_top1", "position", "log_context_len", "accept_ema",
    "has_accept_ema", "drafter_index", "load", "category_index", "agree",
)
# Prompt categories of the embedded prompt sets; anything else (or unknown) maps to "other".
CATEGORIES = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities", "code", "other")
CONFIDENCE = slice(0, 3)  # columns that are NaN before the token is drafted
PREV_TOP1 = FEATURE_NAMES.index("prev_top1")  # NaN when the previous drafted token is not drafted yet either
_NAN = float("nan")
ACCEPT_EMA = 0.5  # weight of the newest block in a drafter's acceptance history (exponential moving sums)
PEEK_MAX = 64  # tokens a peek describes at most (any k cap is below it)
Confidence = tuple[float, float, float]  # (top-1, entropy, margin) of a drafted token


class Peek(tuple):
    """A peeked proposal: its tokens' confidence (``Confidence``), in order, as a tuple (never empty: no proposal is
    None), and ``first``, the token it would propose first (None: not told; such a peek agrees with none)."""

    def __new__(cls, confidence, first: int | None = None):
        self = super().__new__(cls, (tuple(c) for c in confidence))
        self.first = None if first is None else int(first)
        return self

    def __repr__(self) -> str:
        return f"Peek({tuple(self)!r}, first={self.first})"


def agreement(peeks, drafter: str | None) -> int:
    """The ``agree`` feature of ``drafter``'s rows (``peeks``: {drafter: Peek or None}): +1 for each other drafter
    whose peeked proposal starts with the token this drafter's does, -1 for each whose proposal starts with another.
    0 is "no evidence" (no other drafter proposed, or this one did not peek: a model or feature drafter's first token
    is unknown before drafting), so a rule served with one peekable drafter (vLLM's n-gram proposer) reads neither
    agreement nor disagreement. A peek that names no first token counts neither way."""
    mine = peeks.get(drafter) if drafter is not None else None
    first = getattr(mine, "first", None)
    if first is None:
        return 0
    others = [getattr(p, "first", None) for name, p in peeks.items() if name != drafter]
    return sum((t == first) - (t != first) for t in others if t is not None)


def next_accept_history(prev: tuple[float, float] | None, accepted: int, drafted: int) -> tuple[float, float]:
    """A drafter's acceptance history after a block of ``drafted`` tokens whose first ``accepted`` were accepted (prev
    None: its first block): moving sums, weight ``ACCEPT_EMA`` per block, of the tokens accepted and of the tokens at
    risk, the accepted ones plus the one rejected when the block ended on a rejection. Their ratio, the ``accept_ema``
    feature (``accept_rate``), estimates the drafter's per-token acceptance whatever lengths the blocks had: a block of
    8 that accepts 2 and rejects the third counts 2 of 3, as a block of 3 does. Accepted / drafted would count 2 of 8
    there, so the feature would depend on the block lengths of whichever policy drafted them: a predictor trained on
    the recording policy's long blocks and read after the learned rule's short ones would see a far better drafter
    than there is."""
    if drafted < 1 or not 0 <= accepted <= drafted:
        raise ValueError(f"a block's history needs 0 <= accepted <= drafted and drafted >= 1, got accepted={accepted}, "
                         f"drafted={drafted}")
    at_risk = accepted + (accepted < drafted)
    if prev is None:
        return float(accepted), float(at_risk)
    return (ACCEPT_EMA * accepted + (1 - ACCEPT_EMA) * prev[0], ACCEPT_EMA * at_risk + (1 - ACCEPT_EMA) * prev[1])


def accepted_prefix(block, committed) -> int:
    """The drafted ``block``'s tokens that were accepted, given the tokens ``committed`` since it was drafted (int
    sequences): those equal to the block up to the first that differs, at most len(committed) - 1 (the token
    verification commits in place of a rejected draft token never equals it: greedy picks another token, rejection
    sampling draws from a residual without it)."""
    n = 0
    for d, t in zip(block, committed):
        if int(d) != int(t):
            break
        n += 1
    return min(n, max(len(committed) - 1, 0))


def accept_rate(history: tuple[float, float] | None) -> float | None:
    """The ``accept_ema`` feature of a drafter's acceptance history (None: no block yet)."""
    return None if history is None else history[0] / history[1]


def category_index(category: str | None) -> int:
    return CATEGORIES.index(category) if category in CATEGORIES else CATEGORIES.index("other")


def feature_spec() -> dict:
    """What an exported predictor was trained on; the runtime refuses a predictor whose spec differs."""
    return {"version": FEATURE_VERSION, "names": list(FEATURE_NAMES), "categories": list(CATEGORIES),
            "accept_ema_weight": ACCEPT_EMA, "accept_ema": "accepted / at risk"}


def feature_vector(*, position: int, context_len: int, drafter_index: int, top1: float | None = None,
                   entropy: float | None = None, margin: float | None = None, prev_top1: float | None = None,
                   accept_ema: float | None = None, load: float = 0.0, category: str | None = None,
                   agree: int = 0) -> list[float]:
    """Features of the token drafted at ``position`` (0-based in the block) on top of ``context_len`` committed tokens.

    ``prev_top1``: the previous drafted token's top-1 probability in this block; None at position 0 (then 1.0,
    "nothing doubtful drafted yet") or when unknown further in (NaN). ``accept_ema``: this drafter's recent per-token
    acceptance in the request (``accept_rate``), None before its first block. ``drafter_index``: its index among the
    decoder's drafters. ``agree``: other drafters whose peeked proposal starts with this one's first token, less those
    whose proposal starts with another (``agreement``).
    """
    known = top1 is not None
    if prev_top1 is None:
        prev_top1 = 1.0 if position == 0 else _NAN
    return [
        float(top1) if known else _NAN,
        float(entropy) if known else _NAN,
        float(margin) if known else _NAN,
        1.0 if known else 0.0,
        float(prev_top1),
        float(position),
        math.log1p(context_len + position),
        0.0 if accept_ema is None else float(accept_ema),
        0.0 if accept_ema is None else 1.0,
        float(drafter_index),
        float(load),
        float(category_index(category)),
        float(agree),
    ]


@dataclass(frozen=True)
class RowContext:
    """What a decoder knows of a block before drafting it; ``feature_row`` turns it into feature rows. ``peek``: the
    confidence of each token a peekable drafter (n-gram, suffix) would propose now (``Peek``); ``agree``: the other
    drafters whose peeked proposal starts with the same token, less those starting with another (``agreement``)."""

    context_len: int
    drafter_index: int
    accept_ema: float | None = None
    load: float = 0.0
    category: str | None = None
    peek: Peek | None = None
    agree: int = 0

    def plannable(self, k: int) -> int:
        """Positions of a block of at most ``k`` tokens this drafter can draft: ``k``, or its peeked proposal's
        length when shorter."""
        return k if self.peek is None else min(k, len(self.peek))


def feature_row(ctx: RowContext, position: int, token: tuple[float, float, float] | None = None,
                prev_top1: float | None = None) -> list[float]:
    """THE row builder. The row of the token at ``position`` of the block: drafted (``token``: its (top-1, entropy,
    margin)), or still to be drafted (``token=None``): then its confidence, and the previous token's, are the peeked
    proposal's when the drafter peeked and proposes that far, else unknown."""
    if token is None and ctx.peek is not None and position < len(ctx.peek):
        token, prev_top1 = ctx.peek[position], (ctx.peek[position - 1][0] if position > 0 else None)
    top1, entropy, margin = token if token is not None else (None, None, None)
    return feature_vector(position=position, context_len=ctx.context_len, drafter_index=ctx.drafter_index, top1=top1,
                          entropy=entropy, margin=margin, prev_top1=prev_top1, accept_ema=ctx.accept_ema,
                          load=ctx.load, category=ctx.category, agree=ctx.agree)


def plan_rows(ctx: RowContext, k: int) -> list[list[float]]:
    """Rows of the positions 0 .. k-1 of a block still to be drafted that the drafter can draft
    (``RowContext.plannable``): what a planner choosing k and drafter reads."""
    return [feature_row(ctx, j) for j in range(ctx.plannable(k))]


def peek_of(confidence, length: int, first: int | None = None) -> Peek | None:
    """A one-proposal drafter's peek (n-gram: one confidence for every token it copies): ``confidence`` for each of
    ``length`` tokens (at most ``PEEK_MAX``), the first of them ``first``; None when it proposes nothing."""
    return Peek((confidence,) * min(length, PEEK_MAX), first) if length > 0 else None
