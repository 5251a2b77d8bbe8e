"""What the EAGLE-3 head's drafting costs a row when R rows of a batch draft with it together
(``FeatureDrafter.propose_batch``), on the kernels the decoder runs it with (``use_cpu_kernels``).

    python scripts/bench_head.py                                  # the shipped head of the embedded target
    python scripts/bench_head.py --rows 1,2,4,8,16 --k 3 --pending 2 --context 300
    python scripts/bench_head.py --stop                           # rows read each drafted token's confidence

Each of R rows holds ``--context`` + 20 i committed tokens (the head fed their target features once, untimed); then,
``--steps`` times, as the decoder does between two proposals, every row accepts one drafted token, is handed
``--pending`` new feature rows (a verify pass's last token and accepted drafts) and drafts a block of ``--k`` tokens,
all R rows in one ``propose_batch`` call; with ``--stop`` every row has a stop callback that never ends its block, as
a policy asking for token feedback (the learned rule) has: the drafter then computes each drafted token's confidence
for it. The features are random (the cost depends on shapes, not values). Reports
the median milliseconds of a call and per row, and each size's per-row time as a fraction of one row's (what the
cost model's ``draft_batch`` share measures). Prints a Markdown table and writes bench_head.json.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from sacpolicy.decoding.compat import use_cpu_kernels
from sacpolicy.decoding.feature import load_feature_drafter
from sacpolicy.decoding.sampling import SamplingConfig
from sacpolicy.heads import shipped_head
from sacpolicy.io import write_json
from sacpolicy.models import EMBEDDED_TARGET, load_model


@torch.inference_mode()
def time_rows(proto, rows: int, args, gen: torch.Generator) -> list[float]:
    """Seconds of each timed ``propose_batch`` call over ``rows`` rows."""
    width = len(proto.aux_layers) * proto.head.config.hidden_size
    forks = [proto.fork() for _ in range(rows)]
    contexts = [torch.randint(100, proto.vocab_size, (args.context + 20 * i,), generator=gen) for i in range(rows)]
    for d, c in zip(forks, contexts):
        d.extend_features(torch.randn(c.numel() - 1, width, generator=gen))
    sampling = [SamplingConfig()] * rows
    stops = [(lambda position, stats: False) if args.stop else None] * rows

    def propose():
        return proto.propose_batch(forks, contexts, [args.k] * rows, sampling, [None] * rows, stops)

    propose()  # the prompts' feeds, untimed
    times = []
    for step in range(args.warmup + args.steps):
        for i, d in enumerate(forks):
            d.accept(1)
            d.extend_features(torch.randn(args.pending, width, generator=gen))
            contexts[i] = torch.cat([contexts[i], torch.randint(100, proto.vocab_size, (args.pending,), generator=gen)])
        t0 = time.perf_counter()
        propose()
        if step >= args.warmup:
            times.append(time.perf_counter() - t0)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,2,4,8,16", help="rows drafting together, comma-separated")
    ap.add_argument("--k", type=int, default=3, help="tokens drafted per row and call")
    ap.add_argument("--pending", type=int, default=2, help="feature rows handed to each row before each call")
    ap.add_argument("--context", type=int, default=300, help="committed tokens of the first row")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--stop", action="store_true", help="rows have a stop callback (never stopping): the confidence "
                    "a policy asking for token feedback reads is computed per drafted token")
    ap.add_argument("--out", default="bench_head.json")
    args = ap.parse_args()
    sizes = [int(r) for r in args.rows.split(",")]
    if not sizes or min(sizes) < 1 or args.k < 1 or args.pending < 1 or args.steps < 1:
        raise SystemExit("bench_head: --rows must be integers >= 1, and --k, --pending and --steps >= 1")
    torch.set_num_threads(args.threads)
    target = load_model(EMBEDDED_TARGET)
    proto = load_feature_drafter(target, shipped_head(EMBEDDED_TARGET))
    use_cpu_kernels(target.model, [proto])
    gen = torch.Generator().manual_seed(0)
    rows = []
    for r in sizes:
        call = statistics.median(time_rows(proto, r, args, gen))
        rows.append({"rows": r, "call_ms": 1e3 * call, "per_row_ms": 1e3 * call / r})
        print(f"  {r} rows: {1e3 * call:.2f} ms a call, {1e3 * call / r:.2f} ms a row", flush=True)
    one = next((x["per_row_ms"] for x in rows if x["rows"] == 1), None)
    lines = [f"{args.k} tokens a row after {args.pending} new feature rows, context {args.context}+, "
             f"{'with' if args.stop else 'without'} a stop callback, "
             f"{args.threads} threads, median of {args.steps} calls", "",
             "| rows | ms a call | ms a row | share of one row |", "|---|---|---|---|"]
    for x in rows:
        x["share"] = x["per_row_ms"] / one if one else None
        share = f"{x['share']:.2f}" if one else "-"
        lines.append(f"| {x['rows']} | {x['call_ms']:.2f} | {x['per_row_ms']:.2f} | {share} |")
    markdown = "\n".join(lines)
    print(markdown)
    write_json(args.out, {"args": vars(args), "rows": rows, "markdown": markdown})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
