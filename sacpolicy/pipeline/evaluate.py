"""Stage ``evaluate``: every policy on held-out test prompts, simulated and live (``eval.json``, ``eval.md``,
plots)."""

from __future__ import annotations

from hydra.utils import instantiate

from sacpolicy.pipeline.context import PipelineError, RunContext


def run(ctx: RunContext) -> dict:
    from sacpolicy.evaluation.ceilings import InSample
    from sacpolicy.evaluation.evaluate import evaluate
    from sacpolicy.evaluation.plots import make_plots
    from sacpolicy.evaluation.report import write_eval
    from sacpolicy.runtime.artifact import load_policy

    cfg, out_dir, tracker = ctx.cfg, ctx.out_dir, ctx.tracker
    _, by_split, _, _ = ctx.traces
    rules = {name: load_policy(ctx.need(f"policies/{name}", "evaluate")) for name in cfg.predictor}
    drafters = ctx.drafters
    order = list(next(iter(by_split["val"].values()))["drafters"]) if by_split["val"] else []
    if [d.name for d in drafters] != order:
        raise PipelineError(f"the traces were collected with drafters {order} but this run builds "
                            f"{[d.name for d in drafters]}; use the same draft= setting (and distilled draft)")
    test = [r for r in ctx.take(ctx.prompts("test"), None) if r["prompt_id"] in by_split["test"]]
    settings = instantiate(cfg.eval, _convert_="all")
    # the in-sample ceilings refit every configured predictor as the fit stage did, on the test traces
    in_sample = InSample({name: instantiate(spec, _convert_="all") for name, spec in cfg.predictor.items()},
                         k=cfg.fit.k, soft=ctx.soft_labels)
    rows, meta = evaluate(target=ctx.target, drafters=drafters, cost=ctx.cost, val_grouped=by_split["val"],
                          test_grouped=by_split["test"], test_prompts=test, rules=rules, settings=settings,
                          best_static=ctx.best_static(), sampling=instantiate(cfg.sampling),
                          decoder_config=instantiate(cfg.decoder), in_sample=in_sample)
    write_eval(out_dir, rows, meta)
    plots = make_plots({"rows": rows, "meta": meta}, out_dir / "plots")
    tracker.table("eval/rows", rows)
    tracker.table("eval/per_category", [{"name": r["name"], "mode": r["mode"], "category": c, **v}
                                        for r in rows for c, v in r["per_category"].items()])
    for p in plots:
        tracker.image(f"eval/{p.stem}", p)
    tracker.log({k: v for k, v in meta.items() if isinstance(v, (int, float))}, "evaluate")
    return {"eval": str(out_dir / "eval.json"), "rows": len(rows),
            **{k: v for k, v in meta.items() if k.startswith("learned")}}

