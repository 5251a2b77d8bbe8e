"""What one target pass costs as a function of the tokens it reads: the verify cost curve behind every speculative
speedup, on torch's own CPU kernels and on the ones the decoder runs a CPU target on (``cpu_kernels``). torch's
CPU ``linear`` runs one row as a matrix-vector product and 2 or 3 rows as one each (reading the weights once per row);
``CpuLinear`` computes up to 4 rows as one matrix product with the weight on the left and more through oneDNN
(``sacpolicy-mkl``: the same without oneDNN, MKL's weight-on-left product up to 256 rows, as before oneDNN).

    python scripts/bench_verify.py                      # the embedded target, 2 and 1 threads
    python scripts/bench_verify.py --tokens 1,2,3,4,5,8,16 --threads 2 --context 200

For each thread count and kernel: median seconds of a cached forward of n tokens after a ``--context``-token prefix
(logits at every position, as verification needs; the two kernels alternate call by call, so a drifting machine moves
both alike), its ratio to n = 1 and the speedup of ours over torch's; and the same for one MLP up-projection alone
(``linear``, microseconds), which isolates the matrix kernel. Then (``--rows``, at the first thread count) an
autoregressive step of R rows on the ragged cache the batched decoder keeps (rows of ``--context`` - 7 i tokens),
with transformers' ``DynamicCache`` (a copy of every layer per forward) and the decoder's ``new_cache`` (in place once
it holds several rows), alternating repeat by repeat: median milliseconds per step. Then (``--top-p``) what a
sampled block's probabilities cost beyond the pass: ``probs_from_logits`` at temperature 0.7 and each top-p over
blocks of 5 positions (a block of k = 4 drafted tokens) of the target's real logits over MT-Bench prompts, ranking
only the head of the vocabulary (``top_p_filter``) against a full sort (``head=0``: what it did before), and the share
of positions whose head holds top-p (a block with one that does not falls back to the full sort). Prints Markdown
tables and writes bench_verify.json.
"""

from __future__ import annotations

import statistics
import time

import torch

from sacpolicy import bench
from sacpolicy.decoding.compat import CpuLinear, use_masked_gqa, with_cache
from sacpolicy.decoding.ragged import new_cache
from sacpolicy.decoding.sampling import TOP_P_HEAD, SamplingConfig, probs_from_logits, top_p_filter
from sacpolicy.profiling import prefilled_batch


class CpuLinearMkl(CpuLinear):
    """``CpuLinear`` without oneDNN: MKL's paths at every size."""

    onednn = None


KERNELS = {"torch": torch.nn.Linear, "sacpolicy-mkl": CpuLinearMkl, "sacpolicy": CpuLinear}


def use(linears: list, kernel: str) -> None:
    for m in linears:
        m.__class__ = KERNELS[kernel]


@torch.inference_mode()
def forward_s(model, linears, ids: torch.Tensor, context: int, n: int, repeats: int) -> dict:
    """{kernel: median seconds of a forward of n tokens on a cache of ``context``}, kernels alternating."""
    times = {k: [] for k in KERNELS}
    for _ in range(repeats):
        for kernel in KERNELS:
            use(linears, kernel)
            cache = new_cache(model.config)  # the decoder's cache (appends in place)
            model(input_ids=ids[:, :context], **with_cache(model, cache), use_cache=True, logits_to_keep=1)
            t0 = time.perf_counter()
            model(input_ids=ids[:, context : context + n], **with_cache(model, cache), use_cache=True,
                  logits_to_keep=n)
            times[kernel].append(time.perf_counter() - t0)
    return {k: statistics.median(t) for k, t in times.items()}


@torch.inference_mode()
def linear_us(layer, n: int, repeats: int = 300) -> dict:
    x = torch.randn(n, layer.in_features, dtype=layer.weight.dtype)
    out = {}
    for kernel in KERNELS:
        use([layer], kernel)
        for _ in range(10):
            layer(x)
        t0 = time.perf_counter()
        for _ in range(repeats):
            layer(x)
        out[kernel] = (time.perf_counter() - t0) / repeats * 1e6
    return out


