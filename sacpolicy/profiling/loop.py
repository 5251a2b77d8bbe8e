"""The decoder's own work per step, timed: the real ``SpeculativeDecoder`` decodes a few tokens per drafter and k,
and what its steps take beyond the passes a ``CostModel`` prices (sampling, verification, statistics, the loop, and
what the drafters' passes cost inside the loop beyond their isolated timing: caches the target's pass has evicted) is
what ``fit_step_overhead`` turns into ``CostModel.step_base`` and ``step_draft``. ``profile(..., sampling=...)``
calls it at the middle profiled context."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch

from sacpolicy.decoding.sampling import SamplingConfig
from sacpolicy.runtime.cost import CostModel

__all__ = ["decoder_steps", "loop_prompt"]


def loop_prompt(vocab_size: int, context_len: int, gen) -> torch.Tensor:
    """A prompt of context_len tokens: one random stretch (32 tokens, fewer in a short context) repeated, so that a
    copying drafter (n-gram) finds matches and drafts as a model drafter does (the target tends to continue it)."""
    period = max(2, min(32, context_len // 4))
    stretch = torch.randint(vocab_size, (period,), generator=gen)
    return stretch.repeat(context_len // period + 1)[:context_len]


def decoder_steps(target, named: dict, cost: CostModel, sampling: SamplingConfig, ks: Sequence[int],
                  context_len: int, new_tokens: int, repeats: int, seed: int, gen) -> tuple[list, dict]:
    """The real decoder (``SpeculativeDecoder``, one row, static k per drafter, and autoregressive) timed against
    ``cost``'s passes: -> ([seconds per step beyond them, autoregressive steps], {drafter: [(tokens drafted, seconds
    beyond them)]}), the loop's own time outside the timed phases spread evenly over each request's steps. Every
    (drafter, k) decodes ``new_tokens`` from ``loop_prompt`` once a round, each round starting one cell later."""
    from sacpolicy.decoding.decoder import DecoderConfig, SpeculativeDecoder
    from sacpolicy.policy.baselines import Static

    prompt = loop_prompt(target.config.vocab_size, context_len, gen).to(next(target.parameters()).device)
    cells = [(None, 0)] + [(name, k) for name in named for k in sorted(set(ks)) if k > 0]
    base, drafted = [], {name: [] for name in named}
    for r in range(repeats + 1):  # round 0 warms up
        for i in range(len(cells)):
            name, k = cells[(i + r) % len(cells)]
            decoder = SpeculativeDecoder(target, named, Static(k, name), replace(sampling, seed=seed + r),
                                         DecoderConfig(k_max=max(ks)), stop_token_ids=[])
            result = decoder.generate(prompt, new_tokens)
            if r == 0 or not result.steps:
                continue
            steps = result.steps
            loop = (result.total_s - result.prefill_s - sum(s.draft_s + s.verify_s for s in steps)) / len(steps)
            for s in steps:
                beyond = s.draft_s + s.verify_s + loop - cost.step_time(s.drafter, s.drafted, s.context_len)
                if s.drafter is not None and s.drafted:
                    drafted[s.drafter].append((s.drafted, beyond))
                else:  # nothing drafted (an n-gram lookup may find nothing): priced as an autoregressive step
                    base.append(beyond)
    return base, drafted
