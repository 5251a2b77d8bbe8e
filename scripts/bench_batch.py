"""Speculation under load: each policy at batch sizes B in {1, 2, 4, 8, 16}, then Poisson arrivals at three rates,
all through the batched decoder (``SpeculativeDecoder.generate_batch``, continuous batching) on the embedded target.

    python scripts/bench_batch.py --run <run dir>                                   # a pipeline run (make train)
    python scripts/bench_batch.py --policy /work/runs/vllm_ngram/policies/hgb          # an n-gram learned policy
    python scripts/bench_batch.py --policy ... --cost cost_batch.json --prompts 16 --max-tokens 48

``--run``: the run's held-out test prompts (the default pipeline's mixed workload, in evaluation's order), its
drafters, its best static drafter and k on val, and its learned policy reported first (the lowest validation log-loss;
``--policy`` overrides it). Without it: ``--source``'s test split and the n-gram drafter.

Policies: AR, static k (the best static drafter; ``--static-ks`` plus the run's best k), transformers' heuristic, the
seed rule (its load: live rows / max batch) and the learned rule, whose cost model is replaced by one profiled over
batch sizes here (``--cost`` reuses a saved one), so it plans each step for the live batch. Every row of every run is
checked against that prompt decoded alone autoregressively at B = 1. Per run: total tokens/s (all tokens / wall
time), per-request latency P50/P90/P99 (arrival to last token), tokens per target call, the prompts' prefills and the
policy's own compute as shares of the wall time, and tokens/s over the steps with all B rows, with their share of
the wall time (a closed batch drains: rows that speculate finish at different steps and the tail runs narrow;
prefills stall a running batch while a request joins, and no policy
changes them: with short outputs they cap what batching and speculation can show). Poisson rates ending in ``x`` are
fractions of AR's request throughput at the largest B. Over the Poisson mix (all rates' requests pooled), each
policy's request speed: its requests' tokens over their summed latencies (below capacity every policy's total
throughput is the arrival rate's, so what speculation changes is how fast each request finishes). On a shared 2-core
machine one run's ratio moves by 10% and more: ``--repeats R`` runs every policy R times at each batch size, in
alternating order (ABC, CBA, ...), and shows each ratio's range over the repeats (repeat r against repeat r of the
baseline). Writes a Markdown table, JSON and a PNG of throughput vs B.
"""

from __future__ import annotations

import fnmatch
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from sacpolicy import bench
from sacpolicy.decoding import DecoderConfig, NgramDrafter, RequestInfo, SpeculativeDecoder
from sacpolicy.decoding.sampling import SamplingConfig
from sacpolicy.evaluation.evaluate import Timed, add_load_ratios
from sacpolicy.evaluation.plots import line_plot
from sacpolicy.build import build_drafters
from sacpolicy.policy import Autoregressive, Heuristic, SeedRule, Static
from sacpolicy.policy.learned import LearnedPolicy
from sacpolicy.runtime import load_artifact
from sacpolicy.runtime.cost import CostModel


def policies(args, rule, drafter: str = "ngram") -> dict:
    make = {"ar": Autoregressive}
    make |= {f"static-k{k}": (lambda k=k: Static(k, drafter)) for k in args.static_ks}
    make["heuristic"] = lambda: Heuristic(k0=5, drafter=drafter)
    make["seed-rule"] = lambda: SeedRule(drafter=drafter)
    if rule is not None:
        make["learned"] = lambda: LearnedPolicy(replace(rule, fallbacks=0))
    return make


def prompts_of(rows) -> tuple[list, list[RequestInfo]]:
    """Prompt rows -> (their token ids, their requests): each request carries its prompt's category, which the learned
    rule reads, as in evaluation."""
    return [r["input_ids"] for r in rows], [RequestInfo(category=r["category"]) for r in rows]


