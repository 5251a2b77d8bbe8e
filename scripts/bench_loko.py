"""Traffic the policy was not fitted on: leave-one-kind-out over the request kinds of a run's traces, in simulation.

    python scripts/bench_loko.py --run outputs/<run>      # a run with collect (traces/tf, cost.json) done
    python scripts/bench_loko.py --run outputs/<run> --kinds code,writing --predictor logreg --peers sglang,trtllm

A request's kind is its prompt's category in the run's teacher-forced traces (MT-Bench's categories, ``code`` for
HumanEval, ``second_turn``, code edits, ``revision``, ShareGPT ...). Each kind K is held out in turn:
- the learned policy never sees K: its predictor is fitted on the TRAIN traces of every other kind and calibrated,
  and its rule tuned, on their VAL traces, with the best static of their val traces as fallback: the fit stage's own
  recipe (``sacpolicy.pipeline.fit.fit_rule``, the run's ``predictor`` and ``fit`` settings);
- the baselines are tuned on K itself: the best static (drafter, k) and each peer's setting and drafter (the engines'
  adaptive rules, ``sacpolicy.traces.peer_tuning``) are chosen on K's VAL traces;
- every row is replayed over K's TEST traces with the run's cost model and decoder settings: ``learned-<p>-offline``
  (the fitted rule as is), ``learned-<p>-online`` (the same rule learning while it serves, ``runtime.online``, its
  state carried from prompt to prompt of K as serving them would), each peer, ``best-static`` and ``oracle``.
The setting favours the baselines: they are tuned on the kind they are tested on, the learned policy on other kinds.
A row's ratio to best static is paired prompt by prompt over K's test prompts, with a 95% paired bootstrap interval
(``evaluation.intervals``); the ``pooled`` row pools every held-out kind's test prompts, each kind's rows as tuned for
it. Kinds with fewer than ``--min-prompts`` val or test prompts are skipped and listed with their counts (they still
count among the other kinds when another is held out). Prints the kinds found and two Markdown tables (ratios to best
static, tokens/s); writes bench_loko.json.
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import numpy as np
from hydra.utils import instantiate
from omegaconf import OmegaConf

from sacpolicy import bench
from sacpolicy.data import assign_split
from sacpolicy.evaluation.intervals import MIN_PROMPTS, bootstrap_indices, paired_ratio_interval
from sacpolicy.pipeline import fit
from sacpolicy.pipeline.context import SPLITS, RunContext
from sacpolicy.policy import Static
from sacpolicy.policy.learned import LearnedPolicy
from sacpolicy.progress import progress_iter
from sacpolicy.runtime.online import OnlineSettings
from sacpolicy.traces.peer_tuning import PEERS, tune_peer
from sacpolicy.traces.simulate import Oracle, best_static, simulate

BASE = "best-static"


def main(argv=None) -> dict:
    ap = bench.parser(__doc__)
    ap.add_argument("--run", required=True, help="a pipeline run directory whose collect stage is done")
    ap.add_argument("--kinds", default=None, help="comma-separated kinds to hold out (default: every kind found)")
    ap.add_argument("--predictor", default="hgb", help="one of the run's predictors (its conf/predictor settings)")
    ap.add_argument("--peers", default=",".join(PEERS), help=f"comma-separated peers of {list(PEERS)} ('': none)")
    ap.add_argument("--k-max", type=int, default=None, help="longest block (default: the run's fit.k_max)")
    ap.add_argument("--min-prompts", type=int, default=MIN_PROMPTS,
                    help="val and test prompts a kind needs to be held out")
    ap.add_argument("--seed", type=int, default=0, help="the bootstrap's seed")
    ap.add_argument("--resamples", type=int, default=2000, help="bootstrap resamples of the test prompts")
    bench.add_out(ap, "bench_loko.json")
    args = ap.parse_args(argv)

    run = Path(args.run)
    cfg = OmegaConf.load(run / "config.yaml")
    cfg.fit.k_max = args.k_max or cfg.fit.k_max  # the rule's tuning reads it from the config
    if args.predictor not in cfg.predictor:
        raise SystemExit(f"bench_loko: --predictor {args.predictor!r} is not among the run's predictors "
                         f"{list(cfg.predictor)}; pick one of them")
    peers = [p for p in args.peers.split(",") if p.strip()]
    if set(peers) - set(PEERS):
        raise SystemExit(f"bench_loko: unknown peers {sorted(set(peers) - set(PEERS))}; peers: {list(PEERS)}")
    ctx = RunContext(cfg, run)  # the run's traces, cost model and vocabulary, as its fit stage reads them
    counts = kind_counts(ctx.traces.grouped)
    print(f"kinds in the traces of {run} (prompts per split):")
    for kind, c in counts.items():
        print(f"  {kind}: " + ", ".join(f"{s} {c[s]}" for s in SPLITS))
    wanted = list(counts) if args.kinds is None else [k for k in args.kinds.split(",") if k.strip()]
    if set(wanted) - set(counts):
        raise SystemExit(f"bench_loko: --kinds {sorted(set(wanted) - set(counts))} are not in the traces; kinds: "
                         f"{list(counts)}")
    kinds = [k for k in wanted if min(counts[k]["val"], counts[k]["test"]) >= args.min_prompts]
    skipped = {k: counts[k] for k in wanted if k not in kinds}
    if skipped:
        print(f"skipped (fewer than {args.min_prompts} val or test prompts): "
              + "; ".join(f"{k} (val {c['val']}, test {c['test']})" for k, c in skipped.items()))
    if not kinds:
        raise SystemExit("bench_loko: no kind has enough val and test prompts to hold out; collect traces over more "
                         "prompts or lower --min-prompts")

    ex = fit.examples(ctx)  # every prompt's acceptance examples, once; each fit takes the other kinds' own
    per_kind = {k: held_out(ctx, ex, k, predictor=args.predictor, peers=peers)
                for k in progress_iter(kinds, "held-out kinds", unit="kind")}
    out = {"kinds": {k: {**{n: v for n, v in r.items() if n != "per_prompt"},
                         "rows": ratio_rows(r["per_prompt"], resamples=args.resamples, seed=args.seed)}
                     for k, r in per_kind.items()},
           "pooled": ratio_rows(pooled(per_kind), resamples=args.resamples, seed=args.seed),
           "meta": {"run": str(run), "predictor": args.predictor, "peers": peers, "k_max": cfg.fit.k_max,
                    "counts": counts, "skipped": skipped, "min_prompts": args.min_prompts,
                    "bootstrap_resamples": args.resamples, "bootstrap_seed": args.seed}}
    bench.write_results(args.out, out, args)
    print(f"\nleave-one-kind-out on {run}: learned-{args.predictor} fitted on the other kinds, statics and peers tuned "
          "on the held-out kind's val prompts, every row replayed on its test prompts with the run's cost model\n")
    print(markdown(out))
    return out


def kind_counts(grouped: dict) -> dict:
    """{kind: {split: prompts}} of grouped traces, kinds by how many prompts they hold (most first)."""
    counts = Counter((p["category"], assign_split(pid)) for pid, p in grouped.items())
    kinds = Counter(p["category"] for p in grouped.values())
    return {k: {s: counts[k, s] for s in SPLITS} for k, _ in kinds.most_common()}


def held_out(ctx: RunContext, ex, kind: str, *, predictor: str, peers: list[str]) -> dict:
    """Kind ``kind`` held out: the learned rule fitted and tuned without it (``fit_rule`` on the other kinds'
    examples and val traces), the best static and each peer chosen on its val traces, every row replayed on its test
    traces. -> what was chosen, and each row's per-prompt tokens and seconds (``replay``)."""
    by_split, cost, vocab, k_max = ctx.traces.by_split, ctx.cost, ctx.vocab_size, ctx.cfg.fit.k_max
    config = instantiate(ctx.cfg.decoder)
    val, test = ({pid: p for pid, p in by_split[s].items() if p["category"] == kind} for s in ("val", "test"))
    other_val = {pid: p for pid, p in by_split["val"].items() if p["category"] != kind}
    mine = [pid for pid, p in ctx.traces.grouped.items() if p["category"] == kind]
    others = ex.take(~np.isin(ex.prompt_id, mine))  # every example of the other kinds (fit_rule fits on train)
    if not other_val or not len(others.of("train")):
        raise SystemExit(f"bench_loko: holding out {kind!r} leaves no train or val prompts of another kind to fit on; "
                         "collect traces of more kinds, or hold out fewer (--kinds)")
    other_static = best_static(other_val, cost, vocab_size=vocab, k_max=k_max)["all"]
    _, metrics, rule, _ = fit.fit_rule(ctx, predictor, others, other_static, val=other_val)
    static = best_static(val, cost, vocab_size=vocab, k_max=k_max)["all"]
    tuned = {name: tune_any_drafter(name, val, ctx, config) for name in peers}

    def replay(policy, drafters=None) -> dict:
        res = simulate(policy, test, cost, vocab_size=vocab, config=config, drafters=drafters)
        return {"tokens": [len(r.tokens) for _, r in res.results], "seconds": [r.total_s for _, r in res.results]}

    online = online_settings(ctx, rule)
    rows = {f"learned-{predictor}-offline": replay(LearnedPolicy(rule, online=False)),
            f"learned-{predictor}-online": replay(LearnedPolicy(rule, online=online))}
    rows |= {name: replay(policy, [drafter]) for name, (policy, drafter, _) in tuned.items()}
    rows[BASE] = replay(Static(static["k"], static["drafter"]), [static["drafter"]])
    rows["oracle"] = replay(Oracle(cost, k_max=k_max))
    return {"prompts": {"fit_train": int(len(set(others.of("train").prompt_id))), "fit_val": len(other_val),
                        "val": len(val), "test": len(test)},
            "best_static": static, "fallback_static": other_static,
            "rule": {"mode": rule.mode, "optimism": rule.optimism, "fallback": list(rule.fallback),
                     "online_chosen_on_val": rule.online is not None, "online_row": online.to_dict()},
            "predictor_metrics": metrics, "peers": {n: {"drafter": d, "settings": s} for n, (_, d, s) in tuned.items()},
            "per_prompt": rows}


