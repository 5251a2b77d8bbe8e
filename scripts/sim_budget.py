"""Simulated: a batch's draft slots planned as for a padded pass against planned jointly, on a host whose pass costs
the tokens it feeds (vLLM flattens a step's tokens; ``CostModel.verify_pass = "total"``).

Replays a run's learned rule over its greedy test traces with the batched decoder (``simulate_batch``: acceptance as
recorded, seconds from the cost model, the pass priced by its rows' own tokens) at each batch size, the rule planning
(a) as today's decoder plans (``"padded"``: the longest block K searched, rows trimmed to what pays for its draft
time) and (b) jointly (``"total"``: ``CostModel.allocate_batch_k``, the stop rule paying the pass per token), beside
autoregressive decoding. Every figure is simulated: costs from ``--cost`` (a measured profile with batch curves, or a
roofline's: ``scripts/roofline.py``), its drafters the rule's.

    python scripts/roofline.py --device h100-sxm --target llama-3.1-8b --draft feature=eagle3-llama-3.1-8b \\
        --model-free-from outputs/RUN/cost.json --out /tmp/h100_8b_cost.json
    python scripts/sim_budget.py --run outputs/RUN --predictor mlp --cost /tmp/h100_8b_cost.json --batch-sizes 4,16,64
"""

from __future__ import annotations

import sys
import time
from dataclasses import replace
from pathlib import Path

from sacpolicy import bench
from sacpolicy.data import assign_split
from sacpolicy.policy import Autoregressive
from sacpolicy.policy.learned import LearnedPolicy
from sacpolicy.runtime.artifact import load_artifact
from sacpolicy.runtime.cost import CostModel
from sacpolicy.traces.schema import load_traces, read_meta
from sacpolicy.traces.simulate import group_traces, simulate_batch


def main(argv=None) -> int:
    ap = bench.parser(__doc__)
    ap.add_argument("--run", required=True, help="a run directory: its traces/tf and policies/<predictor>")
    ap.add_argument("--predictor", default="mlp")
    ap.add_argument("--cost", required=True, help="a cost.json with batch curves (priced as a flattened pass)")
    ap.add_argument("--batch-sizes", default="4,16,64")
    ap.add_argument("--prompts", type=int, default=None, help="at most this many test prompts (default: all)")
    bench.add_out(ap, None)
    args = ap.parse_args(argv)
    run = Path(args.run)
    cost = replace(CostModel.from_json(args.cost), verify_pass="total")
    rule = load_artifact(run / "policies" / args.predictor).rule
    tf = run / "traces" / "tf"
    meta = read_meta(tf)
    grouped = group_traces(load_traces(tf, kind="teacher_forced"), meta)
    test = {pid: p for pid, p in grouped.items() if assign_split(pid) == "test"}
    test = dict(list(test.items())[: args.prompts]) if args.prompts else test
    sizes = bench.int_list(args.batch_sizes)
    for B in sizes:
        cost.check_batch(B)
    policies = {"ar": Autoregressive,
                "padded": lambda: LearnedPolicy(replace(rule, cost=replace(cost, verify_pass="padded"))),
                "total": lambda: LearnedPolicy(replace(rule, cost=cost))}
    rows, out = [], []
    for B in sizes:
        res = {}
        for name, make in policies.items():
            t0 = time.perf_counter()
            r = simulate_batch(make(), test, cost, vocab_size=int(meta["vocab_size"]), max_batch=B)
            res[name] = r
            out.append({"batch": B, "policy": name, "tokens_per_s": r.tokens_per_s, "tokens": r.tokens,
                        "target_calls": r.target_calls, "makespan_s": r.makespan_s,
                        "replay_s": time.perf_counter() - t0})
        rows.append([B, *(f"{res[n].tokens_per_s:.1f}" for n in policies),
                     f"{res['total'].tokens_per_s / res['padded'].tokens_per_s:.3f}",
                     f"{res['total'].tokens_per_s / res['ar'].tokens_per_s:.3f}"])
    print(f"SIMULATED: {len(test)} test prompts of {run}, rule {args.predictor}, costs of {args.cost} "
          f"({cost.meta.get('source', 'measured')}), every pass priced by its rows' own tokens\n")
    print(bench.table(["batch", "ar tok/s", "padded plan tok/s", "joint plan tok/s", "joint / padded", "joint / ar"],
                      rows))
    if args.out:
        bench.write_results(args.out, {"simulated": True, "rows": out}, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
