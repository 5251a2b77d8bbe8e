"""Decoder benchmark: our AR and speculative decoding vs transformers' generate and assisted generation.

    python scripts/bench_decoder.py                          # all 80 MT-Bench first turns, 128 new tokens
    python scripts/bench_decoder.py --prompts 4 --ks 1,2,4   # a quick subset
    python scripts/bench_decoder.py --device cuda --dtype bfloat16
    python scripts/bench_decoder.py --source revision --drafters ngram,suffix --only ngram-static,suffix-static

Greedy decoding of MT-Bench first turns (``--source``: another prompt set's held-out test split, e.g. revision,
humaneval_edit) with the embedded target. Rows are measured side by side: for every prompt,
every row runs once (so machine noise hits all rows alike), after warm-up prompts that are not counted. Every row's
output is checked to be the target's own greedy output. Prints a Markdown table and writes bench_decoder.json.

``--trace-cost``: what the traces the pipeline learns from cost against decoding live. After the rows, the target's
own greedy decode of each measured prompt (its kept logits give p, so the target never runs a second time) and the
teacher-forced pass of every one of our drafters over it (``traces.collect.teacher_forced_rows``, the collect
stage's pass), timed per generated position next to our speculative rows' seconds per position. Simulated against
measured tokens/s of the same policies is the evaluate stage's (``eval.json``: live and simulated rows).

Drafts: ``layerskip`` = the target's first L layers sharing its weights; ``model`` = a separate draft model, the one
both we and transformers' assisted generation use: ``--draft DIR`` (e.g. a distilled draft; we draft with its
trimmed vocabulary when it has one, transformers with its full head) or, without it, a copy of the target's first L
layers; ``ngram`` = prompt lookup (max n-gram 2, transformers' default); ``suffix`` = SuffixDecoding (the
request's tokens and a global index over the requests decoded before it in the same row, as a server's
proposer accumulates it; no transformers counterpart); ``feature`` (with ``--head DIR``) = an
EAGLE-3 head over the target's hidden states (no transformers counterpart).
"""

from __future__ import annotations

import copy
import os
import resource
import sys
import threading
import time
from dataclasses import dataclass, field

import torch

from sacpolicy import bench
from sacpolicy.build import model_drafter
from sacpolicy.data import load_prompts
from sacpolicy.decoding import (
    LayerSkipDrafter,
    ModelDrafter,
    NgramDrafter,
    SpeculativeDecoder,
)
from sacpolicy.decoding.drafters import truncated_view
from sacpolicy.decoding.suffix import SuffixDrafter
from sacpolicy.models import load_model
from sacpolicy.policy import Autoregressive, Confidence, Heuristic, Static


class PeakRSS:
    """Peak resident memory while a block runs (sampled from /proc; falls back to the process-wide maximum)."""

    def __enter__(self):
        self.peak, self._stop = self._rss(), threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def _poll(self):
        while not self._stop.wait(0.01):
            self.peak = max(self.peak, self._rss())

    @staticmethod
    def _rss() -> int:
        try:
            with open("/proc/self/status") as f:
                return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS"))
        except OSError:
            return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


@dataclass
class Row:
    name: str
    run: callable  # (input_ids, max_new_tokens) -> (tokens, stats dict or None)
    tokens: int = 0
    seconds: float = 0.0
    target_calls: int = 0
    drafted: int = 0
    accepted: int = 0
    draft_s: float = 0.0
    verify_s: float = 0.0
    peak_rss: int = 0
    mismatches: list = field(default_factory=list)

    def result(self, ar_tps: float) -> dict:
        tps = self.tokens / self.seconds if self.seconds else 0.0
        spent = self.draft_s + self.verify_s
        return {
            "name": self.name,
            "tokens_per_s": tps,
            "speedup_vs_ar": tps / ar_tps if ar_tps else None,
            "tokens_per_call": self.tokens / self.target_calls if self.target_calls else None,
            "acceptance_rate": self.accepted / self.drafted if self.drafted else None,
            "draft_share": self.draft_s / spent if spent else None,
            "verify_share": self.verify_s / spent if spent else None,
            "peak_rss_mb": self.peak_rss / 2**20,
            "tokens": self.tokens,
            "seconds": self.seconds,
            "lossless": not self.mismatches,
        }


class CallCounter:
    """Counts target forward passes (prefill + one per verification) for any decoder, ours or transformers'."""

    def __init__(self, model):
        self.calls = 0
        model.register_forward_pre_hook(self._hook)

    def _hook(self, *args):
        self.calls += 1


