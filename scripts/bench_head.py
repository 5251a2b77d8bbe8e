"""What the EAGLE-3 head's drafting costs a row when R rows of a batch draft with it together
(one ``FeatureDrafter.propose`` call), on the kernels the decoder runs it with (``cpu_kernels``).

    python scripts/bench_head.py                                  # the shipped head of the embedded target
    python scripts/bench_head.py --rows 1,2,4,8,16 --k 3 --pending 2 --context 300
    python scripts/bench_head.py --stop                           # rows read each drafted token's confidence

Each of R rows holds ``--context`` + 20 i committed tokens (the head fed their target features once, untimed); then,
``--steps`` times, as the decoder does between two proposals, every row accepts one drafted token, is handed
``--pending`` new feature rows (a verify pass's last token and accepted drafts) and drafts a block of ``--k`` tokens,
all R rows in one ``propose`` call; with ``--stop`` every row has a stop callback that never ends its block, as
a policy asking for token feedback (the learned rule) has: the drafter then computes each drafted token's confidence
for it. The features are random (the cost depends on shapes, not values). Reports
the median milliseconds of a call and per row, and each size's per-row time as a fraction of one row's (what the
cost model's ``draft_batch`` share measures). Prints a Markdown table and writes bench_head.json.
"""

from __future__ import annotations

import statistics
import time

import torch

from sacpolicy import bench
from sacpolicy.decoding.compat import cpu_kernels
from sacpolicy.decoding.feature import load_feature_drafter
from sacpolicy.decoding.sampling import SamplingConfig
from sacpolicy.decoding.types import DraftRow
from sacpolicy.heads import shipped_head
from sacpolicy.models import EMBEDDED_TARGET


@torch.inference_mode()
def time_rows(proto, rows: int, args, gen: torch.Generator) -> list[float]:
    """Seconds of each timed ``propose`` call over ``rows`` rows."""
    width = len(proto.aux_layers) * proto.head.config.hidden_size
    states = [proto.new_state() for _ in range(rows)]
    contexts = [torch.randint(100, proto.vocab_size, (args.context + 20 * i,), generator=gen) for i in range(rows)]
    for st, c in zip(states, contexts):
        proto.extend_features(st, torch.randn(c.numel() - 1, width, generator=gen))
    stop = (lambda position, stats: False) if args.stop else None

    def propose():
        return proto.propose([DraftRow(st, c, args.k, SamplingConfig(), None, stop) for st, c in zip(states, contexts)])

    propose()  # the prompts' feeds, untimed
    times = []
    for step in range(args.warmup + args.steps):
        for i, st in enumerate(states):
            proto.accept(st, 1)
            proto.extend_features(st, torch.randn(args.pending, width, generator=gen))
            contexts[i] = torch.cat([contexts[i], torch.randint(100, proto.vocab_size, (args.pending,), generator=gen)])
        t0 = time.perf_counter()
        propose()
        if step >= args.warmup:
            times.append(time.perf_counter() - t0)
    return times


def main(argv=None) -> None:
    ap = bench.parser(__doc__)
    ap.add_argument("--rows", default="1,2,4,8,16", help="rows drafting together, comma-separated")
    ap.add_argument("--k", type=int, default=3, help="tokens drafted per row and call")
    ap.add_argument("--pending", type=int, default=2, help="feature rows handed to each row before each call")
    ap.add_argument("--context", type=int, default=300, help="committed tokens of the first row")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--stop", action="store_true", help="rows have a stop callback (never stopping): the confidence "
                    "a policy asking for token feedback reads is computed per drafted token")
    bench.add_out(ap, "bench_head.json")
    args = ap.parse_args(argv)
    sizes = bench.int_list(args.rows)
    if not sizes or min(sizes) < 1 or args.k < 1 or args.pending < 1 or args.steps < 1:
        raise SystemExit("bench_head: --rows must be integers >= 1, and --k, --pending and --steps >= 1")
    torch.set_num_threads(args.threads)
    target = bench.load_target(device="auto", dtype="auto")
    proto = load_feature_drafter(target, shipped_head(EMBEDDED_TARGET))
    gen = torch.Generator().manual_seed(0)
    rows = []
    with cpu_kernels(target.model, [proto]):
        for r in sizes:
            call = statistics.median(time_rows(proto, r, args, gen))
            rows.append({"rows": r, "call_ms": 1e3 * call, "per_row_ms": 1e3 * call / r})
            print(f"  {r} rows: {1e3 * call:.2f} ms a call, {1e3 * call / r:.2f} ms a row", flush=True)
    one = next((x["per_row_ms"] for x in rows if x["rows"] == 1), None)
    for x in rows:
        x["share"] = x["per_row_ms"] / one if one else None
    markdown = (f"{args.k} tokens a row after {args.pending} new feature rows, context {args.context}+, "
                f"{'with' if args.stop else 'without'} a stop callback, "
                f"{args.threads} threads, median of {args.steps} calls\n\n"
                + bench.table(["rows", "ms a call", "ms a row", "share of one row"],
                              ([x["rows"], f"{x['call_ms']:.2f}", f"{x['per_row_ms']:.2f}", bench.cell(x["share"])]
                               for x in rows)))
    print(markdown)
    bench.write_results(args.out, {"rows": rows, "markdown": markdown}, args)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
