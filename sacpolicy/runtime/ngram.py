"""Prompt lookup (n-gram) proposals in numpy: the one matcher and confidence formula that sacpolicy's
``NgramDrafter`` and the vLLM proposer share, so a policy sees the same proposal and confidence in both."""

from __future__ import annotations

import numpy as np

MAX_NGRAM, MIN_NGRAM = 3, 1  # default longest and shortest suffix matched


def ngram_match(context, max_ngram: int = MAX_NGRAM, min_ngram: int = MIN_NGRAM) -> tuple[int, int] | None:
    """(start of the tokens that followed the most recent earlier occurrence of the context's last n tokens, n),
    longest n first (``max_ngram`` down to ``min_ngram``); None without a match. context: 1-d ints."""
    context = np.asarray(context)
    L = len(context)
    for n in range(min(max_ngram, L - 1), min_ngram - 1, -1):
        # windows of context[:-1] so every match has at least one following token
        windows = np.lib.stride_tricks.sliding_window_view(context[: L - 1], n)
        hits = np.flatnonzero((windows == context[L - n :]).all(axis=1))
        if hits.size:
            return int(hits[-1]) + n, n
    return None


def ngram_confidence(n: int, max_ngram: int) -> tuple[float, float, float]:
    """(top-1, entropy, margin) of a proposal copied after a matched suffix of n tokens: a longer match predicts the
    continuation better, so top-1 = margin = n / max_ngram, entropy 0."""
    return n / max_ngram, 0.0, n / max_ngram


def ngram_proposal(context, k: int, max_ngram: int = MAX_NGRAM, min_ngram: int = MIN_NGRAM) -> list[int]:
    """The n-gram drafter's proposal of at most k tokens (empty without a match)."""
    m = ngram_match(context, max_ngram, min_ngram)
    return [] if m is None else np.asarray(context)[m[0] : m[0] + k].tolist()