def ours(target, drafters, policy, eos):
    dec = SpeculativeDecoder(target, drafters, policy, stop_token_ids=eos)

    def run(ids, n):
        res = dec.generate(ids, n)
        return res.tokens, {
            "drafted": sum(s.drafted for s in res.steps), "accepted": sum(s.accepted for s in res.steps),
            "draft_s": res.draft_s, "verify_s": res.verify_s, "dropped_drafters": res.dropped_drafters,
        }

    return run


def hf(target, eos, assistant=None, **gen_kwargs):
    def run(ids, n):
        x = torch.tensor([ids], device=target.device)
        out = target.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False,
                              eos_token_id=eos, pad_token_id=eos[0], assistant_model=assistant, **gen_kwargs)
        return out[0, x.shape[1]:].tolist(), None

    return run


def hf_assistant(draft, k, schedule="constant", threshold=0.0):
    """transformers reads assisted-generation settings from the assistant's generation_config."""
    a = copy.copy(draft)
    a.generation_config = copy.deepcopy(draft.generation_config)
    a.generation_config.num_assistant_tokens = k
    a.generation_config.num_assistant_tokens_schedule = schedule
    a.generation_config.assistant_confidence_threshold = threshold
    return a


def tune_threshold(target, drafter, k, prompts, eos, n, grid=(0.1, 0.2, 0.3, 0.5, 0.6, 0.7, 0.8, 0.9)):
    """The confidence threshold with the best tokens/s on the warm-up prompts (not the measured ones)."""
    best = (0.0, None)
    for t in grid:
        run = ours(target, [drafter], Confidence(t, k=k), eos)
        t0 = time.perf_counter()
        toks = sum(len(run(ids, n)[0]) for ids in prompts)
        best = max(best, (toks / (time.perf_counter() - t0), t))
    return best[1]


def build_rows(args, lm, eos, warm):
    target = lm.model
    if args.draft:
        ours_draft = model_drafter(lm, args.draft, name="model")
        model_draft = load_model(args.draft, device=target.device, dtype=next(target.parameters()).dtype).model
    else:
        model_draft = copy.deepcopy(truncated_view(target, args.layers))  # its own copy of the first L layers
        ours_draft = ModelDrafter(model_draft, name="model")
    model_draft.generation_config = copy.deepcopy(target.generation_config)
    drafters = {
        "layerskip": lambda: LayerSkipDrafter(target, args.layers, name="layerskip"),
        "model": lambda: ours_draft,
        "ngram": lambda: NgramDrafter(max_ngram=2, name="ngram"),
        "suffix": lambda: SuffixDrafter(name="suffix"),
    }
    if args.head:  # an EAGLE-3 feature head over the target's hidden states
        from sacpolicy.decoding.feature import load_feature_drafter

        head = load_feature_drafter(lm, args.head, name="feature")
        drafters["feature"] = lambda: head
        args.drafters = args.drafters + ["feature"]
    if args.draft:  # the same draft with its full-vocabulary head, as transformers runs it
        full = model_drafter(lm, args.draft, name="modelfull", trim=False)
        drafters["modelfull"] = lambda: full
        args.drafters = args.drafters + ["modelfull"]
    rows = [Row("ar", ours(target, [], Autoregressive(), eos)), Row("hf-ar", hf(target, eos))]
    tuned = {}
    for d in args.drafters:
        for k in args.ks:
            rows.append(Row(f"{d}-static-k{k}", ours(target, [drafters[d]()], Static(k), eos)))
        rows.append(Row(f"{d}-heuristic", ours(target, [drafters[d]()], Heuristic(k0=args.k0), eos)))
        if d not in ("ngram", "suffix"):  # lookup proposals carry no draft confidence
            rows.append(Row(f"{d}-confidence-0.4", ours(target, [drafters[d]()], Confidence(0.4, k=args.kmax), eos)))
            tuned[d] = tune_threshold(target, drafters[d](), args.kmax, warm, eos, 32)
            rows.append(Row(f"{d}-confidence-tuned-{tuned[d]:g}",
                            ours(target, [drafters[d]()], Confidence(tuned[d], k=args.kmax), eos)))
    if "model" in args.drafters:
        for k in args.ks:
            rows.append(Row(f"hf-assisted-model-k{k}", hf(target, eos, hf_assistant(model_draft, k))))
        rows.append(Row("hf-assisted-model-heuristic",
                        hf(target, eos, hf_assistant(model_draft, args.k0, "heuristic_transient"))))
        rows.append(Row("hf-assisted-model-confidence-0.4",
                        hf(target, eos, hf_assistant(model_draft, args.kmax, threshold=0.4))))
    if "ngram" in args.drafters:
        for k in args.ks:
            rows.append(Row(f"hf-prompt-lookup-k{k}", hf(target, eos, prompt_lookup_num_tokens=k)))
    return rows, tuned, [drafters[d]() for d in args.drafters]