def tune_any_drafter(name: str, val: dict, ctx: RunContext, config) -> tuple:
    """(policy, drafter, settings): peer ``name`` tuned on ``val`` with each of the traces' drafters in turn
    (``tune_peer``), the fastest kept: the drafter is one more knob its users would set."""
    drafters = list(next(iter(val.values()))["drafters"])
    best = None
    for d in drafters:
        policy, settings, tps = tune_peer(name, val, ctx.cost, vocab_size=ctx.vocab_size, drafter=d,
                                          k_max=ctx.cfg.fit.k_max, config=config)
        if best is None or tps > best[0]:
            best = (tps, policy, d, settings)
    return best[1:]


def online_settings(ctx: RunContext, rule):
    """The settings the online row learns with: the rule's where its tuning chose to learn, else the run's
    ``fit.online`` (True, the defaults, where the run turned learning off)."""
    return rule.online or OnlineSettings.of(dict(ctx.cfg.fit.online) if ctx.cfg.fit.get("online") else True)


def pooled(per_kind: dict) -> dict:
    """Every row's per-prompt tokens and seconds over all held-out kinds' test prompts, in kind order."""
    names = next(iter(per_kind.values()))["per_prompt"]
    return {n: {key: [v for r in per_kind.values() for v in r["per_prompt"][n][key]] for key in ("tokens", "seconds")}
            for n in names}