@torch.inference_mode()
def cache_step_ms(model, rows: int, context: int, steps: int, repeats: int) -> dict:
    """{cache: median ms of an AR step of ``rows`` ragged rows}, transformers' cache and ours alternating."""
    from transformers import DynamicCache

    makers = {"dynamic": lambda: DynamicCache(config=model.config), "in_place": lambda: new_cache(model.config)}
    times = {k: [] for k in makers}
    g = torch.Generator().manual_seed(1)
    lengths = [max(1, context - 7 * i) for i in range(rows)]
    dtype = next(model.parameters()).dtype
    for _, name in bench.alternating(list(makers), repeats):
        batch = prefilled_batch(model, lengths, torch.device("cpu"), g, makers[name])
        for _ in range(steps):
            x = torch.randint(100, 5000, (rows, 1), generator=g)
            t0 = time.perf_counter()
            model(input_ids=x, **with_cache(model, batch.cache), use_cache=True, logits_to_keep=1,
                  **batch.inputs(1, dtype))
            batch.commit([1] * rows, 1)
            times[name].append(time.perf_counter() - t0)
    return {k: statistics.median(t) * 1e3 for k, t in times.items()}


def main(argv=None) -> dict:
    ap = bench.parser(__doc__)
    bench.add_target(ap, dtype="float32")
    ap.add_argument("--tokens", default="1,2,3,4,5,6,8,16,32,64")
    ap.add_argument("--threads", default="2,1")
    ap.add_argument("--context", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--rows", default="1,8,16", help="rows of the batched AR step timed on both caches (empty: none)")
    ap.add_argument("--steps", type=int, default=16, help="AR steps per row count, cache and repeat")
    ap.add_argument("--top-p", default="0.9,0.95", help="top-p values of the sampled-block table (empty: none)")
    bench.add_out(ap, "bench_verify.json")
    args = ap.parse_args(argv)
    tokens = bench.int_list(args.tokens)
    lm = bench.load_target(args.target, dtype=args.dtype)
    model = lm.model.eval()
    use_masked_gqa(model)  # the decoder's attention for both kernels: the table isolates the linears
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    ids = torch.randint(100, 5000, (1, args.context + max(tokens)), generator=torch.Generator().manual_seed(0))
    layer = model.model.layers[0].mlp.up_proj
    rows = []
    for threads in bench.int_list(args.threads):
        torch.set_num_threads(threads)
        fwd = {n: forward_s(model, linears, ids, args.context, n, args.repeats) for n in tokens}
        lin = {n: linear_us(layer, n) for n in tokens}
        for n in tokens:
            row = {"threads": threads, "tokens": n}
            for k in KERNELS:
                row |= {f"{k}_forward_ms": fwd[n][k] * 1e3, f"{k}_forward_vs_1": fwd[n][k] / fwd[1][k],
                        f"{k}_linear_us": lin[n][k]}
            row["speedup"] = fwd[n]["torch"] / fwd[n]["sacpolicy"]
            row["onednn_speedup"] = fwd[n]["sacpolicy-mkl"] / fwd[n]["sacpolicy"]
            rows.append(row)
    use(linears, "sacpolicy")
    torch.set_num_threads(bench.int_list(args.threads)[0])
    caches = []
    for n in bench.int_list(args.rows):
        ms = cache_step_ms(model, n, args.context, args.steps, max(2, args.repeats // 3))
        caches.append({"rows": n, "dynamic_ms": ms["dynamic"], "in_place_ms": ms["in_place"],
                       "speedup": ms["dynamic"] / ms["in_place"]})
    top_p = [top_p_row(model, lm.tokenizer, float(t), args.repeats) for t in args.top_p.split(",") if t]
    meta = {"target": args.target, "dtype": args.dtype, "context": args.context, "repeats": args.repeats,
            "linear": f"mlp.up_proj {tuple(layer.weight.shape)}", "torch": torch.__version__}
    bench.write_results(args.out, {"rows": rows, "caches": caches, "top_p": top_p, "meta": meta})
    print(markdown(rows, caches, args, top_p))
    return {"rows": rows, "caches": caches, "top_p": top_p, "meta": meta}


@torch.inference_mode()
def top_p_row(model, tokenizer, top_p: float, repeats: int, temperature: float = 0.7, block: int = 5) -> dict:
    """Median ms of ``probs_from_logits`` over blocks of ``block`` positions of real logits (8 MT-Bench test prompts,
    every position) and of the same with a full sort (``top_p_filter(..., head=0)``), alternating block by block;
    and the share of positions whose ``TOP_P_HEAD`` most likely tokens hold ``top_p`` of the mass."""
    prompts = bench.held_out_prompts("mt_bench", tokenizer, n=8)
    logits = torch.cat([model(input_ids=torch.tensor([r["input_ids"]])).logits[0] for r in prompts]).float()
    blocks = [logits[i : i + block] for i in range(0, len(logits) - block + 1, block)]
    cfg = SamplingConfig(temperature=temperature, top_p=top_p)
    runs = {"partial": lambda b: probs_from_logits(b, cfg),
            "full": lambda b: top_p_filter(torch.softmax(b / temperature, -1), top_p, head=0)}
    times = {name: [] for name in runs}
    for _ in range(max(1, repeats // 3)):
        for b in blocks:
            for name, fn in runs.items():
                t0 = time.perf_counter()
                fn(b)
                times[name].append(time.perf_counter() - t0)
    probs = torch.softmax(logits / temperature, -1)
    head = float((probs.topk(TOP_P_HEAD, -1).values.sum(-1) >= top_p).float().mean())
    partial, full = statistics.median(times["partial"]) * 1e3, statistics.median(times["full"]) * 1e3
    return {"top_p": top_p, "temperature": temperature, "block": block, "positions": len(logits),
            "partial_ms": partial, "full_sort_ms": full, "speedup": full / partial, "head_share": head}


def markdown(rows: list[dict], caches: list[dict], args, top_p=()) -> str:
    def forward(r, kernel):
        return f"{r[f'{kernel}_forward_ms']:.1f} ({r[f'{kernel}_forward_vs_1']:.2f}x)"

    md = (f"{args.target}, {args.dtype}, after {args.context} tokens of context; median of {args.repeats}\n\n"
          + bench.table(["threads", "tokens per pass", "torch: forward ms (vs 1 token)", "sacpolicy without oneDNN",
                         "sacpolicy: forward ms (vs 1 token)", "speedup over torch", "oneDNN's gain",
                         "linear us: torch / without oneDNN / sacpolicy"],
                        ([r["threads"], r["tokens"], forward(r, "torch"), forward(r, "sacpolicy-mkl"),
                          forward(r, "sacpolicy"), bench.ratio(r["speedup"]), bench.ratio(r["onednn_speedup"]),
                          f"{r['torch_linear_us']:.0f} / {r['sacpolicy-mkl_linear_us']:.0f} / "
                          f"{r['sacpolicy_linear_us']:.0f}"] for r in rows)))
    if caches:
        md += (f"\n\nAR step of R rows after ~{args.context} cached tokens (sacpolicy's linears), median ms\n\n"
               + bench.table(["rows", "DynamicCache", "new_cache (in place)", "speedup"],
                             ([c["rows"], f"{c['dynamic_ms']:.1f}", f"{c['in_place_ms']:.1f}",
                               bench.ratio(c["speedup"])] for c in caches)))
    if top_p:
        md += ("\n\nA sampled block's probabilities (5 positions, temperature 0.7), median ms\n\n"
               + bench.table(["top-p", "positions", "head holds top-p", "head only", "full sort", "speedup"],
                             ([t["top_p"], t["positions"], f"{t['head_share']:.0%}", f"{t['partial_ms']:.2f}",
                               f"{t['full_sort_ms']:.2f}", bench.ratio(t["speedup"])] for t in top_p)))
    return md


if __name__ == "__main__":
    main()
