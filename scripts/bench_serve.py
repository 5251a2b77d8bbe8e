"""vLLM's OpenAI server under load: one server per configuration, each driven by vLLM's own load client (``vllm bench
serve``) over held-out chat prompts at Poisson rates relative to the no-speculation server's measured capacity.

    python scripts/train.py experiment=vllm_ngram hydra.run.dir=runs/vllm_ngram        # a learned n-gram policy
    python scripts/profile_vllm.py --run runs/vllm_ngram --out runs/vllm_ngram_vcost --batch-sizes 1,4,16
    python scripts/train.py experiment=vllm_ngram "stages=[fit,export]" from_run=runs/vllm_ngram \\
        hydra.run.dir=runs/vllm_ngram_vcost                                             # the rule priced by vLLM
    python scripts/export.py policy_dir=runs/vllm_ngram_vcost/policies/hgb format=vllm out=runs/deploy
    python scripts/bench_serve.py --export runs/deploy --prompts 32 --max-tokens 128 --out runs/bench_serve.json

The rule's EAGLE-3 head as well (conf/experiment/vllm_head.yaml: both drafters, priced by vLLM with ``--head``; the
export stage writes ``export/<predictor>/vllm`` and ``vllm_head``):

    python scripts/bench_serve.py --export <run>/export/hgb/vllm --head-export <run>/export/hgb/vllm_head \
        --configs none,vllm-ngram,static,learned,head,learned-head --prompts 12 --max-tokens 64 --repeats 2

Steps: (1) capacity: the no-speculation server takes every request at once (rate inf); its completed requests per
second are the capacity C, and its outputs the reference; (2) every configuration (``--configs``: none, none-sync
(no speculation with async scheduling off, as vLLM runs n-gram and custom_class speculation), spec-idle
(speculation on, a proposer that never drafts), vLLM's
n-gram at its documented example, the export's static setting, its learned rule, the EAGLE-3 head at a fixed k,
the learned rule's head under its k-by-batch-size map: ``--head-export``) gets its own
server, started once per repeat in alternating order (ABC CBA ...), and runs every rate (``--rates``, multiples of
C) in turn. Greedy. Every completion is compared with the reference's for the same request (lossless over HTTP,
under concurrent load). A server that dies mid-run is reported (failed requests, the run kept) and restarted for the
next run.

Prints a Markdown table per rate (output throughput, mean and P50/P90/P99 TPOT and end-to-end latency, vLLM's
acceptance from ``/metrics``, identical outputs, failed requests) with the learned rule's ratios to the others, and
writes JSON (``--out``) and a plot of TPOT and P99 latency against rate (``--plot``, default beside ``--out``).
"""

from __future__ import annotations

import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

from sacpolicy import bench
from sacpolicy.export.vllm_run import vllm_status
from sacpolicy.export.vllm_serve import CONFIGS, ServeError, VllmServer, bench_serve, completions, serve_config
from sacpolicy.io import write_text
from sacpolicy.models import EMBEDDED_TARGET, load_tokenizer, model_dir

METRICS = ("tpot", "e2el", "ttft")


def dataset(prompts: list[dict], tok, path: Path) -> list[str]:
    """The held-out prompts as vLLM's custom JSONL dataset: chat-templated text, sent as is."""
    texts = [tok.decode(p["input_ids"]) for p in prompts]
    write_text(path, "".join(json.dumps({"prompt": t}) + "\n" for t in texts))
    return texts


def summarize(res: dict) -> dict:
    """The figures of one ``vllm bench serve`` result that the table reads."""
    row = {k: res.get(k) for k in ("duration", "completed", "failed", "request_throughput", "output_throughput",
                                   "total_output_tokens")}
    if not row["completed"]:  # every request failed (the server died): no figures, only the failures
        return {**row, "output_throughput": None, "request_throughput": None}
    for m in METRICS:
        for stat in ("mean", "median", "p50", "p90", "p99"):
            if f"{stat}_{m}_ms" in res:
                row[f"{stat}_{m}_ms"] = res[f"{stat}_{m}_ms"]
    row["p50_tpot_ms"] = row.get("p50_tpot_ms", row.get("median_tpot_ms"))
    row["p50_e2el_ms"] = row.get("p50_e2el_ms", row.get("median_e2el_ms"))
    for k in ("spec_decode_acceptance_length", "spec_decode_acceptance_rate", "spec_decode_num_drafts",
              "spec_decode_draft_tokens", "spec_decode_accepted_tokens", "spec_decode_per_position_acceptance_rates"):
        if k in res:
            row[k] = res[k]
    return row


