"""Per drafted token statistics of a step, for the step records (``StepRecord.top1`` ... ``beta``), made only when a
caller asks (``DecoderConfig.step_stats``: trace studies, tests): decoding itself never reads them, and each costs
full-vocabulary passes per step."""

from __future__ import annotations

import torch

from sacpolicy.decoding.sampling import (
    SamplingConfig,
    acceptance_stats,
    copy_acceptance_stats,
    draft_stats,
    probs_from_logits,
    probs_stats,
)
from sacpolicy.decoding.types import DraftBlock

_T1 = SamplingConfig(temperature=1.0)  # distributions behind the records when decoding greedily


def block_stats(block: DraftBlock, logits: torch.Tensor, pq: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
    """[k, 6] = draft (top1, entropy, margin) + (q(x), p(x), beta), on the device. ``logits`` [>= k, V]: the target's
    at the block's positions. ``pq``: the processed (p, q) verification used when sampling; None when greedy, where
    the records use temperature-1 distributions (the processed ones are one-hot) so that they stay informative."""
    k = block.k
    if pq is None:  # greedy: temperature-1 softmax of the target and, for a model draft, of the draft, made once
        p = probs_from_logits(logits[:k], _T1)
        if block.logits is None:  # a copy: q is one-hot, nothing [k, V] to build
            return torch.cat([copy_confidence(block), copy_acceptance_stats(p, block.tokens)], dim=-1)
        q = probs_from_logits(block.logits, _T1)
        return torch.cat([probs_stats(q), acceptance_stats(p, q, block.tokens)], dim=-1)
    p, q = pq
    if block.logits is None:
        conf = copy_confidence(block)
    else:
        conf = block.confidence if block.confidence is not None else draft_stats(block.logits)
    return torch.cat([conf, acceptance_stats(p, q, block.tokens)], dim=-1)


def copy_confidence(block: DraftBlock) -> torch.Tensor:
    """[k, 3] confidence of a deterministic proposal: the drafter's own, else certain."""
    device = block.tokens.device
    if block.confidence is not None:
        return block.confidence.to(device, torch.float32)
    return torch.tensor([[1.0, 0.0, 1.0]], device=device).expand(block.k, 3)
