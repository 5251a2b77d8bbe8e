"""Write a GPU cost profile on paper: the roofline ``CostModel`` of a target (and model drafters) on a device, from
published bandwidth, peak FLOPs and model shapes (``sacpolicy.profiling.roofline``), in the ``cost.json`` format the
simulator prices. Nothing runs on a GPU; the file's ``meta`` says it is computed, not measured.

    python scripts/roofline.py --device h100-sxm --target llama-3.1-8b --draft draft=llama-3.2-1b \\
        --draft eagle3=eagle3-llama-3.1-8b --model-free-from runs/x/cost.json --out runs/h100_8b_cost.json

``--model-free-from``: a measured profile whose model-free drafters (n-gram, suffix: CPU lookups a GPU roofline does
not price) are copied as they were measured. ``--efficiency 0.7``: the fraction of peak bandwidth and FLOPs the
kernels achieve (1.0: the paper roofline); ``--pass-overhead-us``: a fixed cost per forward pass. Prints a table of
verify times against batch size and k.
"""

from __future__ import annotations

import sys

from sacpolicy import bench
from sacpolicy.profiling.roofline import DEVICES, MODELS, roofline_cost_model, ridge_tokens
from sacpolicy.runtime.cost import CostModel


def main(argv=None) -> int:
    ap = bench.parser(__doc__)
    ap.add_argument("--device", default="h100-sxm", choices=sorted(DEVICES))
    ap.add_argument("--target", default="llama-3.1-8b", choices=sorted(MODELS))
    ap.add_argument("--draft", action="append", default=[], metavar="NAME=MODEL",
                    help=f"a model drafter: its name in the traces and its shape, one of {sorted(MODELS)}")
    ap.add_argument("--model-free-from", default=None, help="a measured cost.json: copy its model-free drafters")
    ap.add_argument("--k-max", type=int, default=8)
    ap.add_argument("--batch-sizes", default="1,2,4,8,16,32,64,128,256")
    ap.add_argument("--context-lens", default="64,256,1024,4096")
    ap.add_argument("--efficiency", type=float, default=None)
    ap.add_argument("--pass-overhead-us", type=float, default=None)
    bench.add_out(ap, None, required=True, help="the cost.json to write")
    args = ap.parse_args(argv)
    drafters = {}
    for item in args.draft:
        name, sep, model = item.partition("=")
        if not sep or model not in MODELS:
            ap.error(f"--draft {item!r}: write NAME=MODEL with MODEL one of {sorted(MODELS)}")
        drafters[name] = model
    free = {}
    if args.model_free_from:
        measured = CostModel.from_json(args.model_free_from)
        free = {n: c for n, c in measured.draft.items() if not measured.per_token_draft[n] and n not in drafters}
        if not free:
            ap.error(f"{args.model_free_from} has no model-free drafter (n-gram, suffix) to copy")
    overhead = None if args.pass_overhead_us is None else args.pass_overhead_us * 1e-6
    try:
        cost = roofline_cost_model(args.device, args.target, drafters=drafters, model_free=free, k_max=args.k_max,
                                   batch_sizes=bench.int_list(args.batch_sizes),
                                   context_lens=bench.int_list(args.context_lens), efficiency=args.efficiency,
                                   pass_overhead_s=overhead)
    except ValueError as e:
        raise SystemExit(f"roofline: {e}") from None
    cost.to_json(args.out)
    ks = [k for k in (0, 1, 2, 4, 8) if k <= args.k_max]
    ctx = cost.meta["context_lens"][len(cost.meta["context_lens"]) // 2]
    print(f"{cost.meta['device']['name']} ({cost.meta['device']['source']}), {cost.meta['target']} "
          f"({cost.meta['target_params'] / 1e9:.2f}B parameters); linear layers compute-bound from "
          f"{ridge_tokens(MODELS[args.target], DEVICES[args.device]):.0f} tokens per pass. Verify ms at context "
          f"{ctx} (computed, not measured):\n")
    print(bench.table(["batch", *(f"k={k}" for k in ks)],
                      [[b, *(f"{cost.verify_time(k, ctx, b) * 1e3:.2f}" for k in ks)] for b in cost.batch_sizes]))
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
