"""Greedy exactness of a run's target through every configuration the run decodes with: each of its drafters alone
(static k) and batched, the feature head's token trees, and each learned rule, alone and batched, against
transformers' own ``generate`` on the run's held-out prompts.

    python scripts/check_exact.py --run outputs/<date>/<time> --prompts 24 --max-new-tokens 64
    python scripts/check_exact.py --run <a gemma3_270m run> --out outputs/check_exact_gemma.json

The reference is ``generate`` (greedy, one prompt at a time, no padding, the target's stop tokens); every
configuration must emit the same tokens for every prompt. Batched configurations decode ``--batch`` rows at a time
with continuous batching (rows join as others finish). Prints a Markdown table (configuration, prompts identical,
the first differing prompt and position) and writes the JSON; exits 1 when any configuration differs, naming it.
A learned rule whose cost model cannot price a batch (profiled at batch size 1) is listed as skipped for its
batched row; a configuration that raises is a failure, recorded with the others (results are written after each).
Greedy on float32: a difference is a defect unless the target's top two logits at that position tie within float
rounding, which the table shows (``margin``: top-1 minus top-2 logit at the first difference, on a fresh pass).
"""

from __future__ import annotations

import sys
import time
from dataclasses import replace
from functools import partial
from pathlib import Path

import torch

from sacpolicy import bench


def reference(model, prompts: list[list[int]], n: int, stop: list[int]) -> list[list[int]]:
    out = []
    for p in prompts:
        with torch.no_grad():
            ids = model.generate(torch.tensor([p], device=model.device), max_new_tokens=n, do_sample=False,
                                 eos_token_id=stop or None, pad_token_id=stop[0] if stop else 0,
                                 attention_mask=torch.ones(1, len(p), dtype=torch.long, device=model.device))
        out.append(ids[0, len(p):].tolist())
    return out