def same_as(texts: list, errors: list, ref: list) -> tuple[int, int]:
    """(identical, compared): completions equal to the reference's for the same request, over requests that both
    completed."""
    pairs = [(t, r) for t, e, r in zip(texts, errors, ref) if not e and r is not None]
    return sum(t == r for t, r in pairs), len(pairs)


def configs_of(args, tmp: Path, target_dir: Path) -> dict:
    names = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        raise SystemExit(f"bench_serve: unknown configurations {unknown}; choose from {list(CONFIGS)}")
    head = args.head
    if "head" in names and head in (None, "shipped"):
        from sacpolicy.export.speculators import export_shipped_head

        head = export_shipped_head(tmp / "eagle3", str(target_dir), args.head_k)
    out = {}
    for n in names:
        try:
            out[n] = serve_config(n, export=args.export, head=head, head_export=args.head_export,
                                  served_model=str(target_dir))
        except ServeError as e:
            raise SystemExit(f"bench_serve: {e}") from None
    return out


def main(argv=None) -> int:
    ap = bench.parser(__doc__)
    ap.add_argument("--export", help="a vLLM export (scripts/export.py format=vllm): the learned and static configs")
    ap.add_argument("--head", default="shipped", help="an EAGLE-3 head in speculators format, or 'shipped'")
    ap.add_argument("--head-k", type=int, default=3)
    ap.add_argument("--head-export", help="the learned rule's EAGLE-3 head for vLLM (scripts/export.py format=vllm "
                    "drafter=feature): the learned-head config")
    ap.add_argument("--configs", default="none,vllm-ngram,static,learned,head")
    bench.add_prompt_set(ap, split="test", prompts=32, max_tokens=128, prompts_help="held-out test prompts")
    ap.set_defaults(source="sharegpt")  # ShareGPT's held-out first turns: real chat traffic
    ap.add_argument("--rates", default="0.25,0.5,1,1.5", help="Poisson rates as multiples of the capacity")
    ap.add_argument("--capacity", type=float, default=None,
                    help="requests/s of the no-speculation server (default: measured, all requests at once)")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--kill-at", type=float, default=None,
                    help="fault drill: kill the learned server this many seconds into its first run (it is "
                         "restarted for the next run)")
    ap.add_argument("--plot", default=None, help="PNG of TPOT and P99 latency against rate (default: beside --out)")
    ap.add_argument("--workdir", default=None, help="keep the servers' logs and raw results here")
    bench.add_out(ap, "bench_serve.json")
    args = ap.parse_args(argv)

    ok, why = vllm_status()
    if not ok:
        raise SystemExit(f"bench_serve: {why}")
    tok = load_tokenizer(EMBEDDED_TARGET)
    prompts = bench.held_out_prompts(args.source, tok, n=args.prompts)
    if len(prompts) < args.prompts:
        raise SystemExit(f"bench_serve: {args.source} has {len(prompts)} held-out test prompts, fewer than "
                         f"--prompts {args.prompts}")
    target_dir = model_dir()
    rates = [float(r) for r in args.rates.split(",") if r.strip()]
    with tempfile.TemporaryDirectory(prefix="bench-serve-") as tmp_name:
        work = Path(args.workdir or tmp_name)
        work.mkdir(parents=True, exist_ok=True)
        data = work / "prompts.jsonl"
        dataset(prompts, tok, data)
        configs = configs_of(args, work, target_dir)
        print(f"vLLM {why}; {len(prompts)} {args.source} held-out prompts, {args.max_tokens} tokens max, greedy; "
              f"configurations: {', '.join(configs)}", flush=True)

        def run(server, name, rate, tag) -> dict:
            if not server.alive() or not server.healthy():
                print(f"  {name}: the server is down; restarting it", flush=True)
                server.stop()
                server.start()
            killer = None
            if args.kill_at is not None and name == "learned" and not killed:
                import threading

                killer = threading.Timer(args.kill_at, server.kill)
                killer.start()
                killed.append(name)
            t = time.perf_counter()
            try:
                res = bench_serve(server.url, data, work / f"{tag}.json", num_prompts=len(prompts), rate=rate,
                                  max_tokens=args.max_tokens, model=str(target_dir), log=work / f"{tag}.log")
            except ServeError as e:  # every request failed (e.g. the server died at once): a row of failures
                print(f"  {name} @ {rate:.3g}/s: {e}", flush=True)
                res = {"completed": 0, "failed": len(prompts), "generated_texts": [None] * len(prompts),
                       "errors": ["bench failed"] * len(prompts), "duration": time.perf_counter() - t}
            finally:
                if killer is not None:
                    killer.cancel()
            return res

        killed: list[str] = []
        preload = ""
        cap: dict = {}

        def measure_capacity(server) -> None:
            """(1) capacity and the reference outputs: no speculation, every request at once."""
            cap.update(run(server, "none", math.inf, "capacity"))
            print(f"capacity (no speculation, all {len(prompts)} at once): {cap['request_throughput']:.3f} "
                  f"requests/s, {cap['output_throughput']:.1f} output tokens/s", flush=True)

        if "none" not in configs:  # a server of its own for the capacity
            with VllmServer(target_dir, serve_config("none"), log=work / "none-capacity.log",
                            max_num_seqs=args.max_num_seqs) as base:
                completions(base.url, ["Hello"], max_tokens=4)  # warm-up
                measure_capacity(base)
        configs = {"none": configs["none"], **configs} if "none" in configs else configs  # none first: capacity

        # (2) every configuration at every rate, servers alternating over repeats
        results: dict = {name: {str(r): [] for r in rates} for name in configs}
        for rep, name in bench.alternating(list(configs), args.repeats):
            config = configs[name]
            if name == "learned":  # the proposer reports its calls, failures and live batch sizes through a file
                from sacpolicy.export.vllm import STATS_ENV

                config.env = {**config.env, STATS_ENV: str(work / f"proposer-{rep}.json")}
            t0 = time.perf_counter()
            server = VllmServer(target_dir, config, log=work / f"{name}-{rep}.log", max_num_seqs=args.max_num_seqs)
            preload = server.env.get("LD_PRELOAD", "")  # the OpenMP runtime the servers ran with
            with server:
                completions(server.url, ["Hello"], max_tokens=4)  # warm-up
                if not cap:
                    measure_capacity(server)
                capacity = args.capacity or cap["request_throughput"]
                ref = cap["generated_texts"]
                for r in rates:
                    res = run(server, name, r * capacity, f"{name}-{rep}-{r}")
                    row = summarize(res)
                    row["identical"], row["compared"] = same_as(res["generated_texts"], res["errors"], ref)
                    row["rate"], row["rate_x"], row["repeat"] = r * capacity, r, rep
                    row["errors"] = sorted({e for e in res["errors"] if e})[:5]
                    results[name][str(r)].append(row)
                    print(f"  [{rep}] {name} @ {r}x ({r * capacity:.3f}/s): {row['output_throughput'] or 0:.1f} "
                          f"tok/s, mean TPOT {row.get('mean_tpot_ms') or float('nan'):.1f} ms, P99 e2e "
                          f"{row.get('p99_e2el_ms') or float('nan'):.0f} ms, identical {row['identical']}/"
                          f"{row['compared']}, failed {row['failed']}", flush=True)
            keep_proposer_stats(results, name, rep, work / f"proposer-{rep}.json")
            print(f"  [{rep}] {name}: {time.perf_counter() - t0:.0f} s with start-up", flush=True)

    md = markdown(results, rates, capacity)
    print(md)
    payload = {"vllm": why, "ld_preload": preload,
               "source": args.source, "n_prompts": len(prompts), "capacity_rps": capacity,
               "capacity_run": summarize(cap), "rates_x": rates, "results": results, "markdown": md,
               "verdict": verdict(results, rates)}
    bench.write_results(args.out, payload, args)
    plot = Path(args.plot or Path(args.out).with_suffix(".png"))
    try:
        draw(results, rates, capacity, plot)
        print(f"wrote {args.out} and {plot}")
    except ImportError as e:
        print(f"wrote {args.out} (no plot: {e})")
    lossless = all(r["identical"] == r["compared"] for n in results for k, rows in results[n].items()
                   if k != "proposer" for r in rows)
    return 0 if lossless else 1