def run(target, drafters, policy, prompts, requests, args, B: int, max_batch: int,
        arrivals=None) -> tuple[dict, list]:
    timed = Timed(policy)
    dec = SpeculativeDecoder(target.model, drafters, timed, config=DecoderConfig(max_batch=max_batch, k_max=8),
                             stop_token_ids=target.eos_token_ids)
    dec.generate_batch(prompts[:B], 4, max_batch=B, requests=requests[:B])  # warm-up at this size
    timed.seconds = 0.0
    t0 = time.perf_counter()
    res = dec.generate_batch(prompts, args.max_tokens, max_batch=B, arrivals=arrivals, requests=requests)
    wall = time.perf_counter() - t0
    bench.check_drafters_kept(f"{policy!r} at batch size {B}", [r.dropped_drafters for r in res],
                              allow=args.allow_dropped_drafters)
    tokens = sum(len(r.tokens) for r in res)
    lat = np.array([r.latency_s for r in res])
    drafted = sum(s.drafted for r in res for s in r.steps)
    prefill = float(sum(r.prefill_s for r in res))
    # the steps with all B rows: each row's record holds the whole pass's verify time and its own drafting time
    full = [s for r in res for s in r.steps if s.batch_size == B]
    full_s = sum(s.verify_s / B + s.draft_s for s in full)
    return {"tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall,
            "p50_s": float(np.percentile(lat, 50)), "p90_s": float(np.percentile(lat, 90)),
            "p99_s": float(np.percentile(lat, 99)),
            "tokens_per_call": tokens / sum(r.target_calls for r in res),
            "acceptance": sum(s.accepted for r in res for s in r.steps) / drafted if drafted else 0.0,
            "mean_k": float(np.mean([s.drafted for r in res for s in r.steps])),
            "latency_sum_s": float(lat.sum()),
            # the prompts' prefills (one pass over the prompts of the requests admitted together; each request's
            # prefill_s is its share of its pass, so they add up to the passes' time), which no policy changes
            "prefill_share": prefill / wall,
            "policy_share": timed.seconds / wall,
            # of the decoding steps' time (the wall time but the prefills, which run between steps)
            "policy_step_share": timed.seconds / max(wall - prefill, 1e-9),
            # tokens/s of the steps with every row of the batch (target passes and drafting, the policy's compute
            # left out), and their share of the wall time: a closed batch drains as its rows finish, and rows that
            # speculate finish at different steps, so the tail runs narrow; this separates that from a full step
            "full_batch_tokens_per_s": sum(s.emitted for s in full) / full_s if full_s else None,
            "full_batch_share": full_s / wall}, [r.tokens for r in res]


def merge_repeats(runs: list[dict]) -> dict:
    """One row from repeated runs of a policy: the figures of one run averaged over them (tokens/s: mean tokens over
    mean wall time), each run's tokens/s kept (``tokens_per_s_runs``) for the paired ratios (``add_load_ratios``)."""
    out = {key: float(np.mean([r[key] for r in runs])) for key in runs[0]
           if key != "identical" and all(r[key] is not None for r in runs)}
    out["tokens_per_s"] = out["tokens"] / out["wall_s"]
    out["tokens_per_s_runs"] = [r["tokens_per_s"] for r in runs]
    out["identical"] = all(r["identical"] for r in runs)
    return out


def _full(r: dict) -> str:
    tps = r.get("full_batch_tokens_per_s")
    return "-" if tps is None else f"{tps:.1f} ({100 * r['full_batch_share']:.0f}%)"