def margin(model, prompt: list[int], tokens: list[int], at: int) -> float:
    """Top-1 minus top-2 logit of the target at the ``at``-th new token after ``prompt + tokens[:at]``."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + tokens[:at]], device=model.device)).logits[0, -1].float()
    top = logits.topk(2).values
    return float(top[0] - top[1])


def cannot_batch(policy, batch: int | None) -> str | None:
    """Why ``policy`` cannot plan a batch of ``batch`` rows (a learned rule whose cost model was profiled at batch size
    1 only), else None."""
    cost = getattr(getattr(policy, "rule", None), "cost", None)
    if batch is None or batch < 2 or cost is None:
        return None
    try:
        cost.check_batch(batch)
    except ValueError:
        return ("its cost model was profiled at batch size 1 only (a run with collect.profile.batch_sizes=[1,2,4,8,16] "
                "can plan batches)")
    return None


def configurations(ctx, args) -> dict:
    """name -> (drafters, policy factory, batch rows or None)."""
    from sacpolicy.policy import Static
    from sacpolicy.policy.learned import LearnedPolicy

    drafters = ctx.drafters
    out = {}
    for d in drafters:
        trees = [0] + ([args.tree] if hasattr(d, "tree_budget") else [])  # ``DraftsTrees``
        for tree in trees:
            name = f"{d.name} k={args.k}" + (f" tree={tree}" if tree else "")
            make = partial(Static, args.k, drafter=d.name, tree=tree)
            out[name] = ([d], make, None)
            out[f"{name} B={args.batch}"] = ([d], make, args.batch)
    if args.predictors == "none":
        return out
    rules, headline = ctx.learned_rules("check_exact")
    for p, rule in rules.items():
        if args.predictors != "all" and p not in (args.predictors.split(",") if args.predictors else [headline]):
            continue
        out[f"learned-{p}"] = (drafters, partial(LearnedPolicy, rule), None)
        out[f"learned-{p} B={args.batch}"] = (drafters, partial(LearnedPolicy, rule), args.batch)
    return out


def main(argv=None) -> int:
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    from sacpolicy.decoding import SpeculativeDecoder, reset_drafters
    from sacpolicy.pipeline.context import RunContext

    ap = bench.parser(__doc__)
    ap.add_argument("--run", required=True, help="a run directory (its config, drafters, head and policies)")
    ap.add_argument("--prompts", type=int, default=24, help="held-out prompts (the test split of the run's mix)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--k", type=int, default=4, help="the static configurations' k")
    ap.add_argument("--tree", type=int, default=8, help="the feature head's token-tree budget (nodes)")
    ap.add_argument("--batch", type=int, default=4, help="rows of the batched configurations")
    ap.add_argument("--configs", default=None,
                    help="only the configurations whose name contains one of these, comma-separated (e.g. learned)")
    ap.add_argument("--predictors", default=None,
                    help="learned rules checked, comma-separated, 'all' or 'none' (default: the run's headline one)")
    bench.add_out(ap, "check_exact.json")
    args = ap.parse_args(argv)
    run = Path(args.run)
    if not (run / "config.yaml").is_file():
        raise SystemExit(f"check_exact: {run} has no config.yaml; pass a run directory (outputs/<date>/<time>)")
    cfg = OmegaConf.load(run / "config.yaml")
    ctx = RunContext(cfg, run)
    target = ctx.target
    stop = list(target.eos_token_ids)
    rows = ctx.take(ctx.prompts("test"), args.prompts)  # the run's held-out mix, in its seeded order
    prompts = [list(r["input_ids"]) for r in rows]
    t = time.perf_counter()
    ref = reference(target.model, prompts, args.max_new_tokens, stop)
    print(f"{cfg.target.spec}: {len(prompts)} held-out prompts, {args.max_new_tokens} new tokens; reference "
          f"(transformers generate) {time.perf_counter() - t:.0f} s", flush=True)
    results = []
    base = instantiate(cfg.decoder)
    chosen = configurations(ctx, args)
    if args.configs:
        chosen = {n: c for n, c in chosen.items() if any(part in n for part in args.configs.split(","))}
    for name, (drafters, make, batch) in chosen.items():
        t = time.perf_counter()
        reset_drafters(drafters)
        config = base if batch is None else replace(base, max_batch=batch)
        policy = make()
        why = cannot_batch(policy, batch)
        if why:
            results.append({"config": name, "skipped": why})
            print(f"  {name}: skipped: {why}", flush=True)
            continue
        dec = SpeculativeDecoder(target.model, drafters, policy, config=config, stop_token_ids=stop)
        try:
            if batch is None:
                got = [dec.generate(p, args.max_new_tokens) for p in prompts]
            else:
                got = dec.generate_batch(prompts, args.max_new_tokens)
        except Exception as e:  # a configuration that cannot decode is a failure, recorded with the others
            results.append({"config": name, "identical": 0, "prompts": len(prompts), "error": repr(e)})
            print(f"  {name}: FAILED: {e!r}", flush=True)
            continue
        tokens = [g.tokens for g in got]
        same = [a == b for a, b in zip(tokens, ref)]
        row = {"config": name, "identical": sum(same), "prompts": len(prompts),
               "drafted": sum(s.drafted for g in got for s in g.steps),
               "accepted": sum(s.accepted for g in got for s in g.steps), "seconds": time.perf_counter() - t}
        if not all(same):
            i = same.index(False)
            at = next((j for j, (a, b) in enumerate(zip(tokens[i], ref[i])) if a != b),
                      min(len(tokens[i]), len(ref[i])))
            row |= {"first_prompt": i, "first_position": at, "margin": margin(target.model, prompts[i], ref[i], at)}
        results.append(row)
        bench.write_results(args.out, {"target": cfg.target.spec, "run": str(run), "rows": results}, args)  # so far
        print(f"  {name}: {row['identical']}/{row['prompts']} identical, {row['accepted']}/{row['drafted']} drafted "
              f"tokens accepted, {row['seconds']:.0f} s", flush=True)
    md = bench.table(["configuration", "identical to generate", "drafted tokens accepted", "first difference"],
                     ([r["config"], "skipped", "-", r["skipped"]] if "skipped" in r else
                      [r["config"], f"0/{r['prompts']}", "-", f"error: {r['error']}"] if "error" in r else
                      [r["config"], f"{r['identical']}/{r['prompts']}", f"{r['accepted']}/{r['drafted']}",
                       "-" if r["identical"] == r["prompts"] else
                       f"prompt {r['first_prompt']} token {r['first_position']} (margin {r['margin']:.2g})"]
                      for r in results))
    print(md)
    bench.write_results(args.out, {"target": cfg.target.spec, "run": str(run), "rows": results, "markdown": md},
                        args)
    bad = [r["config"] for r in results if "skipped" not in r and r["identical"] < r["prompts"]]
    if bad:
        print(f"check_exact: FAILED: {', '.join(bad)} differ from transformers' greedy output", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
