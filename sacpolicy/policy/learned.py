"""The learned policy: features from the shared feature function, decisions from the runtime's ``DecisionRule``
(predicted acceptance + the cost model). It adds nothing of its own but reading the decoder's state, so the exported
runtime decides exactly as it does."""

from __future__ import annotations

import sys
from collections import Counter

import numpy as np

from sacpolicy.policy.base import (
    Decision,
    DecodeState,
    DraftToken,
    Policy,
    RequestInfo,
    check_k,
)
from sacpolicy.policy.features import token_features
from sacpolicy.runtime.rule import Block, DecisionRule


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
        self.uses_peeks = True  # an n-gram drafter's match length is known before drafting
        self.block: Block | None = None
        self.prev_top1: float | None = None
        self.request_drafter: str | None = None

    def validate(self, drafters: tuple[str, ...], k_max: int) -> None:
        check_k(self.rule.k_max, k_max, repr(self))
        for i, name in enumerate(drafters):
            self.rule.check_drafter(name)
            if self.rule.drafters.index(name) != i:
                raise ValueError(
                    f"{self!r} was trained with drafters in the order {list(self.rule.drafters)} (the drafter-index "
                    f"feature depends on it), but the decoder holds {list(drafters)}; pass them in the trained order")

    def reset(self, request: RequestInfo) -> None:
        self.request_drafter = None
        self.block, self.prev_top1 = None, None

    def decide(self, state: DecodeState) -> Decision:
        return self.decide_batch([self], [state])[0]

    def decide_batch(self, policies: list[LearnedPolicy], states: list[DecodeState]) -> list[Decision]:
        """One plan for the rows of a batch (``DecisionRule.plan_batch``: the batch's expected tokens/s at its live
        size, rows' k may differ); row i's block state goes to ``policies[i]``, this policy's fork for that row."""
        rows, caps = [], []
        for p, state in zip(policies, states):
            k_cap = min(self.rule.k_max, state.remaining - 1)
            names = state.drafters if p.request_drafter is None else (p.request_drafter,)
            # a drafter that peeked and found nothing to propose is no option this step
            names = tuple(n for n in names if n in state.drafters and not (n in state.peeks and state.peeks[n] is None))
            rows.append({n: np.array([token_features(state, None, None, drafter=n, position=j) for j in range(k_cap)])
                         for n in names} if k_cap > 0 else {})
            caps.append(k_cap)
        with one_blas_thread():
            plans, rate = self.rule.plan_batch(rows, [s.context_len for s in states], caps, per_row=self.per_row,
                                               batch=states[0].batch_size)
        out, together = [], Counter(name for name, k in plans if name is not None and k > 0)
        for p, state, (name, k) in zip(policies, states, plans):
            if p.select == "request" and name is not None:
                p.request_drafter = name
            p.block = Block(name, state.context_len, k, batch=state.batch_size, rows=together[name],
                            rate=rate if state.batch_size > 1 else None) if name is not None else None
            p.prev_top1 = None
            out.append(Decision(name, k) if name is not None else Decision.autoregressive())
        return out

    def should_stop(self, state: DecodeState, token: DraftToken) -> bool:
        row = token_features(state, token, self.prev_top1)
        nxt = token_features(state, None, token.top1, position=token.position + 1)
        self.prev_top1 = token.top1
        with one_blas_thread():
            return self.rule.stop(self.block, np.array(row), np.array(nxt))

    @property
    def fallbacks(self) -> int:
        return self.rule.fallbacks
