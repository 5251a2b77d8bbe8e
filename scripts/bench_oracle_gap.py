"""How much of the oracle's gain can a policy that does not see the future capture? A decomposition, in simulation.

    python scripts/bench_oracle_gap.py --run outputs/<run>      # a run with collect (traces/tf, cost.json) done

The oracle drafts exactly the run the target will accept, with the best drafter, at every step: it knows the future.
On the run's held-out test traces, each row below is simulated with the run's cost model:
- ``best-static``: the best fixed (drafter, k) chosen on the test traces themselves (in hindsight);
- ``per-prompt-static``: the best fixed (drafter, k) of each prompt, chosen in hindsight for that prompt: all a
  per-request choice could ever win;
- ``learned-hgb``: the pipeline's recipe (fit on train, calibrate and tune on val), on test;
- ``learned-hgb-in-sample``: the same predictor fitted, calibrated and tuned on the test traces themselves: it has
  seen the answers statistically (not step by step), which no deployable policy has, so it estimates a ceiling
  for this predictor on these features;
- ``oracle``.
"captured" is (row - best-static) / (oracle - best-static). Prints a Markdown table and writes bench_oracle_gap.json.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import numpy as np
from hydra.utils import instantiate
from omegaconf import OmegaConf

from sacpolicy.io import write_json
from sacpolicy.pipeline.context import RunContext
from sacpolicy.policy.learned import LearnedPolicy
from sacpolicy.policy.rules import Static
from sacpolicy.traces.simulate import Oracle, best_static, simulate
from sacpolicy.training.predictor import (
    Examples,
    acceptance_examples,
    fit_predictor,
    tune_rule,
)


def relabel(ex: Examples, split: str) -> Examples:
    return dataclasses.replace(ex, split=np.full(len(ex), split))


def concat(*parts: Examples) -> Examples:
    return Examples(*(np.concatenate([getattr(p, f.name) for p in parts]) for f in dataclasses.fields(Examples)))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", required=True, help="a pipeline run directory whose collect stage is done")
    ap.add_argument("--k-max", type=int, default=None, help="longest block (default: the run's fit.k_max)")
    ap.add_argument("--out", default="bench_oracle_gap.json")
    args = ap.parse_args(argv)

    run = Path(args.run)
    cfg = OmegaConf.load(run / "config.yaml")
    k_max = args.k_max or cfg.fit.k_max
    # the run's traces, cost model, vocabulary and labels exactly as its fit stage read them (from_run included)
    ctx = RunContext(cfg, run)
    grouped, by_split, _, _ = ctx.traces
    cost, vocab = ctx.cost, ctx.vocab_size
    test = by_split["test"]
    drafters = list(next(iter(test.values()))["drafters"])

    def tps(policy, prompts=test) -> float:
        return simulate(policy, prompts, cost, vocab_size=vocab).tokens_per_s

    rows = {}
    static = best_static(test, cost, vocab_size=vocab, k_max=k_max)["all"]
    rows["best-static"] = static["tokens_per_s"]
    # per prompt, in hindsight: simulate each prompt alone and add up tokens and seconds
    tokens = seconds = 0.0
    for pid, p in test.items():
        best = max((simulate(Static(k, d), {pid: p}, cost, vocab_size=vocab, drafters=[d])
                    for d in drafters for k in range(1, k_max + 1)), key=lambda s: s.tokens_per_s)
        tokens += best.tokens
        seconds += best.predicted_s
    rows["per-prompt-static"] = tokens / seconds
    rows["oracle"] = tps(Oracle(cost, k_max=k_max))

    ex = acceptance_examples(grouped, cost, vocab_size=vocab, k=cfg.fit.k, soft=ctx.soft_labels)
    spec = instantiate(cfg.predictor.hgb, _convert_="all")  # the run's own hgb settings
    pred, _ = fit_predictor("hgb", spec, ex)
    rule, _ = tune_rule(pred, cost, by_split["val"], best_static(by_split["val"], cost, vocab_size=vocab,
                                                                 k_max=k_max)["all"], vocab_size=vocab, k_max=k_max)
    rows["learned-hgb"] = tps(LearnedPolicy(rule))
    t = ex.of("test")
    pred_in, _ = fit_predictor("hgb", spec, concat(relabel(t, "train"), relabel(t, "val"), t))
    rule_in, _ = tune_rule(pred_in, cost, test, static, vocab_size=vocab, k_max=k_max)
    rows["learned-hgb-in-sample"] = tps(LearnedPolicy(rule_in))

    gain = rows["oracle"] - rows["best-static"]
    table = [{"name": n, "tokens_per_s": v, "vs_best_static": v / rows["best-static"],
              "oracle_gain_captured": (v - rows["best-static"]) / gain if gain > 0 else None} for n, v in rows.items()]
    info = {"run": str(run), "test_prompts": len(test), "drafters": drafters, "k_max": k_max, "best_static": static,
            "examples": {"train": int((ex.split == "train").sum()), "test": len(t)}}
    write_json(args.out, {"rows": table, "meta": info})
    print(f"held-out test traces of {run} ({len(test)} prompts; drafters {drafters}), simulated with its cost model\n")
    print("| row | tokens/s | vs best static | share of the oracle's gain |\n|---|---|---|---|")
    for r in table:
        cap = "-" if r["oracle_gain_captured"] is None else f"{r['oracle_gain_captured']:.0%}"
        print(f"| {r['name']} | {r['tokens_per_s']:.1f} | {r['vs_best_static']:.2f}x | {cap} |")


if __name__ == "__main__":
    main()
