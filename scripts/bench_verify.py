"""What one target pass costs as a function of the tokens it reads: the verify cost curve behind every speculative
speedup. On a CPU, BLAS kernels for a few rows can cost far more than their share (e.g. 2 or 3 rows each read the
weights once per row), so a k-token draft may pay its verify pass dearly at some k and cheaply at others.

    python scripts/bench_verify.py                      # the embedded target, 1 and 2 threads
    python scripts/bench_verify.py --tokens 1,2,3,4,5,8,16 --threads 2 --context 200

For each thread count: median seconds of a cached forward of n tokens after a ``--context``-token prefix (logits at
every position, as verification needs), and its ratio to n = 1; and the same for one MLP up-projection alone
(``linear``, microseconds), which isolates the matrix kernel. Prints a Markdown table and writes bench_verify.json.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from sacpolicy.io import write_json
from sacpolicy.models import EMBEDDED_TARGET, load_model


@torch.inference_mode()
def forward_s(model, ids: torch.Tensor, context: int, n: int, repeats: int) -> float:
    from transformers import DynamicCache

    times = []
    for _ in range(repeats):
        cache = DynamicCache(config=model.config)
        model(input_ids=ids[:, :context], past_key_values=cache, use_cache=True, logits_to_keep=1)
        t0 = time.perf_counter()
        model(input_ids=ids[:, context : context + n], past_key_values=cache, use_cache=True, logits_to_keep=n)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


@torch.inference_mode()
def linear_us(weight: torch.Tensor, n: int, repeats: int = 300) -> float:
    x = torch.randn(n, weight.shape[1], dtype=weight.dtype)
    for _ in range(10):
        torch.nn.functional.linear(x, weight)
    t0 = time.perf_counter()
    for _ in range(repeats):
        torch.nn.functional.linear(x, weight)
    return (time.perf_counter() - t0) / repeats * 1e6


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=EMBEDDED_TARGET)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--tokens", default="1,2,3,4,5,6,8,16")
    ap.add_argument("--threads", default="2,1")
    ap.add_argument("--context", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--out", default="bench_verify.json")
    args = ap.parse_args(argv)
    tokens = [int(n) for n in args.tokens.split(",")]
    lm = load_model(args.target, device="cpu", dtype=args.dtype)
    model = lm.model.eval()
    ids = torch.randint(100, 5000, (1, args.context + max(tokens)), generator=torch.Generator().manual_seed(0))
    weight = model.model.layers[0].mlp.up_proj.weight.detach()
    rows = []
    for threads in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(threads)
        fwd = {n: forward_s(model, ids, args.context, n, args.repeats) for n in tokens}
        lin = {n: linear_us(weight, n) for n in tokens}
        for n in tokens:
            rows.append({"threads": threads, "tokens": n, "forward_ms": fwd[n] * 1e3, "forward_vs_1": fwd[n] / fwd[1],
                         "linear_us": lin[n], "linear_vs_1": lin[n] / lin[1]})
    meta = {"target": args.target, "dtype": args.dtype, "context": args.context, "repeats": args.repeats,
            "linear": f"mlp.up_proj {tuple(weight.shape)}", "torch": torch.__version__}
    write_json(args.out, {"rows": rows, "meta": meta})
    lines = [f"{args.target}, {args.dtype}, after {args.context} tokens of context; median of {args.repeats}", "",
             "| threads | tokens per pass | forward ms | vs 1 token | linear us | vs 1 row |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['threads']} | {r['tokens']} | {r['forward_ms']:.1f} | {r['forward_vs_1']:.2f}x | "
              f"{r['linear_us']:.0f} | {r['linear_vs_1']:.2f}x |" for r in rows]
    print("\n".join(lines))
    return {"rows": rows, "meta": meta}


if __name__ == "__main__":
    main()