def table(rows: list[dict], key: str) -> str:
    header = [key, "policy", "tokens/s", "vs AR", "vs best static", "P50 s", "P90 s", "P99 s", "tokens/call",
              "mean k", "acceptance", "prefill", "policy compute (of the steps)",
              "full-B steps: tokens/s (of the wall)", "lossless"]
    return bench.table(header, ([
        r[key], r["policy"], f"{r['tokens_per_s']:.1f}", bench.ratio(r["vs_ar"], runs=r.get("vs_ar_runs")),
        bench.ratio(r["vs_best_static"], runs=r.get("vs_best_static_runs")), f"{r['p50_s']:.1f}",
        f"{r['p90_s']:.1f}", f"{r['p99_s']:.1f}", f"{r['tokens_per_call']:.2f}", f"{r['mean_k']:.2f}",
        f"{r['acceptance']:.2f}", f"{100 * r['prefill_share']:.0f}%",
        f"{100 * r['policy_share']:.2f}% ({100 * r['policy_step_share']:.2f}%)", _full(r),
        "yes" if r["identical"] else "NO"] for r in rows))


def plot(rows: list[dict], path: Path) -> None:
    series = {n: [(r["batch"], r["tokens_per_s"]) for r in rows if r["policy"] == n]
              for n in dict.fromkeys(r["policy"] for r in rows)}
    line_plot(path, [{"series": series, "log2_x": True, "xlabel": "batch size B", "ylabel": "total tokens/s",
                      "title": "Embedded target, greedy, CPU: throughput vs batch size"}])


