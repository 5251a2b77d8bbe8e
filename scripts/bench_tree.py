"""Token trees against chains for the shipped EAGLE-3 head on the embedded target: at equal budget (verified tokens
per target pass: a chain of k = budget against a tree of budget nodes), accepted tokens per target call and tokens/s,
paired prompt by prompt with bootstrap intervals.

    python scripts/bench_tree.py                                    # budgets 8,16, 16 held-out MT-Bench prompts
    python scripts/bench_tree.py --budgets 4,8,16,32 --depth 6 --prompts 48 --source sharegpt
    python scripts/bench_tree.py --prompts 2 --max-new-tokens 16    # smoke run
    python scripts/bench_tree.py --budgets 8,16 --cost outputs/default/cost.json   # and trees sized by a cost model

Every configuration decodes every prompt, the order reversed every other prompt, after one warm-up
generation each; greedy unless ``--temperature``. Per configuration: tokens per verify step (accepted + the target's
own), accepted tokens per verify step, tokens/s and the speedup over autoregressive decoding; per budget, tree over
chain for both, with paired bootstrap intervals over prompts (``evaluation.intervals``). Prints a Markdown table and
writes ``bench_tree.json``. ``--cost <cost.json>`` (a run's cost model, profiled with the head as ``--cost-drafter``)
adds ``tree-<budget>-sized``: the same tree cut after growing to the nodes that pay for their verify cost
(``FeatureDrafter.size_trees_by``, EAGLE-2's dynamic size), with its ratios to the chain and to the full tree.
"""

from __future__ import annotations

import sys

import numpy as np

from sacpolicy import bench


def configs(budgets: list[int], depth: int, sized: bool = False) -> dict[str, tuple[int, int]]:
    """name -> (k, tree budget): autoregressive, then per budget the chain of that length and the tree (and the
    tree sized by the cost model: ``sized``)."""
    out = {"ar": (0, 0)}
    for b in budgets:
        out[f"chain-k{b}"] = (b, 0)
        out[f"tree-{b}"] = (min(depth, b), b)
        if sized:
            out[f"tree-{b}-sized"] = (min(depth, b), b)
    return out


def run(args) -> dict:
    from sacpolicy.decoding import DecoderConfig, SamplingConfig, SpeculativeDecoder
    from sacpolicy.decoding.feature import FeatureDrafter, load_feature_drafter
    from sacpolicy.heads import shipped_head
    from sacpolicy.policy import Autoregressive, Static

    target = bench.load_target(args.target)
    head = load_feature_drafter(target, args.head or shipped_head(target.spec), name="head",
                                tree_width=args.width)
    prompts = [r["input_ids"] for r in bench.held_out_prompts(args.source, target.tokenizer, n=args.prompts)]
    if not prompts:
        raise SystemExit(f"no held-out prompts in {args.source!r}; pick another --source")
    sampling = SamplingConfig(temperature=args.temperature, seed=0)
    k_max = max(max(args.budgets), args.depth)
    sized = None
    if args.cost:
        from sacpolicy.runtime.cost import CostModel

        sized = FeatureDrafter(head.head, name="head", tree_width=args.width)  # the same weights, trees cut by cost
        sized.size_trees_by(CostModel.from_json(args.cost), drafter=args.cost_drafter)

    decs = {}
    for name, (k, tree) in configs(args.budgets, args.depth, sized is not None).items():
        policy = Autoregressive() if k == 0 else Static(k, tree=tree)
        drafters = [] if k == 0 else [sized if name.endswith("-sized") else head]
        decs[name] = SpeculativeDecoder(target.model, drafters, policy, sampling=sampling,
                                        config=DecoderConfig(k_max=k_max), stop_token_ids=target.eos_token_ids)
    for dec in decs.values():
        dec.generate(prompts[0], 8)  # warm-up
    per = {name: {"tokens": [], "seconds": [], "steps": [], "accepted": [], "nodes": []} for name in decs}
    for i, ids in enumerate(prompts):
        for name in (list(decs) if i % 2 == 0 else list(decs)[::-1]):  # ABC CBA ...: drift moves all alike
            r = decs[name].generate(ids, args.max_new_tokens)
            bench.check_drafters_kept(name, [r.dropped_drafters], requests=[i], allow=args.allow_dropped_drafters)
            row = per[name]
            row["tokens"].append(len(r.tokens) - 1)  # the prefill's token is no verify step's
            row["seconds"].append(r.decode_s)
            row["steps"].append(len(r.steps))
            row["accepted"].append(sum(s.accepted for s in r.steps))
            row["nodes"].append(sum(s.drafted for s in r.steps))
    return {"prompts": len(prompts), "per_prompt": per, "summary": summarize(per, args.budgets)}


