"""Stage ``fit``: each configured predictor trained on the traces, its decision rule tuned on val traces, saved as
the policy artifact ``policies/<predictor>``, which records the sampling settings of the traces it was fitted on.

Sampled traces (temperature > 0) label each drafted position with beta, its acceptance probability, and the rule is
tuned by the expected-value replay (``traces.draws``) where greedy traces replay exactly.
"""

from __future__ import annotations

import time

from hydra.utils import instantiate

from sacpolicy.pipeline.context import SPLITS, PipelineError, RunContext, command
from sacpolicy.runtime.online import OnlineSettings


def run(ctx: RunContext) -> dict:
    from sacpolicy.evaluation.evaluate import headline_predictor

    cfg = ctx.cfg
    tf_dir = ctx.traces.dir
    ex = examples(ctx)
    summary = {"examples": {s: int((ex.split == s).sum()) for s in SPLITS}, "soft_labels": ctx.soft_labels,
               "predictors": {}}
    specs = {s.name: s for s in ctx.drafter_specs()}
    static = ctx.best_static()
    provenance = {"target": cfg.target.spec, "traces": str(tf_dir), "command": command()}
    for name in cfg.predictor:
        summary["predictors"][name] = fit_policy(ctx, name, ex, static, specs, provenance)
    summary["headline"] = headline_predictor({n: p["metrics"] for n, p in summary["predictors"].items()})
    return summary


def fit_policy(ctx: RunContext, name: str, ex, static: dict, specs: dict, provenance: dict) -> dict:
    """Predictor ``name`` fitted on ``ex`` and its rule tuned (``fit_rule``), saved as ``policies/<name>`` of the run
    (``specs``: how to rebuild each drafter, by name), its calibration tracked; returns its ``fit.json`` entry. The
    one fitting path of the fit stage and of stage ``refit`` (production traces)."""
    from sacpolicy.runtime.artifact import save_policy

    t0 = time.perf_counter()
    pred, metrics, rule, tuning = fit_rule(ctx, name, ex, static, out_dir=ctx.out_dir / "fit" / name,
                                           lightning_logger=ctx.lightning_logger("fit"))
    missing = [d for d in rule.drafters if d not in specs]
    if missing:
        raise PipelineError(f"traces hold drafters {missing} this run cannot rebuild; configure them in draft=")
    save_policy(ctx.out_dir / "policies" / name, rule, drafters={d: specs[d] for d in rule.drafters},
                provenance=provenance, metrics={"predictor": metrics, "tuning": tuning})
    track_calibration(ctx.tracker, name, pred, ex.of("test", "known"), ctx.out_dir / "plots", soft=ctx.soft_labels)
    ctx.tracker.log({f"{name}_{split}_{k}": v for split, m in metrics.items() for k, v in m.items()}, "fit")
    return {"metrics": metrics, "mode": rule.mode, "optimism": rule.optimism, "fallback": list(rule.fallback),
            "online": None if rule.online is None else rule.online.to_dict(),
            "fit_s": time.perf_counter() - t0, "tuning_replay": tuning["replay"],
            "fitted_sampling": {k: pred.meta[f"fitted_{k}"] for k in ("temperature", "top_p")},
            "val_tokens_per_s": max((r["val_tokens_per_s"] for r in tuning["grid"]), default=None)}


def examples(ctx: RunContext):
    """The acceptance examples of the run's traces, every split (``training.predictor.acceptance_examples``)."""
    from sacpolicy.training.predictor import acceptance_examples

    return acceptance_examples(ctx.traces.grouped, ctx.cost, vocab_size=ctx.vocab_size, k=ctx.cfg.fit.k,
                               soft=ctx.soft_labels)


def fit_rule(ctx: RunContext, name: str, ex, static: dict, *, out_dir=None, lightning_logger=None, val=None):
    """(predictor, its metrics, its decision rule, the rule's tuning table): predictor ``name`` of
    ``cfg.predictor`` fitted on the examples ``ex`` (``examples``), calibrated on val, and its rule tuned on the val
    traces (``val``, grouped; default the run's) with ``static`` as fallback (``decision_rule``). The predictor's meta
    records the sampling settings of the traces (``fitted_temperature``, ``fitted_top_p``:
    ``DecisionRule.sampling_mismatch`` reads them)."""
    from sacpolicy.traces.schema import trace_sampling
    from sacpolicy.training.predictor import fit_predictor

    spec = instantiate(ctx.cfg.predictor[name], _convert_="all")
    pred, metrics = fit_predictor(name, spec, ex, out_dir, logger=lightning_logger)
    pred.meta.update({f"fitted_{k}": v for k, v in trace_sampling(ctx.traces.meta).items()})
    return (pred, metrics, *decision_rule(ctx, name, pred, static, val=val))


def track_calibration(tracker, name: str, pred, test, plot_dir, soft: bool = False) -> None:
    """The predictor's reliability diagram on the test examples (``plots/calibration_<name>.png``), tracked as
    ``fit/calibration_<name>``; nothing without test examples. ``soft``: beta labels (sampled traces), so each bin
    compares the mean prediction with the mean beta, the acceptance rate a sampled draft of those tokens has."""
    from sacpolicy.evaluation.plots import calibration_plot

    if len(test):
        what = "mean beta (expected acceptance)" if soft else "observed frequency"
        plot = calibration_plot(pred.predict(test.X), test.y, plot_dir / f"calibration_{name}.png",
                                title=f"{name}: acceptance calibration (test, drafted tokens)", observed=what)
        tracker.image(f"fit/calibration_{name}", plot)


def decision_rule(ctx: RunContext, name: str, pred, static: dict, val=None):
    """(rule, tuning table): tuned on the val traces (``val``, grouped; default the run's) by replay (``tune_rule``:
    exact on greedy traces, in expectation on sampled ones), with ``static`` as fallback; the table says which replay
    (``replay``)."""
    from sacpolicy.traces.draws import replay_kind
    from sacpolicy.training.predictor import tune_rule

    val, k_max = ctx.traces.by_split["val"] if val is None else val, ctx.cfg.fit.k_max
    if not val:
        raise PipelineError("no validation traces to choose the decision rule on; collect traces over val prompts")
    online = ctx.cfg.fit.get("online")
    rule, table = tune_rule(pred, ctx.cost, val, static, vocab_size=ctx.vocab_size, k_max=k_max,
                            config=instantiate(ctx.cfg.decoder),
                            online=None if online is None else OnlineSettings.of(dict(online)))
    return rule, {**table, "replay": replay_kind(val)}