def main(argv=None) -> int:
    ap = bench.parser(__doc__)
    ap.add_argument("--run", help="a pipeline run directory: its test prompts, drafters and learned policy")
    ap.add_argument("--policy", help="a learned policy artifact (default with --run: the run's headline policy; "
                                     "without: one whose drafter is n-gram, e.g. experiment=vllm_ngram)")
    ap.add_argument("--cost", help="a cost model profiled over batch sizes (JSON); profiled and saved when absent")
    bench.add_prompt_set(ap, split="test", prompts=16, max_tokens=48,
                         source_help="prompt set without --run; its held-out test split is used")
    ap.add_argument("--batch-sizes", default="1,2,4,8,16")
    ap.add_argument("--static-ks", default="1,2,4", help="static k rows (with --run, its best static k joins them)")
    ap.add_argument("--rates", default="0.5,1,2", help="Poisson arrival rates at the largest batch size: requests/s, "
                                                       "or fractions of AR's request throughput there (0.25x); "
                                                       "empty: none")
    ap.add_argument("--policies", default="*", help="comma-separated fnmatch patterns of the policies to run "
                                                    "(e.g. ar,static-k*,learned); AR always runs")
    ap.add_argument("--repeats", type=int, default=1, help="runs of every policy at each batch size, in alternating "
                                                           "order; the table shows each ratio's range over them")
    bench.add_allow_dropped(ap)
    bench.add_out(ap, "bench_batch.json")
    args = ap.parse_args(argv)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)  # before the runs: the plot is written first
    sizes = bench.int_list(args.batch_sizes)
    args.static_ks = bench.int_list(args.static_ks)
    rates = [r for r in args.rates.split(",") if r]
    if args.repeats < 1:
        raise SystemExit(f"--repeats must be >= 1, got {args.repeats}")
    torch.manual_seed(0)

    if args.run:
        target, prompts, requests, drafters, static, rule = from_run(Path(args.run), args)
        if static["k"] not in args.static_ks:
            args.static_ks = sorted([*args.static_ks, static["k"]])
    else:
        target = bench.load_target()
        rows_in = bench.held_out_prompts(args.source, target.tokenizer, n=args.prompts)
        (prompts, requests), static = prompts_of(rows_in), {"drafter": "ngram"}
        rule, drafters = None, [NgramDrafter()]
        if args.policy:
            art = load_artifact(args.policy)
            if tuple(art.rule.drafters) != ("ngram",):
                raise SystemExit(f"without --run, bench_batch compares n-gram policies; {args.policy} drafts with "
                                 f"{art.rule.drafters}. Pass --run <its run dir>, or train one with "
                                 "experiment=vllm_ngram")
            drafters, rule = build_drafters(art, target), art.rule
    if len(prompts) < max(sizes):
        raise SystemExit(f"bench_batch: {len(prompts)} test prompts cannot fill a batch of {max(sizes)}; lower "
                         "--batch-sizes or use a larger --source")
    if rule is not None:
        out_cost = Path(args.cost or Path(args.out).with_suffix(".cost.json"))
        if out_cost.is_file():
            cost = CostModel.from_json(out_cost)
        else:
            from sacpolicy.profiling import profile

            # a running batch passes through every size below its largest (joining, draining): profile powers of two
            # up to it as well as the sizes run, which interpolating between 1 and 16 rows alone would misprice
            profiled = sorted({*sizes, *(2 ** i for i in range(max(sizes).bit_length()))})  # 1, 2, 4, ... <= largest
            print(f"profiling the verify pass at batch sizes {profiled} -> {out_cost}", flush=True)
            # greedy, as every row here decodes: the decoder's own work per step is timed at those settings
            cost = profile(target, drafters, ks=tuple(range(9)), context_lens=(64, 256, 512), batch_sizes=profiled,
                           sampling=SamplingConfig())
            cost.to_json(out_cost)
        rule = replace(rule, cost=cost)
    print(f"{len(prompts)} {args.run or args.source} test prompts, {args.max_tokens} new tokens, greedy, "
          f"{target.dtype}, {torch.get_num_threads()} threads, drafters {[d.name for d in drafters]}", flush=True)
    reference = SpeculativeDecoder(target.model, stop_token_ids=target.eos_token_ids).generate_batch(
        prompts, args.max_tokens, max_batch=1)
    reference = [r.tokens for r in reference]
    make = policies(args, rule, static["drafter"])
    patterns = args.policies.split(",")
    make = {n: f for n, f in make.items() if n == "ar" or any(fnmatch.fnmatch(n, p) for p in patterns)}

    rows = []
    for B in sizes:
        runs = {name: [] for name in make}
        for _, name in bench.alternating(list(make), args.repeats):  # ABC CBA ...: drift moves every policy alike
            stats, outs = run(target, drafters, make[name](), prompts, requests, args, B, max(sizes))
            runs[name].append({**stats, "identical": outs == reference})
            print(f"  B={B} {name}: {stats['tokens_per_s']:.1f} tok/s", flush=True)
        rows += [{"batch": B, "policy": name, **merge_repeats(r)} for name, r in runs.items()]
    add_load_ratios(rows, "batch")

    ar_top = next(r for r in rows if r["batch"] == max(sizes) and r["policy"] == "ar")
    capacity = len(prompts) / ar_top["wall_s"]  # AR's requests per second at the largest batch
    poisson = []
    gaps = np.random.default_rng(0).exponential(1.0, len(prompts))
    for rate in rates:
        per_s = float(rate[:-1]) * capacity if rate.endswith("x") else float(rate)
        arrivals = (np.cumsum(gaps) / per_s).tolist()
        for name, new in make.items():
            stats, outs = run(target, drafters, new(), prompts, requests, args, max(sizes), max(sizes), arrivals)
            poisson.append({"rate": rate, "requests_per_s": per_s, "policy": name, **stats,
                            "identical": outs == reference})
            print(f"  rate={rate} ({per_s:.2f}/s) {name}: {stats['tokens_per_s']:.1f} tok/s, P90 "
                  f"{stats['p90_s']:.1f} s", flush=True)
    md = "## Batch size\n\n" + table(rows, "batch")
    mix = []
    if poisson:
        add_load_ratios(poisson, "rate")
        mix = poisson_mix(poisson)
        md += f"\n\n## Poisson arrivals (requests/s, max batch {max(sizes)}; AR's capacity {capacity:.2f}/s)\n\n" + \
            table(poisson, "rate") + "\n\n## Over the Poisson mix (every rate's requests pooled)\n\n" + mix_table(mix)
    print(md)
    png = Path(args.out).with_suffix(".png")
    plot(rows, png)
    bench.write_results(args.out, {"n_prompts": len(prompts), "threads": torch.get_num_threads(),
                                   "capacity_requests_per_s": capacity, "batch": rows, "poisson": poisson,
                                   "mix": mix, "markdown": md, "png": str(png)}, args)
    print(f"wrote {args.out} and {png}")
    return 0 if all(r["identical"] for r in rows + poisson) else 1