def speculative_rows(rows: list[Row], drafters: list) -> list[Row]:
    """Our rows that draft with one of ``drafters`` (named ``<drafter>-...``)."""
    return [r for r in rows if r.name.startswith(tuple(f"{d.name}-" for d in drafters))]


def trace_cost(lm, drafters: list, prompts: list, n_new: int, rows: list[Row]) -> dict:
    """Seconds per generated position of the target's own greedy decode (logits kept), of the teacher-forced pass of
    ``drafters`` over it, and of our speculative rows decoding live (every row of a drafter in ``drafters``)."""
    from sacpolicy.traces.collect import teacher_forced_rows

    ar = SpeculativeDecoder(lm.model, [], Autoregressive(), stop_token_ids=lm.eos_token_ids)
    gen_s = tf_s = 0.0
    positions = 0
    for i, ids in enumerate(prompts):
        res = ar.generate(ids, n_new, keep_logits=True)
        gen_s, positions = gen_s + res.total_s, positions + len(res.tokens)
        prompt = {"prompt_id": str(i), "category": "", "input_ids": ids}
        t0 = time.perf_counter()
        teacher_forced_rows(lm, drafters, prompt, res.tokens, k_max=16, target_logits=res.logits)
        tf_s += time.perf_counter() - t0
    live = speculative_rows(rows, drafters)
    live_per_pos = sum(r.seconds for r in live) / sum(r.tokens for r in live)
    return {"drafters": [d.name for d in drafters], "positions": positions, "live_s_per_position": live_per_pos,
            "teacher_forced_s_per_position": tf_s / positions, "target_decode_s_per_position": gen_s / positions,
            "teacher_forced_speedup": live_per_pos / (tf_s / positions)}


def main(argv=None) -> dict:
    ap = bench.parser(__doc__)
    bench.add_target(ap, device="cpu", dtype="auto")
    ap.add_argument("--prompts", type=int, default=80, help="MT-Bench first turns to measure (after warm-up)")
    ap.add_argument("--source", default="mt_bench", help="prompt set (other than mt_bench: its held-out test split)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--ks", default="1,2,3,4,6,8")
    ap.add_argument("--k0", type=int, default=5, help="starting k of the heuristic schedule")
    ap.add_argument("--kmax", type=int, default=8, help="k cap of the confidence rows")
    ap.add_argument("--layers", type=int, default=4, help="layers of the layer-skip / first-layers draft")
    ap.add_argument("--drafters", default="layerskip,model,ngram")
    ap.add_argument("--draft", default=None, help="a draft model directory (e.g. a distilled draft) for the model rows")
    ap.add_argument("--head", default=None, help="an EAGLE-3 head directory (e.g. <run>/head/head): feature rows")
    ap.add_argument("--only", default="", help="comma-separated row-name prefixes to keep (ar rows always run)")
    ap.add_argument("--trace-cost", action="store_true",
                    help="also time the teacher-forced trace pass of our drafters against live decoding")
    bench.add_allow_dropped(ap)
    bench.add_out(ap, "bench_decoder.json")
    args = ap.parse_args(argv)
    args.ks = bench.int_list(args.ks)
    args.drafters = [d for d in args.drafters.split(",") if d]

    lm = bench.load_target(args.target, device=args.device, dtype=args.dtype)
    target, eos = lm.model, lm.eos_token_ids
    ds = (load_prompts("mt_bench", tokenizer=lm.tokenizer) if args.source == "mt_bench"
          else load_prompts(args.source, tokenizer=lm.tokenizer, split="test"))
    ids = [r["input_ids"] for r in ds]
    warm, measured = ids[: args.warmup], ids[args.warmup : args.warmup + args.prompts]

    rows, tuned, ours_drafters = build_rows(args, lm, eos, warm)
    counter = CallCounter(target)  # after the drafts exist: views of the target copy its hooks when made
    if args.only:
        keep = tuple(args.only.split(","))
        rows = [r for r in rows if r.name in ("ar", "hf-ar") or r.name.startswith(keep)]
    if args.trace_cost and not speculative_rows(rows, ours_drafters):
        raise SystemExit("bench_decoder: --trace-cost compares with our speculative rows, and --only keeps none")
    for r in rows:  # warm-up: lazy initialisation, allocator growth
        for x in warm:
            r.run(x, 16)
    for i, x in enumerate(measured):
        reference = None
        for r in rows:
            before = counter.calls
            with PeakRSS() as mem:
                t0 = time.perf_counter()
                toks, stats = r.run(x, args.max_new_tokens)
                dt = time.perf_counter() - t0
            r.tokens, r.seconds = r.tokens + len(toks), r.seconds + dt
            r.target_calls += counter.calls - before
            r.peak_rss = max(r.peak_rss, mem.peak)
            stats = dict(stats or {})
            bench.check_drafters_kept(r.name, [stats.pop("dropped_drafters", [])], requests=[i],
                                      allow=args.allow_dropped_drafters)
            for key, val in stats.items():
                setattr(r, key, getattr(r, key) + val)
            reference = toks if reference is None else reference
            if toks != reference:
                r.mismatches.append(i)
        print(f"prompt {i + 1}/{len(measured)} done", file=sys.stderr, flush=True)

    ar_tps = rows[0].tokens / rows[0].seconds
    results = [r.result(ar_tps) for r in rows]
    meta = {
        "target": args.target, "device": str(target.device), "dtype": str(next(target.parameters()).dtype),
        "source": args.source, "prompts": len(measured), "warmup_prompts": len(warm),
        "max_new_tokens": args.max_new_tokens,
        "layers": args.layers, "draft": args.draft or f"first {args.layers} target layers", "tuned_thresholds": tuned,
        "torch_threads": torch.get_num_threads(), "cpu_count": os.cpu_count(), "torch": torch.__version__,
    }
    meta["comparisons"] = comparisons(results)
    if args.trace_cost:
        meta["trace_cost"] = trace_cost(lm, ours_drafters, measured, args.max_new_tokens, rows)
    report = {"rows": results, "meta": meta}
    bench.write_results(args.out, report)
    print(markdown(results, meta))
    return report