def keep_proposer_stats(results: dict, name: str, rep: int, path: Path) -> None:
    """Append one repeat's stats file of the learned rule's proposer (calls, seconds, failures, live batch sizes) to
    ``results[name]["proposer"]``, a list over repeats."""
    if name == "learned" and Path(path).is_file():
        results[name].setdefault("proposer", []).append({"repeat": rep, **json.loads(Path(path).read_text())})


def _mean(rows: list[dict], key: str) -> float | None:
    vals = [r[key] for r in rows if r.get(key) is not None]
    return statistics.fmean(vals) if vals else None


def markdown(results: dict, rates: list[float], capacity: float) -> str:
    """A table per rate: each configuration's means over repeats."""
    out = []
    for r in rates:
        lines = []
        for name, by_rate in results.items():
            rows = by_rate[str(r)]
            if not rows:
                continue
            g = lambda k, rows=rows: _mean(rows, k)
            acc = g("spec_decode_acceptance_length")
            lines.append([name, bench.cell(g("output_throughput"), ".1f"), bench.cell(g("mean_tpot_ms"), ".1f"),
                          "/".join(bench.cell(g(f"p{p}_tpot_ms"), ".0f") for p in (50, 90, 99)),
                          bench.cell(g("mean_e2el_ms") and g("mean_e2el_ms") / 1e3, ".2f"),
                          "/".join(bench.cell(g(f"p{p}_e2el_ms") and g(f"p{p}_e2el_ms") / 1e3, ".1f")
                                   for p in (50, 90, 99)),
                          bench.cell(acc, ".2f"), f"{sum(x['identical'] for x in rows)}/{sum(x['compared'] for x in rows)}",
                          sum(x["failed"] or 0 for x in rows)])
        out.append(f"Rate {r}x capacity ({r * capacity:.3f} requests/s):\n\n" + bench.table(
            ["config", "output tok/s", "mean TPOT ms", "TPOT P50/P90/P99 ms", "mean e2e s", "e2e P50/P90/P99 s",
             "tokens/step", "identical", "failed"], lines))
    v = verdict(results, rates)
    if v:
        out.append("Learned rule vs the others:\n\n" + bench.table(
            ["config", "rate", "mean TPOT vs none", "mean TPOT vs vLLM n-gram", "throughput vs best other",
             "P99 e2e vs best other", "best other", "mean TPOT vs none-sync", "mean TPOT vs spec-idle"],
            [[x["policy"], f"{x['rate_x']}x", bench.cell(x.get("tpot_vs_none"), ".2f"), bench.cell(x.get("tpot_vs_ngram"), ".2f"),
              bench.cell(x.get("throughput_vs_best"), ".2f"), bench.cell(x.get("p99_e2el_vs_best"), ".2f"),
              x.get("best_other", "-"), bench.cell(x.get("tpot_vs_none_sync"), ".2f"),
              bench.cell(x.get("tpot_vs_spec_idle"), ".2f")] for x in v]))
    return "\n\n".join(out)