def from_run(run_dir: Path, args):
    """(target, prompts, their requests (category), drafters, best static {drafter, k}, learned rule) of a run."""
    from omegaconf import OmegaConf

    from sacpolicy.pipeline.context import RunContext

    if not (run_dir / "config.yaml").is_file():
        raise SystemExit(f"--run {run_dir}: no config.yaml there; pass a directory scripts/train.py wrote")
    ctx = RunContext(OmegaConf.load(run_dir / "config.yaml"), run_dir)
    prompts, requests = prompts_of(ctx.test_prompts()[: args.prompts])
    if args.policy:
        art = load_artifact(args.policy)
        rule, drafters = art.rule, build_drafters(art, ctx.target)
    else:
        rules, headline = ctx.learned_rules("bench_batch")
        rule, drafters = rules[headline], ctx.drafters
        print(f"learned policy: {run_dir}/policies/{headline} (the lowest validation log-loss)", flush=True)
    return ctx.target, prompts, requests, drafters, ctx.best_static(), rule


CEILING = "per-rate best static (hindsight)"


def poisson_mix(poisson: list[dict]) -> list[dict]:
    """Per policy over every Poisson run: total tokens/s (pooled tokens over pooled wall time) and request speed
    (pooled tokens over the requests' summed latencies), with the request speed against AR and against the best
    single static k (AR included) over the same mix. Last, a ceiling no policy that sets k from the load alone can
    beat: at each rate the static k (AR included) whose requests finished fastest there, chosen in hindsight."""
    def pooled(name: str, runs: list[dict], **extra) -> dict:
        tokens = sum(r["tokens"] for r in runs)
        return {"policy": name, "tokens_per_s": tokens / sum(r["wall_s"] for r in runs),
                "request_tokens_per_s": tokens / sum(r["latency_sum_s"] for r in runs),
                "identical": all(r["identical"] for r in runs), **extra}

    def static(name: str) -> bool:
        return name == "ar" or name.startswith("static-k")

    mix = [pooled(name, [r for r in poisson if r["policy"] == name])
           for name in dict.fromkeys(r["policy"] for r in poisson)]
    picks = {}
    for rate in dict.fromkeys(r["rate"] for r in poisson):
        runs = [r for r in poisson if r["rate"] == rate and static(r["policy"])]
        picks[rate] = min(runs, key=lambda r: r["latency_sum_s"] / r["tokens"])
    mix.append(pooled(CEILING, list(picks.values()), picks={rate: r["policy"] for rate, r in picks.items()}))
    ar = next(m for m in mix if m["policy"] == "ar")["request_tokens_per_s"]
    best = max(m["request_tokens_per_s"] for m in mix if static(m["policy"]))
    for m in mix:
        m["vs_ar"], m["vs_best_static"] = m["request_tokens_per_s"] / ar, m["request_tokens_per_s"] / best
    return mix


def mix_table(mix: list[dict]) -> str:
    out = [bench.table(["policy", "request speed (tokens/s)", "vs AR", "vs best single static", "total tokens/s",
                        "lossless"],
                       ([m["policy"], f"{m['request_tokens_per_s']:.2f}", bench.ratio(m["vs_ar"]),
                         bench.ratio(m["vs_best_static"]), f"{m['tokens_per_s']:.1f}",
                         "yes" if m["identical"] else "NO"] for m in mix))]
    picks = next((m["picks"] for m in mix if m["policy"] == CEILING), None)
    if picks:
        out.append(f"\n{CEILING}: " + ", ".join(f"{p} at {rate}" for rate, p in picks.items()) + "; a bound on "
                   "choosing k from the load, not a policy")
    return "\n".join(out)


if __name__ == "__main__":
    sys.exit(main())