def ratio_rows(per_prompt: dict, *, resamples: int, seed: int) -> list[dict]:
    """Each row's tokens/s and ratio to ``best-static`` with its 95% paired bootstrap interval over the prompts."""
    base = per_prompt[BASE]
    idx = bootstrap_indices(len(base["tokens"]), resamples=resamples, seed=seed)
    rows = []
    for name, r in per_prompt.items():
        tps = sum(r["tokens"]) / sum(r["seconds"])
        rows.append({"name": name, "tokens_per_s": tps, "prompts": len(r["tokens"]),
                     "vs_best_static": tps / (sum(base["tokens"]) / sum(base["seconds"])),
                     "vs_best_static_ci": list(paired_ratio_interval(r["tokens"], r["seconds"], base["tokens"],
                                                                     base["seconds"], idx=idx))})
    return rows


def markdown(out: dict) -> str:
    """Two tables, a row per held-out kind and the pooled row: ratios to best static [95% interval], and tokens/s."""
    lines = {**{k: v["rows"] for k, v in out["kinds"].items()}, "pooled": out["pooled"]}
    names = [r["name"] for r in out["pooled"]]
    prompts = {k: str(rows[0]["prompts"]) for k, rows in lines.items()}
    static = {k: f"{v['best_static']['drafter']} k={v['best_static']['k']}" for k, v in out["kinds"].items()}
    ratios = bench.table(["held out", "test prompts", "best static (on val)", *names],
                         ([k, prompts[k], static.get(k, "per kind"),
                           *(bench.ratio(r["vs_best_static"], r["vs_best_static_ci"]) for r in rows)]
                          for k, rows in lines.items()))
    rates = bench.table(["held out", *names], ([k, *(f"{r['tokens_per_s']:.1f}" for r in rows)]
                                               for k, rows in lines.items()))
    return f"ratio to best static [95% paired interval]\n\n{ratios}\n\ntokens/s (simulated)\n\n{rates}"


if __name__ == "__main__":
    main(sys.argv[1:])