LEARNED = ("learned", "learned-head")  # the learned rule served with n-gram drafts / with the EAGLE-3 head


def verdict(results: dict, rates: list[float]) -> list[dict]:
    """Per learned configuration (``LEARNED``) and rate, its ratios: mean TPOT to none's and vLLM n-gram's; output
    throughput and P99 end-to-end latency to the best of {none, vLLM n-gram, static} at that rate (throughput: the
    highest; P99: the lowest); mean TPOT to the diagnostic baselines' where they ran: none-sync (no speculation,
    synchronous scheduling, as vLLM runs n-gram and ``custom_class`` speculation) and spec-idle (speculation on,
    nothing ever drafted)."""
    return [x for name in LEARNED if name in results for x in _verdict(results, rates, name)]


def _verdict(results: dict, rates: list[float], name: str) -> list[dict]:
    out = []
    for r in rates:
        mine = results[name][str(r)]
        others = {n: results[n][str(r)] for n in ("none", "vllm-ngram", "static") if n in results and results[n][str(r)]}
        if not others or _mean(mine, "output_throughput") is None:  # no learned run, or every request failed
            continue
        x = {"policy": name, "rate_x": r}
        for n, key in (("none", "tpot_vs_none"), ("vllm-ngram", "tpot_vs_ngram"), ("none-sync", "tpot_vs_none_sync"),
                       ("spec-idle", "tpot_vs_spec_idle")):
            rows = results.get(n, {}).get(str(r))
            if rows and _mean(rows, "mean_tpot_ms"):
                x[key] = _mean(mine, "mean_tpot_ms") / _mean(rows, "mean_tpot_ms")
        tp = {n: _mean(rows, "output_throughput") for n, rows in others.items()}
        best = max(tp, key=lambda n: tp[n] or 0)
        x["best_other"] = best
        x["throughput_vs_best"] = (_mean(mine, "output_throughput") or 0) / tp[best] if tp[best] else None
        p99 = {n: _mean(rows, "p99_e2el_ms") for n, rows in others.items() if _mean(rows, "p99_e2el_ms")}
        if p99 and _mean(mine, "p99_e2el_ms"):
            x["p99_e2el_vs_best"] = _mean(mine, "p99_e2el_ms") / min(p99.values())
        out.append(x)
    return out


def draw(results: dict, rates: list[float], capacity: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for name, by_rate in results.items():
        xs = [r * capacity for r in rates if by_rate[str(r)]]
        for ax, key, scale in ((axes[0], "mean_tpot_ms", 1.0), (axes[1], "p99_e2el_ms", 1e-3)):
            ys = [(_mean(by_rate[str(r)], key) or float("nan")) * scale for r in rates if by_rate[str(r)]]
            ax.plot(xs, ys, marker="o", label=name)
    axes[0].set(xlabel="requests/s (Poisson)", ylabel="mean TPOT (ms)", title="time per output token")
    axes[1].set(xlabel="requests/s (Poisson)", ylabel="P99 end-to-end latency (s)", title="tail latency")
    axes[0].legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
