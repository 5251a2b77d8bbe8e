"""Stage ``fit``: each configured predictor trained on the traces, its decision rule tuned on val traces, saved as
the policy artifact ``policies/<predictor>``.

Sampled traces (temperature > 0) cannot be replayed (``traces.simulate.SampledTracesError``), and rule tuning is a
replay: there the stage skips tuning, logs why, and saves the untuned rule (its default mode and optimism) with the best
static (drafter, k) ranked in expectation from beta as its fallback. Skipping, not refusing: the predictor, trained on
beta labels, is still the right one for sampled decoding; only the tuning's tokens/s would be wrong.
"""

from __future__ import annotations

import logging
import time

from hydra.utils import instantiate

from sacpolicy.pipeline.context import SPLITS, PipelineError, RunContext, command

logger = logging.getLogger(__name__)


def run(ctx: RunContext) -> dict:
    from sacpolicy.evaluation.evaluate import headline_predictor
    from sacpolicy.runtime.artifact import save_policy

    cfg, tracker = ctx.cfg, ctx.tracker
    tf_dir = ctx.traces[2]
    ex = examples(ctx)
    summary = {"examples": {s: int((ex.split == s).sum()) for s in SPLITS}, "soft_labels": ctx.soft_labels,
               "predictors": {}}
    specs = {s.name: s for s in ctx.drafter_specs()}
    static = ctx.best_static()
    for name in cfg.predictor:
        t0 = time.perf_counter()
        pred, metrics, rule, tuning = fit_rule(ctx, name, ex, static, out_dir=ctx.out_dir / "fit" / name,
                                               lightning_logger=ctx.lightning_logger("fit"))
        missing = [d for d in rule.drafters if d not in specs]
        if missing:
            raise PipelineError(f"traces hold drafters {missing} this run cannot rebuild; configure them in draft=")
        save_policy(ctx.out_dir / "policies" / name, rule, drafters={d: specs[d] for d in rule.drafters},
                    provenance={"target": cfg.target.spec, "traces": str(tf_dir), "command": command()},
                    metrics={"predictor": metrics, "tuning": tuning})
        track_calibration(tracker, name, pred, ex.of("test", "known"), ctx.out_dir / "plots")
        summary["predictors"][name] = {
            "metrics": metrics, "mode": rule.mode, "optimism": rule.optimism, "fallback": list(rule.fallback),
            "fit_s": time.perf_counter() - t0, "tuning_skipped": tuning.get("skipped"),
            "val_tokens_per_s": max((r["val_tokens_per_s"] for r in tuning["grid"]), default=None)}
        tracker.log({f"{name}_{split}_{k}": v for split, m in metrics.items() for k, v in m.items()}, "fit")
    summary["headline"] = headline_predictor({n: p["metrics"] for n, p in summary["predictors"].items()})
    return summary


def examples(ctx: RunContext):
    """The acceptance examples of the run's traces, every split (``training.predictor.acceptance_examples``)."""
    from sacpolicy.training.predictor import acceptance_examples

    return acceptance_examples(ctx.traces[0], ctx.cost, vocab_size=ctx.vocab_size, k=ctx.cfg.fit.k,
                               soft=ctx.soft_labels)


def fit_rule(ctx: RunContext, name: str, ex, static: dict, *, out_dir=None, lightning_logger=None):
    """(predictor, its metrics, its decision rule, the rule's tuning table): predictor ``name`` of
    ``cfg.predictor`` fitted on the examples ``ex`` (``examples``), calibrated on val, and its rule tuned on the val
    traces with ``static`` as fallback (``decision_rule``)."""
    from sacpolicy.training.predictor import fit_predictor

    spec = instantiate(ctx.cfg.predictor[name], _convert_="all")
    pred, metrics = fit_predictor(name, spec, ex, out_dir, logger=lightning_logger)
    return (pred, metrics, *decision_rule(ctx, name, pred, static))


def track_calibration(tracker, name: str, pred, test, plot_dir) -> None:
    """The predictor's reliability diagram on the test examples (``plots/calibration_<name>.png``), tracked as
    ``fit/calibration_<name>``; nothing without test examples."""
    from sacpolicy.evaluation.plots import calibration_plot

    if len(test):
        plot = calibration_plot(pred.predict(test.X), test.y, plot_dir / f"calibration_{name}.png",
                                title=f"{name}: acceptance calibration (test, drafted tokens)")
        tracker.image(f"fit/calibration_{name}", plot)


def decision_rule(ctx: RunContext, name: str, pred, static: dict):
    """(rule, tuning table): tuned on the val traces by replay (``tune_rule``), or, on sampled traces, the untuned
    rule with ``static`` as fallback and the reason in the table's ``skipped``."""
    from sacpolicy.runtime.rule import DecisionRule
    from sacpolicy.training.predictor import tune_rule

    val, k_max = ctx.traces[1]["val"], ctx.cfg.fit.k_max
    if not val:
        raise PipelineError("no validation traces to choose the decision rule on; collect traces over val prompts")
    if not ctx.soft_labels:
        return tune_rule(pred, ctx.cost, val, static, vocab_size=ctx.vocab_size, k_max=k_max,
                         config=instantiate(ctx.cfg.decoder))
    reason = ("the traces were sampled (temperature > 0) and the simulator replays greedy traces only; the rule keeps "
              "its default mode and optimism, with the best static k in expectation as fallback. Collect greedy "
              "traces (sampling.temperature=0) to tune it")
    logger.warning("decision rule for %s not tuned: %s", name, reason)
    drafters = tuple(next(iter(val.values()))["drafters"])
    rule = DecisionRule(pred, ctx.cost, drafters, k_max, (static["drafter"], static["k"]))
    return rule, {"grid": [], "skipped": reason, "best_static_val": static}