def summarize(per: dict, budgets: list[int]) -> dict:
    from sacpolicy.evaluation.intervals import bootstrap_indices, paired_ratio_interval

    tot = {n: {k: float(np.sum(v)) for k, v in row.items()} for n, row in per.items()}
    out = {}
    for name, t in tot.items():
        out[name] = {"tokens_per_step": t["tokens"] / max(t["steps"], 1),
                     "nodes_per_step": t.get("nodes", 0.0) / max(t["steps"], 1),
                     "accepted_per_step": t["accepted"] / max(t["steps"], 1),
                     "tokens_per_s": t["tokens"] / t["seconds"] if t["seconds"] else 0.0,
                     "speedup_vs_ar": (t["tokens"] / t["seconds"]) / (tot["ar"]["tokens"] / tot["ar"]["seconds"])}
    idx = bootstrap_indices(len(per["ar"]["tokens"]))

    def versus(name: str, other: str, suffix: str, rates: tuple) -> None:
        """``name``'s rates over ``other``'s: ``<rate>_vs_<suffix>`` and, over 3+ prompts, its paired interval
        ``<interval key>``; ``rates``: (rate key, numerator, denominator, interval key)."""
        for key, num, den, interval in rates:
            out[name][f"{key}_vs_{suffix}"] = out[name][key] / max(out[other][key], 1e-9)
            if len(per[name]["tokens"]) >= 3:
                out[name][interval] = paired_ratio_interval(per[name][num], per[name][den], per[other][num],
                                                            per[other][den], idx=idx)

    tokens_per_s = ("tokens_per_s", "tokens", "seconds", "tokens_per_s_interval")
    for b in budgets:
        for name in (f"tree-{b}", f"tree-{b}-sized"):
            if name in per:
                versus(name, f"chain-k{b}", "chain",
                       (("accepted_per_step", "accepted", "steps", "accepted_per_step_interval"), tokens_per_s))
        if f"tree-{b}-sized" in per:  # the sized tree against the full one
            versus(f"tree-{b}-sized", f"tree-{b}", "tree",
                   (("tokens_per_s", "tokens", "seconds", "tokens_per_s_vs_tree_interval"),))
    return out


def markdown(summary: dict) -> str:
    rows = []
    for name, s in summary.items():
        rows.append([name, bench.cell(s.get("nodes_per_step", 0.0)), bench.cell(s["tokens_per_step"]),
                     bench.cell(s["accepted_per_step"]),
                     bench.cell(s["tokens_per_s"], ".1f"), bench.ratio(s["speedup_vs_ar"]),
                     bench.ratio(s["accepted_per_step_vs_chain"], s.get("accepted_per_step_interval"))
                     if "accepted_per_step_vs_chain" in s else "-",
                     bench.ratio(s["tokens_per_s_vs_chain"], s.get("tokens_per_s_interval"))
                     if "tokens_per_s_vs_chain" in s else "-",
                     bench.ratio(s["tokens_per_s_vs_tree"], s.get("tokens_per_s_vs_tree_interval"))
                     if "tokens_per_s_vs_tree" in s else "-"])
    return bench.table(["config", "drafted / step", "tokens / verify step", "accepted / verify step", "tokens/s",
                        "vs AR", "accepted / step, tree vs chain", "tokens/s, tree vs chain",
                        "tokens/s, sized vs full tree"], rows)


def main(argv=None) -> None:
    ap = bench.parser(__doc__)
    bench.add_target(ap)
    ap.add_argument("--head", default=None, help="a head directory (default: the head shipped for the target)")
    ap.add_argument("--source", default="mt_bench", help="prompt set; its held-out test split is used")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--budgets", type=bench.int_list, default=[8, 16], help="verified tokens per pass, e.g. 8,16")
    ap.add_argument("--depth", type=int, default=6, help="a tree's depth at most (k of its decisions)")
    ap.add_argument("--width", type=int, default=None, help="tree nodes expanded per depth (default: the spec's)")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--cost", default=None, help="a cost.json that prices the head: adds trees sized by it")
    ap.add_argument("--cost-drafter", default="feature", help="the cost model's name for the head")
    bench.add_allow_dropped(ap)
    bench.add_out(ap, "bench_tree.json")
    args = ap.parse_args(argv)
    if args.width is None:
        from sacpolicy.runtime.spec import TREE_WIDTH

        args.width = TREE_WIDTH
    res = run(args)
    print(markdown(res["summary"]))
    print(f"\n{res['prompts']} prompts of {args.source}, {args.max_new_tokens} new tokens, T={args.temperature}; "
          f"wrote {bench.write_results(args.out, res, args)}", file=sys.stderr)


if __name__ == "__main__":
    main()
