"""Exported policies in production decoders (sacpolicy's own drafters are rebuilt from an artifact by
``sacpolicy.build.build_drafters``): transformers' assisted generation (``sacpolicy.export.hf``) and vLLM
(``sacpolicy.export.vllm``). The artifact itself (save, load, verify) lives in ``sacpolicy.runtime.artifact``;
``scripts/export.py`` is the command line.

Decoders that take one static setting (a fixed k, a confidence threshold) get it from the rule at a *reference
state*: the first block of a request, ``REFERENCE_CONTEXT`` committed tokens, no acceptance history, idle load and
an unknown prompt category (``reference_row``).
"""

from __future__ import annotations

import math

import numpy as np

from sacpolicy.runtime.artifact import ArtifactError, PolicyArtifact, load_artifact
from sacpolicy.runtime.features import RowContext, feature_row
from sacpolicy.runtime.rule import Block, DecisionRule
from sacpolicy.runtime.spec import DrafterSpec

REFERENCE_CONTEXT = 256


def resolve(policy) -> tuple[DecisionRule, dict[str, DrafterSpec] | None]:
    """(rule, drafter specs) of an artifact directory, a ``PolicyArtifact`` or a bare ``DecisionRule`` (no specs)."""
    if isinstance(policy, DecisionRule):
        return policy, None
    art = policy if isinstance(policy, PolicyArtifact) else load_artifact(policy)
    return art.rule, art.drafters


def pick_drafter(rule: DecisionRule, specs: dict[str, DrafterSpec] | None, drafter: str | None,
                 kinds: tuple[str, ...]) -> str:
    """``drafter`` if given; else, among the rule's drafters of one of ``kinds``, its fallback drafter or the one
    fastest at the reference state. A bare rule (no specs, so no kinds) must have a single drafter or be told."""
    if drafter is None and specs is None:
        if len(rule.drafters) > 1:
            raise ArtifactError(f"the rule has drafters {list(rule.drafters)} and no drafter specs; pass drafter= "
                                "the one to export (or pass the artifact, whose specs tell the drafter kinds)")
        drafter = rule.drafters[0]
    elif drafter is None:
        fit = [d for d in rule.drafters if specs[d].kind in kinds]
        if not fit:
            raise ArtifactError(f"the policy's drafters {specs} include none of kind {list(kinds)}, which this "
                                "export needs; train a policy with such a drafter")
        drafter = rule.fallback[0] if rule.fallback[0] in fit else max(fit, key=lambda d: _reference_best(rule, d)[1])
    rule.check_drafter(drafter)
    if specs is not None and specs[drafter].kind not in kinds:
        raise ArtifactError(f"drafter {drafter!r} is a {specs[drafter].kind} drafter; this export takes "
                            f"{list(kinds)} drafters")
    return drafter


def reference_row(rule: DecisionRule, drafter: str, position: int, context_len: int = REFERENCE_CONTEXT,
                  top1: float | None = None, prev_top1: float | None = None) -> list[float]:
    """The feature row of position ``position`` at the reference state; with ``top1``, the drafted token's confidence
    is that of the most peaked distribution with this top-1 probability (``peaked``)."""
    ctx = RowContext(context_len=context_len, drafter_index=rule.drafters.index(drafter))
    return feature_row(ctx, position, None if top1 is None else (top1, *peaked(top1)), prev_top1)


def peaked(top1: float) -> tuple[float, float]:
    """(entropy, top-1 minus top-2) of the least uncertain distribution whose largest probability is ``top1``:
    floor(1 / top1) tokens at ``top1`` and one token holding the rest."""
    m = math.floor(1.0 / top1)
    rest = max(0.0, 1.0 - m * top1)
    entropy = -m * top1 * math.log(top1) - (rest * math.log(rest) if rest > 0 else 0.0)
    return entropy, top1 - (top1 if m >= 2 else rest)


def static_k(rule: DecisionRule, drafter: str, context_len: int = REFERENCE_CONTEXT) -> int:
    """One k for ``drafter``: the rule's fallback k (the best static k on validation traces) for the fallback
    drafter, else the cost model's best k for the acceptance the predictor expects at the reference state (0: no k
    beats autoregressive decoding)."""
    return rule.fallback[1] if drafter == rule.fallback[0] else _reference_best(rule, drafter, context_len)[0]


def _reference_best(rule: DecisionRule, drafter: str, context_len: int = REFERENCE_CONTEXT) -> tuple[int, float]:
    """(k, expected tokens/s) of the best k for ``drafter`` at the reference state."""
    rows = np.array([reference_row(rule, drafter, j, context_len) for j in range(rule.k_max)])
    return rule.cost.best_k(drafter, context_len, rule.predictor.predict(rows).tolist(), rule.k_max)


def k_by_batch(rule: DecisionRule, drafter: str, max_batch: int | None = None,
               context_len: int = REFERENCE_CONTEXT) -> list[tuple[int, int, int]] | None:
    """The learned k-by-load map: for every batch size 1..``max_batch`` (default: the largest the cost model was
    profiled at), the one k for all rows (``CostModel.best_batch_k``, shared k) at the acceptance the predictor expects
    at the reference state, as vLLM's ``num_speculative_tokens_per_batch_size`` schedule: inclusive ranges
    ``[(first B, last B, k), ...]`` (k = 0: do not speculate at those sizes). None when the cost model was profiled
    at batch size 1 only."""
    if not rule.cost.batch:
        return None
    top = max_batch or max(rule.cost.batch_sizes)
    rows = np.array([reference_row(rule, drafter, j, context_len) for j in range(rule.k_max)])
    probs = rule.predictor.predict(rows).tolist()
    ks = [rule.cost.best_batch_k([(drafter, context_len, probs)] * b, rule.k_max, per_row=False)[0][0]
          for b in range(1, top + 1)]
    schedule: list[tuple[int, int, int]] = []
    for b, k in enumerate(ks, start=1):
        if schedule and schedule[-1][2] == k:
            schedule[-1] = (schedule[-1][0], b, k)
        else:
            schedule.append((b, b, k))
    return schedule


def confidence_threshold(rule: DecisionRule, drafter: str, context_len: int = REFERENCE_CONTEXT) -> float:
    """The draft top-1 probability below which a static decoder should stop drafting: the smallest t on a 0.01 grid
    from which on (every larger t too) the stop rule keeps drafting after the block's first token at the reference
    state (``reference_row`` fills entropy and margin from t). 1.0 when it never continues, 0.0 (no threshold) when
    it always does or when the rule drafts a fixed k (mode "k")."""
    if rule.mode == "k":
        return 0.0
    ts = np.arange(1, 101) / 100
    keep = [not rule.stop(Block(drafter, context_len, rule.k_max),
                          np.array(reference_row(rule, drafter, 0, context_len, top1=t)),
                          np.array(reference_row(rule, drafter, 1, context_len, prev_top1=t))) for t in ts]
    i = len(ts)
    while i > 0 and keep[i - 1]:
        i -= 1
    return 0.0 if i == 0 else 1.0 if i == len(ts) else float(ts[i])
