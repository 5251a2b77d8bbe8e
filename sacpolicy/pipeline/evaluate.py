"""Stage ``evaluate``: every policy on held-out test prompts, simulated and live (``eval.json``, ``eval.md``,
plots)."""

from __future__ import annotations

from hydra.utils import instantiate

from sacpolicy.pipeline.context import PipelineError, RunContext, eval_settings


def run(ctx: RunContext) -> dict:
    from sacpolicy.evaluation.ceilings import InSample
    from sacpolicy.evaluation.evaluate import evaluate
    from sacpolicy.evaluation.plots import make_plots
    from sacpolicy.evaluation.report import write_eval

    cfg, out_dir, tracker = ctx.cfg, ctx.out_dir, ctx.tracker
    by_split = ctx.traces.by_split
    rules, headline = ctx.learned_rules("evaluate")
    drafters = ctx.drafters
    order = list(next(iter(by_split["val"].values()))["drafters"]) if by_split["val"] else []
    if [d.name for d in drafters] != order:
        raise PipelineError(f"the traces were collected with drafters {order} but this run builds "
                            f"{[d.name for d in drafters]}; use the same draft= setting (and distilled draft)")
    test = ctx.test_prompts()
    settings = eval_settings(cfg)
    # the in-sample ceilings refit every configured predictor as the fit stage did, on the test traces
    in_sample = InSample({name: instantiate(spec, _convert_="all") for name, spec in cfg.predictor.items()},
                         k=cfg.fit.k, soft=ctx.soft_labels) if settings.ceilings else None
    rows, meta = evaluate(target=ctx.target, drafters=drafters, cost=ctx.cost, val_grouped=by_split["val"],
                          test_grouped=by_split["test"], test_prompts=test, rules=rules, settings=settings,
                          best_static=ctx.best_static(), sampling=instantiate(cfg.sampling),
                          decoder_config=instantiate(cfg.decoder), in_sample=in_sample, headline=headline)
    write_eval(out_dir, rows, meta)
    track(tracker, rows, make_plots({"rows": rows, "meta": meta}, out_dir / "plots"))
    tracker.log({k: v for k, v in meta.items() if isinstance(v, (int, float))}, "evaluate")
    return {"eval": str(out_dir / "eval.json"), "rows": len(rows),
            **{k: v for k, v in meta.items() if k.startswith("learned")}}


BARS = {"tokens_per_s": "tokens/s", "tokens_per_call": "tokens per target call"}  # row key -> chart title
HISTOGRAMS = {"k_hist": "k_chosen", "accept_hist": "accepted_len"}  # row key -> tracker name (its own W&B section)


def track(tracker, rows: list[dict], plots: list) -> None:
    """What the tracker keeps of the evaluation rows: the table (``eval/rows``) and its per-category rows
    (``eval/per_category``), 95% intervals as ``_lo``/``_hi`` columns; a bar chart of each ``BARS`` key over the
    policies of each mode (``eval/tokens_per_s_live``, ...); each policy's histograms of the k it chose (0: an
    autoregressive step) and of the tokens accepted per drafting step (``k_chosen/<policy> (<mode>)``,
    ``accepted_len/...``); the plots (``eval/<plot>``)."""
    tracker.table("eval/rows", rows)
    tracker.table("eval/per_category", [{"name": r["name"], "mode": r["mode"], "category": c, **v}
                                        for r in rows for c, v in r["per_category"].items()])
    for mode in dict.fromkeys(r["mode"] for r in rows):
        for key, title in BARS.items():
            tracker.bar(f"eval/{key}_{mode}", {r["name"]: r[key] for r in rows if r["mode"] == mode}, value=key,
                        title=f"{title} ({mode})")
    for key, name in HISTOGRAMS.items():
        tracker.histograms(name, {f"{r['name']} ({r['mode']})": r[key] for r in rows})
    for p in plots:
        tracker.image(f"eval/{p.stem}", p)
