"""Stage ``fit``: each configured predictor trained on the traces, its decision rule tuned on val traces, saved as
the policy artifact ``policies/<predictor>``."""

from __future__ import annotations

import time

from hydra.utils import instantiate

from sacpolicy.pipeline.context import SPLITS, PipelineError, RunContext, command


def run(ctx: RunContext) -> dict:
    from sacpolicy.evaluation.plots import calibration_plot
    from sacpolicy.runtime.artifact import save_policy
    from sacpolicy.training.predictor import (
        acceptance_examples,
        fit_predictor,
        tune_rule,
    )

    cfg, tracker = ctx.cfg, ctx.tracker
    grouped, by_split, tf_dir, _ = ctx.traces
    ex = acceptance_examples(grouped, ctx.cost, vocab_size=ctx.vocab_size, k=cfg.fit.k, soft=ctx.soft_labels)
    summary = {"examples": {s: int((ex.split == s).sum()) for s in SPLITS}, "soft_labels": ctx.soft_labels,
               "predictors": {}}
    specs = {s.name: s for s in ctx.drafter_specs()}
    static = ctx.best_static()
    for name, spec in cfg.predictor.items():
        t0 = time.perf_counter()
        pred, metrics = fit_predictor(name, instantiate(spec, _convert_="all"), ex, ctx.out_dir / "fit" / name,
                                      logger=ctx.lightning_logger())
        rule, tuning = tune_rule(pred, ctx.cost, by_split["val"], static, vocab_size=ctx.vocab_size,
                                 k_max=cfg.fit.k_max, config=instantiate(cfg.decoder))
        missing = [d for d in rule.drafters if d not in specs]
        if missing:
            raise PipelineError(f"traces hold drafters {missing} this run cannot rebuild; configure them in draft=")
        save_policy(ctx.out_dir / "policies" / name, rule, drafters={d: specs[d] for d in rule.drafters},
                    provenance={"target": cfg.target.spec, "traces": str(tf_dir), "command": command()},
                    metrics={"predictor": metrics, "tuning": tuning})
        test = ex.of("test", "known")
        if len(test):
            plot = calibration_plot(pred.predict(test.X), test.y, ctx.out_dir / "plots" / f"calibration_{name}.png",
                                    title=f"{name}: acceptance calibration (test, drafted tokens)")
            tracker.image(f"fit/calibration_{name}", plot)
        summary["predictors"][name] = {"metrics": metrics, "mode": rule.mode, "optimism": rule.optimism,
                                       "fallback": list(rule.fallback), "fit_s": time.perf_counter() - t0,
                                       "val_tokens_per_s": max(r["val_tokens_per_s"] for r in tuning["grid"])}
        tracker.log({f"{name}_{split}_{k}": v for split, m in metrics.items() for k, v in m.items()}, "fit")
    return summary
