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
n-gram at its documented example, the export's static setting, its learned rule (learned-logged: with the
proposer's step log on, the feedback loop's overhead as its TPOT to learned's; learned-ngram: the same rule with its
n-gram drafter alone, when the export also serves a suffix drafter; candidate: another export's rule, ``--candidate``,
a refit's before it replaces learned), the EAGLE-3 head at a fixed k,
the learned rule's head under its k-by-batch-size map: ``--head-export``) gets its own
server, started once per repeat in alternating order (ABC CBA ...), and runs every rate (``--rates``, multiples of
C) in turn. Greedy. Every completion is compared with the reference's for the same request (lossless over HTTP,
under concurrent load). A server that dies mid-run is reported (failed requests, the run kept) and restarted for the
next run.

Prints a Markdown table per rate (output throughput, mean and P50/P90/P99 TPOT and end-to-end latency, vLLM's
acceptance from ``/metrics``, identical outputs, failed requests) with the learned rule's ratios to the others (95%
intervals from a paired bootstrap over repeats and requests: ``sacpolicy.bench.serve``), and
writes JSON (``--out``, each run's per-request latencies included) and a plot of TPOT and P99 latency against rate
(``--plot``, default beside ``--out``). ``--rescore A.json[,B.json] --workdir A_WORK[,B_WORK]`` re-tables earlier
runs from their raw results, starting no server; several runs of the same rates are pooled, their repeats joined.

Capacity at a latency target (``--find-capacity``): instead of fixed rates, every configuration's server searches
for the highest Poisson rate whose P90 TPOT and P99 TTFT stay within a target (``--tpot-target-ms``, or
``--tpot-target-x 1.2``: a multiple of no speculation's unloaded median TPOT, measured first; ``--ttft-target-ms``):
doubling or halving from ``--start-x`` times the capacity until the target is bracketed, then bisecting, at most
``--max-probes`` rates of ``--repeats`` runs each (``sacpolicy.bench.capacity``). It reports requests/s and output
tokens/s at that rate (95% intervals over repeats), cost per 1M output tokens at ``--price-per-hour`` and the
capacity against no speculation's; the JSON is rewritten after every run, so a target no configuration meets, a
search that hits its bound or a server that dies ends with a message and every measurement kept:

    python scripts/bench_serve.py --find-capacity --tpot-target-x 1.2 --configs none,vllm-suffix,static,learned \
        --export runs/deploy --repeats 2 --price-per-hour 2.0 --out runs/capacity.json

``vllm-suffix`` is vLLM's own suffix method (arctic-inference, built by ``scripts/install.sh --vllm``).

Hot-reload drill (``--reload-at S --reload-policy P``): the learned server follows a deploy root made from
``--export`` (``sacpolicy.export.deploy``; it checks the root every second and logs every step), and S seconds into
each of its runs the other version (``P``, then ``--export`` again) is deployed and made current under load. The
learned row then also reports the server's swaps (``reloads``, ``reload_failures``) and the verify steps each policy
id planned (``policy_steps``, from the step log): a swap mid-run shows as steps under both ids, with failed requests
and identical outputs counted as for every row. Run it at one rate per server (``--rates 1``): the counts are per
server.
"""

from __future__ import annotations

import json
import math
import sys
import tempfile
import time
from pathlib import Path

from sacpolicy import bench
from sacpolicy.bench.serve import (
    LEARNED,
    draw,
    log_cost,
    markdown,
    per_request,
    same_as,
    summarize,
    verdict,
)
from sacpolicy.export.vllm_run import vllm_status
from sacpolicy.export.vllm_serve import CONFIGS, ServeError, VllmServer, bench_serve, completions, serve_config
from sacpolicy.io import write_text
from sacpolicy.models import EMBEDDED_TARGET, load_tokenizer, served_model

NOT_RATES = ("proposer", "reload")  # results[config] keys that hold per-server records, not a rate's runs


def dataset(prompts: list[dict], tok, path: Path) -> list[str]:
    """The held-out prompts as vLLM's custom JSONL dataset: chat-templated text, sent as is."""
    texts = [tok.decode(p["input_ids"]) for p in prompts]
    write_text(path, "".join(json.dumps({"prompt": t}) + "\n" for t in texts))
    return texts


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
                                  candidate=args.candidate, served_model=str(target_dir), log_dir=tmp / "steplog")
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
    ap.add_argument("--candidate", help="another vLLM export of a learned rule (a refit's): the candidate config, "
                    "served as learned serves --export; its verdict row sets it against learned")
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
    ap.add_argument("--reload-at", type=float, default=None,
                    help="hot-reload drill: deploy --reload-policy this many seconds into each learned run")
    ap.add_argument("--reload-policy", default=None,
                    help="the policy (artifact or vLLM export) the drill swaps to; the next run swaps back")
    ap.add_argument("--plot", default=None, help="PNG of TPOT and P99 latency against rate (default: beside --out)")
    ap.add_argument("--workdir", default=None, help="keep the servers' logs and raw results here")
    ap.add_argument("--rescore", default=None, help="earlier runs' JSON, comma-separated: re-table (and pool) them "
                    "from their raw results in --workdir (one per run), starting no server")
    cap = ap.add_argument_group("capacity at a latency target (--find-capacity)")
    cap.add_argument("--find-capacity", action="store_true",
                     help="per configuration, search for the highest Poisson rate that meets the latency target "
                          "(instead of the fixed --rates)")
    cap.add_argument("--tpot-target-ms", type=float, default=None, help="P90 TPOT bound in ms")
    cap.add_argument("--tpot-target-x", type=float, default=None,
                     help="P90 TPOT bound as a multiple of no speculation's unloaded median TPOT (one request at a "
                          "time, measured first in the same run)")
    cap.add_argument("--ttft-target-ms", type=float, default=None, help="P99 TTFT bound in ms")
    cap.add_argument("--start-x", type=float, default=0.5,
                     help="the search's first rate, as a multiple of the capacity (all requests at once)")
    cap.add_argument("--max-probes", type=int, default=8, help="the most rates probed per configuration")
    cap.add_argument("--search-tol", type=float, default=0.1, help="stop when the lowest missed rate is within "
                     "this fraction above the highest met one")
    cap.add_argument("--price-per-hour", type=float, default=None, help="the machine's price in $/hour: cost per 1M "
                     "output tokens at each capacity")
    bench.add_out(ap, "bench_serve.json")
    args = ap.parse_args(argv)
    if args.find_capacity:
        if args.tpot_target_ms is not None and args.tpot_target_x is not None:
            ap.error("give the TPOT target once: --tpot-target-ms or --tpot-target-x")
        if args.tpot_target_ms is None and args.tpot_target_x is None and args.ttft_target_ms is None:
            ap.error("--find-capacity needs a latency target: --tpot-target-ms, --tpot-target-x and/or "
                     "--ttft-target-ms")
        for flag, v in (("--tpot-target-ms", args.tpot_target_ms), ("--tpot-target-x", args.tpot_target_x),
                        ("--ttft-target-ms", args.ttft_target_ms), ("--start-x", args.start_x),
                        ("--search-tol", args.search_tol), ("--price-per-hour", args.price_per_hour)):
            if v is not None and not v > 0:
                ap.error(f"{flag} must be > 0, got {v}")
        if args.max_probes < 1 or args.repeats < 1:
            ap.error(f"--max-probes and --repeats must be >= 1, got {args.max_probes} and {args.repeats}")
        if args.reload_at is not None or args.kill_at is not None or args.rescore:
            ap.error("--find-capacity runs alone: no --reload-at, --kill-at or --rescore")
    if (args.reload_at is None) != (args.reload_policy is None):
        ap.error("--reload-at and --reload-policy go together")
    if args.reload_at is not None and "learned" not in args.configs.split(","):
        ap.error("the hot-reload drill runs on the learned configuration: add learned to --configs")
    if args.rescore:
        return rescore(args.rescore.split(","), (args.workdir or "").split(","), Path(args.out))

    ok, why = vllm_status()
    if not ok:
        raise SystemExit(f"bench_serve: {why}")
    tok = load_tokenizer(EMBEDDED_TARGET)
    prompts = bench.held_out_prompts(args.source, tok, n=args.prompts)
    if len(prompts) < args.prompts:
        raise SystemExit(f"bench_serve: {args.source} has {len(prompts)} held-out test prompts, fewer than "
                         f"--prompts {args.prompts}")
    target_dir = served_model()  # what vLLM loads
    rates = [float(r) for r in args.rates.split(",") if r.strip()]
    with tempfile.TemporaryDirectory(prefix="bench-serve-") as tmp_name:
        work = Path(args.workdir or tmp_name)
        work.mkdir(parents=True, exist_ok=True)
        data = work / "prompts.jsonl"
        dataset(prompts, tok, data)
        configs = configs_of(args, work, target_dir)
        drill = ReloadDrill(args.export, args.reload_policy, work) if args.reload_at is not None else None
        if drill is not None:
            configs["learned"] = drill.config(served_model=str(target_dir))
        print(f"vLLM {why}; {len(prompts)} {args.source} held-out prompts, {args.max_tokens} tokens max, greedy; "
              f"configurations: {', '.join(configs)}", flush=True)
        if args.find_capacity:
            return find_capacities(args, configs, len(prompts), data, work, target_dir, why)

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
            swapper = drill.swap_after(args.reload_at) if drill is not None and name == "learned" else None
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
                if swapper is not None:
                    swapper.join()
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
            if name in LEARNED:  # the proposer reports its calls, failures, batch sizes, log cost through a file
                from sacpolicy.export.vllm import STATS_ENV

                config.env = {**config.env, STATS_ENV: str(work / f"proposer-{rep}.json"),
                              **(drill.server_env(rep) if drill is not None else {})}
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
                    row = {**summarize(res), "per_request": per_request(res)}
                    row["identical"], row["compared"] = same_as(res["generated_texts"], res["errors"], ref)
                    row["rate"], row["rate_x"], row["repeat"] = r * capacity, r, rep
                    row["errors"] = sorted({e for e in res["errors"] if e})[:5]
                    results[name][str(r)].append(row)
                    print(f"  [{rep}] {name} @ {r}x ({r * capacity:.3f}/s): {row['output_throughput'] or 0:.1f} "
                          f"tok/s, mean TPOT {row.get('mean_tpot_ms') or float('nan'):.1f} ms, P99 e2e "
                          f"{row.get('p99_e2el_ms') or float('nan'):.0f} ms, identical {row['identical']}/"
                          f"{row['compared']}, failed {row['failed']}", flush=True)
            keep_proposer_stats(results, name, rep, work / f"proposer-{rep}.json")
            if drill is not None and name == "learned":
                swaps = drill.report(rep, work / f"proposer-{rep}.json")
                results[name].setdefault("reload", []).append(swaps)
                print(f"  [{rep}] learned: hot reload {swaps}", flush=True)
            print(f"  [{rep}] {name}: {time.perf_counter() - t0:.0f} s with start-up", flush=True)

    v = verdict(results, rates)
    md = markdown(results, rates, capacity, v)
    print(md)
    payload = {"vllm": why, "ld_preload": preload,
               "source": args.source, "n_prompts": len(prompts), "capacity_rps": capacity,
               "capacity_run": summarize(cap), "rates_x": rates, "results": results, "markdown": md, "verdict": v,
               "log_cost": log_cost(results, rates)}
    bench.write_results(args.out, payload, args)
    plot = Path(args.plot or Path(args.out).with_suffix(".png"))
    try:
        draw(results, rates, capacity, plot)
        print(f"wrote {args.out} and {plot}")
    except ImportError as e:
        print(f"wrote {args.out} (no plot: {e})")
    lossless = all(r["identical"] == r["compared"] for n in results for k, rows in results[n].items()
                   if k not in NOT_RATES for r in rows)
    return 0 if lossless else 1


def find_capacities(args, configs: dict, n_prompts: int, data: Path, work: Path, target_dir: Path, vllm: str) -> int:
    """``--find-capacity``: no speculation's server first measures the reference (the capacity C: every request at
    once, its outputs the reference; the unloaded TPOT: one request at a time), then every configuration's server runs
    the rate search (``sacpolicy.bench.capacity``) from ``--start-x`` C, ``--repeats`` runs per rate. The JSON is
    rewritten (atomically) after every run, so a server that dies keeps what was measured. Exit code: 0; 1 where an
    output differed from the reference (or the reference could not be measured: a message naming why); 2 where no
    configuration met the target."""
    from sacpolicy.bench.capacity import MeasureError, Search, Target, find_capacity, markdown as capacity_table

    payload: dict = {"mode": "capacity", "vllm": vllm, "source": args.source, "n_prompts": n_prompts, "results": {}}
    save = lambda: bench.write_results(args.out, payload, args)  # noqa: E731
    ref: dict = {}

    def raw(server, rate: float, tag: str, **kw) -> dict:
        if not server.alive() or not server.healthy():
            raise MeasureError(f"the server at {server.url} does not answer; its log's last lines:\n"
                               f"{server.log_tail(10)}")
        try:
            res = bench_serve(server.url, data, work / f"{tag}.json", num_prompts=n_prompts, rate=rate,
                              max_tokens=args.max_tokens, model=str(target_dir), log=work / f"{tag}.log", **kw)
        except ServeError as e:
            raise MeasureError(str(e)) from None
        if not res.get("completed"):
            raise MeasureError(f"no request completed ({res.get('failed')} failed)")
        return res

    def reference(server) -> None:
        full = raw(server, math.inf, "capacity")
        solo = raw(server, math.inf, "unloaded", max_concurrency=1)
        ref.update(texts=full["generated_texts"], capacity=summarize(full), unloaded=summarize(solo))
        payload["reference"] = {k: ref[k] for k in ("capacity", "unloaded")}
        print(f"capacity (no speculation, all {n_prompts} at once): {full['request_throughput']:.3f} requests/s; "
              f"unloaded median TPOT {ref['unloaded']['p50_tpot_ms']:.2f} ms", flush=True)
        tpot = args.tpot_target_ms
        if args.tpot_target_x is not None:
            tpot = args.tpot_target_x * ref["unloaded"]["p50_tpot_ms"]
        ref["target"] = Target(tpot_p90_ms=tpot, ttft_p99_ms=args.ttft_target_ms)
        payload["target"] = {**vars(ref["target"]), "tpot_target_x": args.tpot_target_x}
        save()

    def measure(server, name: str):
        def one(rate: float, rep: int) -> dict:
            res = raw(server, rate, f"{name}-cap-{rate:.5g}-{rep}")
            row = {**summarize(res), "rate": rate, "repeat": rep}
            row["identical"], row["compared"] = same_as(res["generated_texts"], res["errors"], ref["texts"])
            return row
        return one

    def keep(name: str, state) -> None:
        payload["results"][name] = state.to_dict(args.price_per_hour)
        save()

    try:
        if "none" not in configs:  # a server of its own for the reference
            with VllmServer(target_dir, serve_config("none"), log=work / "none-reference.log",
                            max_num_seqs=args.max_num_seqs) as base:
                completions(base.url, ["Hello"], max_tokens=4)  # warm-up
                reference(base)
        configs = {"none": configs["none"], **configs} if "none" in configs else configs
        for name, config in configs.items():
            try:
                with VllmServer(target_dir, config, log=work / f"{name}-capacity.log",
                                max_num_seqs=args.max_num_seqs) as server:
                    completions(server.url, ["Hello"], max_tokens=4)  # warm-up
                    if not ref:
                        reference(server)
                    search = Search(start=args.start_x * ref["capacity"]["request_throughput"], repeats=args.repeats,
                                    max_probes=args.max_probes, tol=args.search_tol)
                    got = find_capacity(measure(server, name), ref["target"], search,
                                        on_probe=lambda state, name=name: keep(name, state))
            except ServeError as e:  # the server did not come up: this configuration has no row, the others go on
                if not ref:  # no speculation's own server: there is no reference to measure the others against
                    raise
                payload["results"][name] = {"status": "error", "message": str(e), "rate": None,
                                            "bracket": [None, None], "probes": []}
                save()
                print(f"  {name}: {e}", flush=True)
                continue
            keep(name, got)
            print(f"  {name}: {got.status}: {got.message}", flush=True)
    except (MeasureError, ServeError) as e:  # the reference itself could not be measured
        save()
        raise SystemExit(f"bench_serve: no speculation's reference run failed: {e}; {args.out} keeps what was "
                         "measured") from None
    md = capacity_table(payload["results"], ref["target"], args.price_per_hour)
    payload["markdown"] = md
    print(md)
    print(f"wrote {bench.write_results(args.out, payload, args)}")
    if not any(r.get("rate") for r in payload["results"].values()):
        print(f"bench_serve: no configuration met the target ({ref['target'].describe()}); loosen it "
              "(--tpot-target-x, --ttft-target-ms) or see each configuration's probes in the JSON", file=sys.stderr)
        return 2
    runs = [x for r in payload["results"].values() for p in r["probes"] for x in p["runs"]]
    return 0 if all(x["identical"] == x["compared"] for x in runs) else 1


def rescore(paths: list[str], workdirs: list[str], out: Path) -> int:
    """Re-table the runs in ``paths`` (this script's JSON) with the per-request latencies of their raw results in
    ``workdirs`` (``<config>-<repeat>-<rate>.json``, as ``--workdir`` keeps them), pooled: the later runs' repeats
    join the first's, for the configurations every run has; write it to ``out``."""
    if len(workdirs) != len(paths) or not all(w and Path(w).is_dir() for w in workdirs):
        raise SystemExit(f"bench_serve: --rescore needs --workdir, one directory of raw results per run (each run's "
                         f"--workdir), got {workdirs} for {paths}; without them there are no per-request latencies")
    payload: dict = {}
    for path, workdir in zip(paths, workdirs):
        run = json.loads(Path(path).read_text())
        for name, by_rate in run["results"].items():
            for r, rows in by_rate.items():
                for row in rows if r not in NOT_RATES else []:
                    raw = Path(workdir) / f"{name}-{row['repeat']}-{r}.json"
                    if not raw.is_file():
                        raise SystemExit(f"bench_serve: {raw} is missing; --workdir must be the run's own workdir")
                    row["per_request"] = per_request(json.loads(raw.read_text()))
        if not payload:
            payload = {**run, "pooled": paths}
        elif run["rates_x"] != payload["rates_x"]:
            raise SystemExit(f"bench_serve: {path} ran rates {run['rates_x']}, not {payload['rates_x']}; pool runs "
                             "of the same rates")
        else:
            base = 1 + max(row["repeat"] for by in payload["results"].values() for r, rows in by.items()
                           if r not in NOT_RATES for row in rows)
            payload["results"] = {n: {r: rows + [{**x, "repeat": x["repeat"] + base} for x in run["results"][n][r]]
                                      for r, rows in by.items() if r not in NOT_RATES}
                                  for n, by in payload["results"].items() if n in run["results"]}
    res, rates = payload["results"], payload["rates_x"]
    payload["verdict"] = verdict(res, rates)
    payload["markdown"] = markdown(res, rates, payload["capacity_rps"], payload["verdict"])
    print(f"{payload['markdown']}\n\nwrote {bench.write_results(out, payload)}")
    return 0


class ReloadDrill:
    """The hot-reload drill's deploy root (``work/deploy``) with ``export`` current, and its swaps: each learned run
    deploys the other of (``other``, ``export``) ``at`` seconds in."""

    def __init__(self, export, other, work: Path):
        from sacpolicy.export.deploy import deploy

        if export is None:
            raise SystemExit("bench_serve: the hot-reload drill needs --export (the version served first)")
        self.root, self.work = Path(work) / "deploy", Path(work)
        self.sources = [Path(export), Path(other)]
        deploy(export, self.root)
        self.swaps: list[dict] = []

    def config(self, served_model: str):
        """The learned configuration serving the deploy root's ``current``, checking it every second."""
        from sacpolicy.export.reload import RELOAD_ENV

        config = serve_config("learned", export=self.root / "current", served_model=served_model)
        config.env = {**config.env, RELOAD_ENV: "1"}
        return config

    def log_dir(self, rep: int) -> Path:
        return self.work / f"reload-steplog-{rep}"

    def server_env(self, rep: int) -> dict:
        """Repeat ``rep``'s server: a step log of its own (the steps each policy id planned), written every second
        (vLLM kills its worker at shutdown: what the log holds unwritten then is lost)."""
        from sacpolicy.export.steplog import FLUSH_ENV
        from sacpolicy.export.vllm import LOG_ENV

        return {LOG_ENV: str(self.log_dir(rep)), FLUSH_ENV: "1"}

    def swap_after(self, seconds: float):
        """A started thread that deploys the next version ``seconds`` from now (a failed deploy is reported in the
        swap's record, never raised in the run)."""
        import threading

        from sacpolicy.export.deploy import deploy

        source = self.sources[1 - len(self.swaps) % 2]
        record = {"deploy": str(source), "at_s": seconds}
        self.swaps.append(record)

        def swap():
            time.sleep(seconds)
            try:
                record["version"] = deploy(source, self.root).name
                record["unix_s"] = time.time()
            except Exception as e:  # noqa: BLE001 - the drill reports it
                record["error"] = f"{type(e).__name__}: {e}"

        thread = threading.Thread(target=swap, daemon=True)
        thread.start()
        return thread

    def report(self, rep: int, stats_path: Path) -> dict:
        return reload_report(self.log_dir(rep), stats_path, self.swaps[-1:])


def reload_report(log_dir: Path, stats_path: Path, swaps: list[dict]) -> dict:
    """What a drill server did: its swaps and failed swaps (the proposer's stats file), the policy id it ended on,
    and the verify steps each policy id planned (its step log), beside the deploys the drill made."""
    from sacpolicy.traces.steplog_read import read_step_log

    stats = json.loads(Path(stats_path).read_text()) if Path(stats_path).is_file() else {}
    steps: dict[str, int] = {}
    span: dict[str, list[float]] = {}
    if Path(log_dir).is_dir() and any(Path(log_dir).glob("*.parquet")):
        for r in read_step_log(log_dir)[0]:
            steps[r["policy"]] = steps.get(r["policy"], 0) + 1
            first, last = span.setdefault(r["policy"], [r["unix_s"], r["unix_s"]])
            span[r["policy"]] = [min(first, r["unix_s"]), max(last, r["unix_s"])]
    return {"reloads": stats.get("reloads"), "reload_failures": stats.get("reload_failures"),
            "final_policy_id": stats.get("policy_id"), "policy_steps": steps,
            "policy_unix_s": span, "deploys": [dict(s) for s in swaps]}


def keep_proposer_stats(results: dict, name: str, rep: int, path: Path) -> None:
    """Append one repeat's stats file of a learned rule's proposer (calls, seconds, failures, live batch sizes, the
    step log's cost) to ``results[name]["proposer"]``, a list over repeats."""
    if name in LEARNED and Path(path).is_file():
        results[name].setdefault("proposer", []).append({"repeat": rep, **json.loads(Path(path).read_text())})


if __name__ == "__main__":
    sys.exit(main())
