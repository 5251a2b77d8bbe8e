"""How much of the oracle's gain can a policy that does not see the future capture? A decomposition, in simulation.

    python scripts/bench_oracle_gap.py --run outputs/<run>      # a run with collect (traces/tf, cost.json) done

The oracle drafts exactly the run the target will accept, with the best drafter, at every step: it knows the future.
On the run's held-out test traces, each row below is simulated with the run's cost model and decoder settings:
- ``best-static``: the best fixed (drafter, k) chosen on the test traces themselves (in hindsight);
- ``per-prompt-static``: the best fixed (drafter, k) of each prompt, chosen in hindsight for that prompt: all a
  per-request choice could ever win (``sacpolicy.evaluation.ceilings.per_prompt_static``);
- ``learned-hgb``: the fit stage's own recipe (``sacpolicy.pipeline.fit.fit_rule``: fit on train, calibrate and tune
  on val), on test;
- ``learned-hgb-in-sample``: the same predictor fitted, calibrated and tuned on the test traces themselves: it has
  seen the answers statistically (not step by step), which no deployable policy has, so it estimates a ceiling
  for this predictor on these features (``sacpolicy.evaluation.ceilings.in_sample_rules``, the same ceiling every
  run's eval.md reports);
- ``oracle``.
"captured" is (row - best-static) / (oracle - best-static). Every row but ``best-static`` against the best static
chosen on val is in the run's eval.md ("Ceilings"), for every predictor; this table needs only the collect stage.
Prints a Markdown table and writes bench_oracle_gap.json.
"""

from __future__ import annotations

from pathlib import Path

from hydra.utils import instantiate
from omegaconf import OmegaConf

from sacpolicy import bench
from sacpolicy.evaluation.ceilings import InSample, in_sample_rules, per_prompt_static
from sacpolicy.pipeline import fit
from sacpolicy.pipeline.context import RunContext
from sacpolicy.policy.learned import LearnedPolicy
from sacpolicy.traces.simulate import Oracle, best_static, simulate


def main(argv=None):
    ap = bench.parser(__doc__)
    ap.add_argument("--run", required=True, help="a pipeline run directory whose collect stage is done")
    ap.add_argument("--k-max", type=int, default=None, help="longest block (default: the run's fit.k_max)")
    bench.add_out(ap, "bench_oracle_gap.json")
    args = ap.parse_args(argv)

    run = Path(args.run)
    cfg = OmegaConf.load(run / "config.yaml")
    k_max = cfg.fit.k_max = args.k_max or cfg.fit.k_max  # the fit stage's rule tuning reads it from the config
    # the run's traces, cost model, vocabulary and labels exactly as its fit stage read them (from_run included)
    ctx = RunContext(cfg, run)
    by_split = ctx.traces.by_split
    cost, vocab, config = ctx.cost, ctx.vocab_size, instantiate(cfg.decoder)
    test = by_split["test"]
    drafters = list(next(iter(test.values()))["drafters"])

    def tps(policy) -> float:
        return simulate(policy, test, cost, vocab_size=vocab, config=config).tokens_per_s

    rows = {}
    static = best_static(test, cost, vocab_size=vocab, k_max=k_max)["all"]
    rows["best-static"] = static["tokens_per_s"]
    per_prompt = per_prompt_static(test, cost, vocab_size=vocab, k_max=k_max, config=config)
    rows["per-prompt-static"] = sum(len(r.tokens) for _, r in per_prompt) / sum(r.total_s for _, r in per_prompt)
    rows["oracle"] = tps(Oracle(cost, k_max=k_max))

    ex = fit.examples(ctx)
    # the rule's fallback: the best static on val, as the run context computes it (here at this k_max, and not
    # written into the run: its best_static.json is the run's own k_max's)
    val_static = best_static(by_split["val"], cost, vocab_size=vocab, k_max=k_max)["all"]
    _, _, rule, _ = fit.fit_rule(ctx, "hgb", ex, val_static)
    rows["learned-hgb"] = tps(LearnedPolicy(rule))
    # the in-sample ceiling, as every run's evaluation computes it
    spec = instantiate(cfg.predictor.hgb, _convert_="all")  # the run's own hgb settings
    refit, _ = in_sample_rules(test, cost, InSample({"hgb": spec}, k=cfg.fit.k, soft=ctx.soft_labels),
                               vocab_size=vocab, k_max=k_max, config=config)
    if "hgb" in refit:
        rows["learned-hgb-in-sample"] = tps(LearnedPolicy(refit["hgb"]))

    gain = rows["oracle"] - rows["best-static"]
    table = [{"name": n, "tokens_per_s": v, "vs_best_static": v / rows["best-static"],
              "oracle_gain_captured": (v - rows["best-static"]) / gain if gain > 0 else None} for n, v in rows.items()]
    info = {"run": str(run), "test_prompts": len(test), "drafters": drafters, "k_max": k_max, "best_static": static,
            "examples": {s: int((ex.split == s).sum()) for s in ("train", "val", "test")}}
    bench.write_results(args.out, {"rows": table, "meta": info})
    print(f"held-out test traces of {run} ({len(test)} prompts; drafters {drafters}), simulated with its cost model\n")
    print(markdown(table))


def markdown(table: list[dict]) -> str:
    return bench.table(["row", "tokens/s", "vs best static", "share of the oracle's gain"],
                       ([r["name"], f"{r['tokens_per_s']:.1f}", bench.ratio(r["vs_best_static"]),
                         "-" if r["oracle_gain_captured"] is None else f"{r['oracle_gain_captured']:.0%}"]
                        for r in table))


if __name__ == "__main__":
    main()
