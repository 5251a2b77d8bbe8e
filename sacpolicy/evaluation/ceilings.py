"""Ceilings a policy can reach on the test traces, each simulated with the run's cost model, next to the oracle.

- ``per-prompt-static``: the best static (drafter, k) of each prompt, chosen in hindsight on that prompt's traces:
  all that choosing one setting per request could ever win.
- ``learned-<predictor>-in-sample``: the same predictor fitted, calibrated and its decision rule tuned on the test
  traces themselves. It has seen the answers statistically (not step by step), which no deployable policy has, so it
  estimates the ceiling of this predictor on these features; the share of its gain over the best static that the
  learned policy captures is its figure of merit (``metrics.gain_captured``).
- ``oracle`` (``traces.simulate.Oracle``) knows the future step by step: a bound, not a target.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from sacpolicy.policy.baselines import Static

logger = logging.getLogger(__name__)


@dataclass
class InSample:
    """What the in-sample ceiling refits: ``fits`` {predictor name: fitting function, a conf/predictor option
    instantiated}, ``k`` the block length of the example replay (``fit.k``), ``soft`` beta labels (sampled traces)."""

    fits: dict[str, Callable]
    k: int
    soft: bool = False


def per_prompt_static(grouped: dict, cost, *, vocab_size: int, k_max: int, config=None) -> list[tuple]:
    """(category, result) per prompt of ``grouped``, in its order: the replay of that prompt's fastest static
    (drafter, k <= k_max), chosen in hindsight on the prompt itself."""
    from sacpolicy.traces.simulate import simulate

    out = []
    for pid, p in grouped.items():
        best = max((simulate(Static(k, d), {pid: p}, cost, vocab_size=vocab_size, config=config, drafters=[d])
                    for d in p["drafters"] for k in range(1, k_max + 1)), key=lambda s: s.tokens_per_s)
        out += best.results
    return out


def in_sample_rules(grouped: dict, cost, spec: InSample, *, vocab_size: int, k_max: int,
                    config=None) -> tuple[dict, dict]:
    """({predictor name: DecisionRule}, {predictor name: why it has none}): each predictor fitted on ``grouped``
    (train), calibrated on it (val) and tuned on it, with its own hindsight best static as the fallback. Predictors
    that cannot be fitted on these traces alone (too few examples, one label only) go to the second dict."""
    from sacpolicy.traces.simulate import best_static
    from sacpolicy.training.predictor import (  # PredictorError: what fitting raises on traces it cannot fit
        PredictorError,
        acceptance_examples,
        fit_predictor,
        tune_rule,
    )

    ex = acceptance_examples(grouped, cost, vocab_size=vocab_size, k=spec.k, soft=spec.soft)
    ex = _concat(*(dataclasses.replace(ex, split=np.full(len(ex), s)) for s in ("train", "val", "test")))
    static = best_static(grouped, cost, vocab_size=vocab_size, k_max=k_max)["all"]
    rules, skipped = {}, {}
    for name, fit in spec.fits.items():
        try:
            pred, _ = fit_predictor(name, fit, ex)
        except PredictorError as e:
            logger.warning("no in-sample ceiling for %s: %s", name, e)
            skipped[name] = str(e)
            continue
        rules[name], _ = tune_rule(pred, cost, grouped, static, vocab_size=vocab_size, k_max=k_max, config=config)
    return rules, skipped


def _concat(*parts):
    from sacpolicy.training.predictor import Examples

    return Examples(*(np.concatenate([getattr(p, f.name) for p in parts]) for f in dataclasses.fields(Examples)))
