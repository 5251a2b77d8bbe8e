"""Decoder speed of this checkout against another commit, side by side: the same workload decoded by both, in
alternating worker processes, with per-prompt paired intervals.

    python scripts/bench_commits.py --base 627a236                              # 24 prompts, 96 tokens, 2 repeats
    python scripts/bench_commits.py --base 627a236 --policy <run>/policies/hgb --batch 16 --out bench_commits.json

The base commit is checked out into a temporary git worktree (removed afterwards); each worker process imports
sacpolicy from its tree (``PYTHONPATH``), loads the embedded target on the CPU and decodes every configuration over
held-out MT-Bench first turns (after warm-up prompts that are not counted), writing per-prompt tokens and seconds.
Repeats alternate the order of the trees (AB BA AB ...), so a machine that drifts moves both alike. Configurations:
``ar``; ``ngram-k3``; ``layerskip-k4`` (the target's first 4 layers); ``head-heuristic`` (the shipped EAGLE-3 head);
``learned`` (``--policy``: a policy artifact, its drafters rebuilt from it); ``batch<B>-...`` (``--batch B``: the
learned policy where its cost model was profiled over batch sizes, else static n-gram k=3, decoding all prompts with continuous batching at ``max_batch`` B,
timed as one call). Greedy: every configuration's tokens must be equal across the trees, else the run fails.

Only the public decoder API is used, so any commit since the batched decoder (``generate_batch``) can be the base.
Prints a Markdown table; ``--out`` writes the JSON (per-prompt timings included).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


# ---------------------------------------------------------------------- the worker (runs in either tree)
def work(args) -> dict:
    """Decode every configuration over the prompts with the sacpolicy on ``sys.path``: {config: [[tokens, seconds,
    output ids], ...] per prompt} (a batch configuration: one entry for the whole call)."""
    import torch

    from sacpolicy import bench
    from sacpolicy.decoding import (
        DecoderConfig,
        LayerSkipDrafter,
        NgramDrafter,
        SpeculativeDecoder,
    )
    from sacpolicy.decoding.feature import load_feature_drafter
    from sacpolicy.heads import shipped_head
    from sacpolicy.models import EMBEDDED_TARGET
    from sacpolicy.policy import Autoregressive, Heuristic, Static

    torch.set_num_threads(args.threads or torch.get_num_threads())
    lm = bench.load_target(EMBEDDED_TARGET)
    target, eos = lm.model, lm.eos_token_ids
    rows = bench.held_out_prompts("mt_bench", lm.tokenizer, split="test", n=args.warmup + args.prompts)
    prompts = [r["input_ids"] for r in rows]
    head = load_feature_drafter(lm, shipped_head(EMBEDDED_TARGET), name="head")
    configs = {
        "ar": ([], Autoregressive()),
        "ngram-k3": ([NgramDrafter(name="ngram")], Static(3, "ngram")),
        "layerskip-k4": ([LayerSkipDrafter(target, 4, name="layerskip")], Static(4, "layerskip")),
        "head-heuristic": ([head], Heuristic(k0=4, drafter="head")),
    }
    if args.policy:
        try:  # the one build_drafters takes an artifact; a base commit before it had that one in export
            from sacpolicy.build import artifact_specs, build_drafters  # noqa: F401
        except ImportError:
            from sacpolicy.export import build_drafters
        from sacpolicy.policy.learned import LearnedPolicy
        from sacpolicy.runtime import load_policy

        configs["learned"] = (build_drafters(args.policy, lm), LearnedPolicy(load_policy(args.policy)))
    out = {}
    for name, (drafters, policy) in configs.items():
        dec = SpeculativeDecoder(target, drafters, policy, stop_token_ids=eos)
        for ids in prompts[: args.warmup]:
            dec.generate(ids, args.max_new_tokens)
        out[name] = []
        for ids in prompts[args.warmup:]:
            t0 = time.perf_counter()
            res = dec.generate(ids, args.max_new_tokens)
            out[name].append([len(res.tokens), time.perf_counter() - t0, res.tokens])
    if args.batch:
        # the learned rule plans each step for the live batch: only a cost model profiled over batch sizes can
        name = "learned" if args.policy and getattr(configs["learned"][1].rule.cost, "batch", None) else "ngram-k3"
        drafters, policy = configs[name]
        dec = SpeculativeDecoder(target, drafters, policy, stop_token_ids=eos,
                                 config=DecoderConfig(max_batch=args.batch))
        dec.generate_batch(prompts[: max(args.warmup, 2)], args.max_new_tokens)
        t0 = time.perf_counter()
        res = dec.generate_batch(prompts[args.warmup:], args.max_new_tokens)
        seconds = time.perf_counter() - t0
        out[f"batch{args.batch}-{name}"] = [[sum(len(r.tokens) for r in res), seconds, [r.tokens for r in res]]]
    return out


# ---------------------------------------------------------------------- the driver
def run_worker(tree: Path, args, out: Path) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--out", str(out),
           "--prompts", str(args.prompts), "--warmup", str(args.warmup), "--max-new-tokens", str(args.max_new_tokens),
           "--batch", str(args.batch), "--threads", str(args.threads)] + (["--policy", args.policy] if args.policy
                                                                           else [])
    env = {**os.environ, "PYTHONPATH": str(tree)}
    subprocess.run(cmd, cwd=tree, env=env, check=True)
    return json.loads(out.read_text())


def compare(results: dict, resamples: int = 2000) -> list[dict]:
    """Per configuration: tokens/s of each tree over all repeats and the head/base ratio with a paired bootstrap
    interval over (repeat, prompt) pairs; a batch configuration (one call per repeat) gets the range over repeats."""
    import numpy as np

    from sacpolicy.evaluation.intervals import bootstrap_indices, paired_ratio_interval

    table = []
    for name in results["head"][0]:
        per = {tree: [p for rep in results[tree] for p in rep[name]] for tree in ("head", "base")}
        tok = {t: np.array([p[0] for p in v], float) for t, v in per.items()}
        sec = {t: np.array([p[1] for p in v], float) for t, v in per.items()}
        tps = {t: tok[t].sum() / sec[t].sum() for t in per}
        row = {"config": name, "base_tokens_per_s": tps["base"], "head_tokens_per_s": tps["head"],
               "ratio": tps["head"] / tps["base"], "pairs": len(tok["head"])}
        if len(tok["head"]) > 2:
            row["interval"] = paired_ratio_interval(tok["head"], sec["head"], tok["base"], sec["base"],
                                                    idx=bootstrap_indices(len(tok["head"]), resamples=resamples))
        else:
            row["runs"] = list(tok["head"] / sec["head"] / (tok["base"] / sec["base"]))
        table.append(row)
    return table


def check_same_outputs(results: dict) -> list[str]:
    """Configurations whose greedy outputs differ between the trees (or between repeats)."""
    ref = results["head"][0]
    return sorted({name for tree in ("head", "base") for rep in results[tree] for name in rep
                   if [p[2] for p in rep[name]] != [p[2] for p in ref[name]]})


def main(argv=None) -> dict:
    from sacpolicy import bench

    ap = bench.parser(__doc__)
    ap.add_argument("--base", help="the commit to compare against (any git revision)")
    ap.add_argument("--prompts", type=int, default=24, help="MT-Bench test-split first turns timed per repeat")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=2, help="runs of each tree, in alternating order")
    ap.add_argument("--policy", help="a learned policy artifact (a `learned` row, and the batch row's policy)")
    ap.add_argument("--batch", type=int, default=0, help="also a continuous-batching row at this max_batch")
    ap.add_argument("--threads", type=int, default=0, help="torch threads per worker (0: torch's default)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    bench.add_out(ap, None)
    args = ap.parse_args(argv)
    if args.worker:
        Path(args.out).write_text(json.dumps(work(args)))
        return {}
    if not args.base:
        ap.error("--base <commit> is required (the commit to compare this checkout against)")
    if args.policy:
        args.policy = str(Path(args.policy).resolve())
    commit = subprocess.run(["git", "rev-parse", "--short", args.base], cwd=ROOT, capture_output=True, text=True)
    if commit.returncode:
        ap.error(f"--base {args.base!r} is not a commit of this repository ({commit.stderr.strip()})")
    with tempfile.TemporaryDirectory(prefix="bench-commits-") as tmp:
        base_tree = Path(tmp) / "base"
        subprocess.run(["git", "worktree", "add", "--detach", "-q", str(base_tree), args.base], cwd=ROOT, check=True)
        try:
            results = {"head": [], "base": []}
            for rep, tree in bench.alternating(["head", "base"], args.repeats):
                print(f"[bench_commits] repeat {rep + 1}/{args.repeats}: {tree}", flush=True)
                results[tree].append(run_worker(ROOT if tree == "head" else base_tree, args,
                                                Path(tmp) / f"{tree}-{rep}.json"))
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(base_tree)], cwd=ROOT, check=False)
    table = compare(results)
    differ = check_same_outputs(results)
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    print(bench.table(["config", f"base {commit.stdout.strip()} tok/s", f"this ({head.stdout.strip()}) tok/s",
                       "this / base"],
                      [[r["config"], bench.cell(r["base_tokens_per_s"]), bench.cell(r["head_tokens_per_s"]),
                        bench.ratio(r["ratio"], r.get("interval"), r.get("runs"))] for r in table]))
    payload = {"base": commit.stdout.strip(), "head": head.stdout.strip(), "table": table,
               "outputs_differ": differ, "raw": results}
    if args.out:
        bench.write_results(args.out, payload, args)
    if differ:
        raise SystemExit(f"greedy outputs differ between the commits for {differ}: the change is not lossless")
    return payload


if __name__ == "__main__":
    main()