def comparisons(rows) -> dict:
    """Ours / transformers' tokens/s for each pair of rows with the same draft and k (or schedule)."""
    tps = {r["name"]: r["tokens_per_s"] for r in rows}
    pairs = {"ar": "hf-ar", "model-heuristic": "hf-assisted-model-heuristic",
             "model-confidence-0.4": "hf-assisted-model-confidence-0.4"}
    for name in tps:
        if name.startswith(("model-static-k", "modelfull-static-k")):
            pairs[name] = "hf-assisted-model-k" + name.rsplit("k", 1)[1]
        if name.startswith("ngram-static-k"):
            pairs[name] = "hf-prompt-lookup-k" + name.rsplit("k", 1)[1]
    return {f"{a} / {b}": tps[a] / tps[b] for a, b in pairs.items() if a in tps and b in tps and tps[b]}


def markdown(rows, meta) -> str:
    def share(r):
        return "-" if r["draft_share"] is None else f"{r['draft_share']:.2f} / {r['verify_share']:.2f}"

    lines = [
        f"Greedy, {meta['target']} on {meta['device']} ({meta['dtype']}), {meta['prompts']} {meta['source']} "
        f"prompts x {meta['max_new_tokens']} new tokens", "",
        bench.table(["row", "tokens/s", "speedup vs our AR", "tokens per target call", "acceptance",
                     "draft / verify share", "peak RSS MB", "lossless"],
                    ([r["name"], f"{r['tokens_per_s']:.1f}", f"{bench.cell(r['speedup_vs_ar'])}x",
                      bench.cell(r["tokens_per_call"]), bench.cell(r["acceptance_rate"]), share(r),
                      f"{r['peak_rss_mb']:.0f}", "yes" if r["lossless"] else "NO"] for r in rows)), "",
        bench.table(["ours / transformers (same draft, same k)", "ratio"],
                    ([pair, bench.ratio(ratio)] for pair, ratio in meta["comparisons"].items())),
    ]
    tc = meta.get("trace_cost")
    if tc:
        lines += ["", f"Trace cost over {tc['positions']} positions: live decoding (our speculative rows) "
                  f"{tc['live_s_per_position'] * 1e3:.1f} ms/position; teacher-forced passes of "
                  f"{len(tc['drafters'])} drafters {tc['teacher_forced_s_per_position'] * 1e3:.2f} ms/position "
                  f"({tc['teacher_forced_speedup']:.0f}x fewer seconds); the target's own decode, shared by every "
                  f"drafter and policy: {tc['target_decode_s_per_position'] * 1e3:.1f} ms/position"]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
