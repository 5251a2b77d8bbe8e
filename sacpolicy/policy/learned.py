"""The learned policy: features from the shared feature function, decisions from the runtime's ``DecisionRule``
(predicted acceptance + the cost model). It adds nothing of its own but reading the decoder's state, so the exported
runtime decides exactly as it does. Where the rule learns while serving (``DecisionRule.online``), each instance keeps
its own learned state (``runtime.online``: the calibration and the shadow guard) and feeds it every verified step
through ``observe``, in whichever host runs it: the decoder, the replay, the vLLM proposer."""

from __future__ import annotations

import logging
import sys
from collections import Counter
from dataclasses import dataclass, replace

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
from sacpolicy.runtime.online import OnlineCalibration, OnlineSettings, ShadowGuard, chain_labels
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
    # learning while serving: the feature rows of the block planned (before drafting) and the fitted predictor's
    # probability of each, from the plan (the stop rule's rows of drafted tokens ride in ``block.predicted``)
    rows: np.ndarray | None = None
    fitted: np.ndarray | None = None


class LearnedPolicy(Policy):
    """``select="step"`` picks the drafter every step; ``"request"`` keeps the first step's choice for the request.
    In a batch, ``per_row=False`` drafts the same k in every row that drafts (``True``: rows may draft less than the
    longest block when their tokens do not pay for their draft time).
    (``sacpolicy.evaluation.evaluate.Timed`` measures the seconds it costs, as for any policy.)"""

    def __init__(self, rule: DecisionRule, name: str = "learned", select: str = "step", per_row: bool = True,
                 online: bool | OnlineSettings | dict | None = None):
        """``online``: learn while serving with these settings (True: the rule's, else the defaults); False: never;
        None: as the rule says (``DecisionRule.online``)."""
        if select not in ("step", "request"):
            raise ValueError(f"select must be 'step' or 'request', got {select!r}")
        settings = (rule.online if online is None else None if online is False
                    else (rule.online or OnlineSettings()) if online is True else OnlineSettings.of(online))
        self.guard: ShadowGuard | None = None
        if settings is not None:  # this instance's own learned state, fresh
            rule = replace(rule, online=settings,
                           calibration=OnlineCalibration(settings, len(rule.drafters), rule.k_max))
            self.guard = ShadowGuard(settings, rule.cost, rule.drafters, rule.k_max)
        else:
            rule = replace(rule, online=None, calibration=None) if rule.calibration is not None else rule
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
        fitted = [] if self.guard is not None else None  # learning: the plan's own predictions, kept for observe
        with one_blas_thread():
            plans, rate = self.rule.plan_batch(feats, [s.context_len for s in states], caps, per_row=self.per_row,
                                               batch=states[0].batch_size, fitted=fitted)
        held = self.guard.held if self.guard is not None else None
        out, together = [], Counter(name for name, k in plans if name is not None and k > 0)
        B = max(states[0].batch_size, len(rows))  # what one more token costs the pass (a "total" pass: its slope)
        token_s = (self.rule.cost.token_seconds(B + sum(k for _, k in plans),
                                                sum(s.context_len for s in states) / len(states), B) if B > 1 else 0.0)
        for i, (row, state, feat, cap, (name, k)) in enumerate(zip(rows, states, feats, caps, plans)):
            mem = row.memory
            if held is not None:  # the guard fell back: its static block where the row can draft it, else AR
                k = min(held[1], cap) if held[0] in feat else 0
                name = held[0] if k > 0 else None
            if self.select == "request" and name is not None:
                mem.request_drafter = name
            planned = name is not None and held is None  # a block the rule planned (the stop rule ends it)
            mem.block = Block(name, state.context_len, k, batch=state.batch_size, rows=together[name],
                              rate=rate if state.batch_size > 1 else None, token_s=token_s) if planned else None
            mem.prev_top1 = None
            if self.guard is not None:
                mem.rows, mem.fitted = (feat[name], fitted[i].get(name)) if name is not None else (None, None)
            out.append(Decision(name, k, guard=held is not None))  # (None, 0): autoregressive
        return out

    def should_stop(self, row: PolicyRow, token: DraftToken) -> bool:
        mem = row.memory
        now = token_features(row.state, token, mem.prev_top1)
        mem.prev_top1 = token.top1
        if mem.block is None or self.rule.mode != "stop":  # a block the stop rule does not end (mode "k", the guard's)
            return False
        nxt = token_features(row.state, None, token.top1, position=token.position + 1)
        with one_blas_thread():
            return self.rule.stop(mem.block, np.array(now), np.array(nxt))

    def observe(self, row: PolicyRow, record) -> None:
        """Learning while serving: a chain's labels (``runtime.online.chain_labels``) teach the calibration, on the
        rows the block was decided with and the fitted predictor's probabilities the decisions already computed (a
        drafted token's row where the stop rule predicted it, else its position's planned row), and the step goes to
        the shadow guard. Token trees teach neither (a tree's accepted path is not a chain's prefix)."""
        if self.guard is None or record.tree:
            return
        mem = row.memory
        self.guard.observe(record.drafter, record.drafted, record.accepted, record.emitted, record.context_len,
                           record.batch_size)
        if not record.drafted or record.drafter is None or mem.rows is None or mem.fitted is None:
            return
        labels = chain_labels(record.drafted, record.accepted)
        predicted = mem.block.predicted if mem.block is not None else {}
        X, p = [], []
        for j in range(len(labels)):
            if j in predicted:
                x, q = predicted[j]
            elif j < len(mem.fitted):
                x, q = mem.rows[j], mem.fitted[j]
            else:  # a position the block was neither planned nor predicted at: its label teaches nothing
                break
            X.append(x)
            p.append(q)
        if X:
            self.rule.calibration.learn(np.asarray(X, dtype=np.float64), np.asarray(p, dtype=np.float64),
                                        np.asarray(labels[: len(X)], dtype=np.float64))
        mem.rows, mem.fitted = None, None

    @property
    def learning(self) -> dict | None:
        """What the policy learned while serving (None: it does not learn): labelled tokens, the guard's state."""
        if self.guard is None:
            return None
        cal = self.rule.calibration
        return {"labels": cal.updates, "skipped": cal.skipped, "calibrated_cells": int(cal.open.sum())} | (
            self.guard.state())

    @property
    def fallbacks(self) -> int:
        return self.rule.fallbacks
