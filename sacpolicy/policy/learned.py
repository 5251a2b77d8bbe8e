"""The learned policy: features from the shared feature function, decisions from the runtime's ``DecisionRule``
(predicted acceptance + the cost model). It adds nothing of its own but reading the decoder's state, so the exported
runtime decides exactly as it does."""

from __future__ import annotations

import logging
import sys
from collections import Counter
from dataclasses import dataclass

import numpy as np

from sacpolicy.decoding.controller import room
from sacpolicy.policy.base import (
    Decision,
    DraftToken,
    Policy,
    PolicyRow,
    RequestInfo,
    check_k,
)
from sacpolicy.policy.features import row_context, token_features
from sacpolicy.runtime.features import plan_rows
from sacpolicy.runtime.rule import Block, DecisionRule

logger = logging.getLogger(__name__)

_BLAS: list = [None, -1]  # (the controller, len(sys.modules) when it was made)


def _blas():
    """threadpoolctl's controller of the loaded BLAS libraries, made again whenever modules were imported since (an
    import can load another BLAS, e.g. OpenCV's own OpenBLAS, which a controller made before it would leave alone)."""
    from threadpoolctl import ThreadpoolController

    if _BLAS[0] is None or _BLAS[1] != len(sys.modules):
        _BLAS[:] = [ThreadpoolController(), len(sys.modules)]
    return _BLAS[0]


def one_blas_thread():
    """numpy's BLAS on one thread while the policy runs (a context manager). Its matrices are tiny, and a multi-threaded
    OpenBLAS keeps its threads spinning after a call, on the cores the target's next forward needs, which slows the
    target's passes while the policy's own time looks unchanged (docs/benchmarks.md, "Policy compute")."""
    return _blas().limit(limits=1, user_api="blas")


@dataclass
class LearnedMemory:
    """The learned policy's memory of one request."""

    block: Block | None = None  # the block being drafted (the stop rule reads it)
    prev_top1: float | None = None  # the last drafted token's confidence
    request_drafter: str | None = None  # select="request": the drafter the request's first plan chose


class LearnedPolicy(Policy):
    """``select="step"`` picks the drafter every step; ``"request"`` keeps the first step's choice for the request.
    In a batch, ``per_row=False`` drafts the same k in every row that drafts (``True``: rows may draft less than the
    longest block when their tokens do not pay for their draft time).
    (``sacpolicy.evaluation.evaluate.Timed`` measures the seconds it costs, as for any policy.)"""

    def __init__(self, rule: DecisionRule, name: str = "learned", select: str = "step", per_row: bool = True):
        if select not in ("step", "request"):
            raise ValueError(f"select must be 'step' or 'request', got {select!r}")
        self.rule, self.name, self.select, self.per_row = rule, name, select, per_row
        self.needs_token_feedback = rule.mode == "stop"
        self.uses_peeks = True  # a peekable drafter's proposal (its length, each token's confidence) is known first
        self.warned = False  # about decoding at sampling settings the rule was not fitted for (once per policy)

    def validate(self, drafters: tuple[str, ...], k_max: int) -> None:
        check_k(self.rule.k_max, k_max, repr(self))
        for i, name in enumerate(drafters):
            self.rule.check_drafter(name)
            if self.rule.drafters.index(name) != i:
                raise ValueError(
                    f"{self!r} was trained with drafters in the order {list(self.rule.drafters)} (the drafter-index "
                    f"feature depends on it), but the decoder holds {list(drafters)}; pass them in the trained order")

    def start(self, request: RequestInfo) -> LearnedMemory:
        """A request's memory; the first request decoded at sampling settings the rule was not fitted for
        (``DecisionRule.sampling_mismatch``) logs a warning, once per policy."""
        if not self.warned and request.sampling is not None:
            why = self.rule.sampling_mismatch(request.sampling.temperature, request.sampling.top_p)
            if why:
                logger.warning("%r: %s", self, why)
                self.warned = True
        return LearnedMemory()

    def decide(self, rows: list[PolicyRow]) -> list[Decision]:
        """One plan for the rows of a batch (``DecisionRule.plan_batch``: the batch's expected tokens/s at its live
        size, rows' k may differ); each row's block goes to its memory, for the stop rule."""
        states = [row.state for row in rows]
        feats, caps = [], []
        for row, state in zip(rows, states):
            k_cap = room(state.remaining, self.rule.k_max)
            mem = row.memory
            names = state.drafters if mem.request_drafter is None else (mem.request_drafter,)
            # a drafter that peeked and found nothing to propose is no option this step
            names = tuple(n for n in names if n in state.drafters and not (n in state.peeks and state.peeks[n] is None))
            # a peeked proposal shorter than the cap: rows for the positions it reaches (the rule drafts no further)
            feats.append({n: np.array(plan_rows(row_context(state, n), k_cap)) for n in names} if k_cap > 0 else {})
            caps.append(k_cap)
        with one_blas_thread():
            plans, rate = self.rule.plan_batch(feats, [s.context_len for s in states], caps, per_row=self.per_row,
                                               batch=states[0].batch_size)
        out, together = [], Counter(name for name, k in plans if name is not None and k > 0)
        for row, state, (name, k) in zip(rows, states, plans):
            mem = row.memory
            if self.select == "request" and name is not None:
                mem.request_drafter = name
            mem.block = Block(name, state.context_len, k, batch=state.batch_size, rows=together[name],
                              rate=rate if state.batch_size > 1 else None) if name is not None else None
            mem.prev_top1 = None
            out.append(Decision(name, k) if name is not None else Decision.autoregressive())
        return out

    def should_stop(self, row: PolicyRow, token: DraftToken) -> bool:
        mem = row.memory
        now = token_features(row.state, token, mem.prev_top1)
        nxt = token_features(row.state, None, token.top1, position=token.position + 1)
        mem.prev_top1 = token.top1
        with one_blas_thread():
            return self.rule.stop(mem.block, np.array(now), np.array(nxt))

    @property
    def fallbacks(self) -> int:
        return self.rule.fallbacks
