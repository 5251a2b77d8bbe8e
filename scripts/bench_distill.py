"""Distillation benchmark: undistilled vs FKL / RKL / JSD / TVD drafts trained with the same budget.

    python scripts/bench_distill.py                                  # 3 min per loss, 2-layer drafts, 8k vocab
    python scripts/bench_distill.py --budget-minutes 10 --losses fkl --curve 2,5,10
    python scripts/bench_distill.py --reuse fkl=outputs/.../distill   # evaluate drafts trained elsewhere

For each draft, on held-out MT-Bench first turns (the test split, never trained or early-stopped on):
- greedy match rate: the draft's argmax equals the target's greedy token, teacher-forced on the target's output;
- mean beta at temperature 1: sum_x min(p, q) with the full target distribution (expected acceptance per token);
- draft cost: one cached draft step / one cached target step, timed side by side;
- live speedup: our decoder with the draft at the best static k vs autoregressive decoding, same prompts.
``--curve`` snapshots the first loss's draft at those minutes of training: what a longer budget buys.
Prints a Markdown table and writes bench_distill.json. Training data is generated once and cached.
"""

from __future__ import annotations

import copy
import functools
import json
import statistics
import tempfile
import time
from pathlib import Path

import lightning as L
import torch

from sacpolicy import bench
from sacpolicy.build import model_drafter
from sacpolicy.data import load_prompt_mix, split_prompts
from sacpolicy.decoding import ModelDrafter
from sacpolicy.training.distill import DistillSettings, train_draft
from sacpolicy.training.distill_data import (
    DistillDataModule,
    generate_continuations,
    token_counts,
)
from sacpolicy.training.drafts import build_draft


class Snapshots(L.Callback):
    """Copies of the draft's trainable weights after the given minutes of training."""

    def __init__(self, minutes):
        self.marks, self.saved, self.t0 = sorted(minutes), {}, None

    def on_train_start(self, trainer, module):
        self.t0 = time.perf_counter()

    def on_train_batch_end(self, trainer, module, *args):
        elapsed = (time.perf_counter() - self.t0) / 60
        for m in self.marks:
            if m not in self.saved and elapsed >= m:
                self.saved[m] = {k: v.detach().clone() for k, v in module.draft.state_dict().items()}


def match_and_beta(target, drafter: ModelDrafter, seqs) -> tuple[float, float]:
    """Teacher-forced over the target's greedy outputs (the trace collector's own pass): greedy match rate and mean
    beta at temperature 1."""
    rows = bench.teacher_forced(target, [drafter], seqs, k_max=1)
    return sum(r["match"] for r in rows) / len(rows), sum(r["beta"] for r in rows) / len(rows)


@torch.inference_mode()
def step_cost(target, drafter: ModelDrafter, context, reps: int = 30) -> float:
    """Median time of one cached draft step over one cached target step, measured alternately."""
    d, t = [], []
    for _ in range(reps):
        d.append(bench.cached_step_s(drafter.model, context))
        t.append(bench.cached_step_s(target.model, context))
    return statistics.median(d) / statistics.median(t)


def evaluate(name, target, drafter, test_seqs, test_prompts, args) -> dict:
    match, beta = match_and_beta(target, drafter, test_seqs)
    ctx = torch.tensor([test_seqs[0]["input_ids"]], device=target.device)
    row = {"name": name, "match_rate": match, "mean_beta_t1": beta, "draft_cost": step_cost(target, drafter, ctx)}
    if not args.no_live:
        row.update(bench.live_static_k(target, drafter, test_prompts, args.ks, args.max_new_tokens,
                                       allow_dropped=args.allow_dropped_drafters))
    print(json.dumps(row), flush=True)
    return row


def main(argv=None):
    ap = bench.parser(__doc__)
    bench.add_target(ap)
    ap.add_argument("--losses", default="fkl,rkl,jsd,tvd")
    ap.add_argument("--budget-minutes", type=float, default=3.0)
    ap.add_argument("--curve", default="", help="minutes at which to snapshot the first loss's draft, e.g. 2,5,10")
    ap.add_argument("--num-layers", type=int, default=2)
    ap.add_argument("--vocab-size", type=int, default=8192)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--ks", default="2,3,4,6")
    ap.add_argument("--live-prompts", type=int, default=5)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--no-live", action="store_true")
    ap.add_argument("--reuse", action="append", default=[], help="NAME=DIR: evaluate an already distilled draft")
    ap.add_argument("--workdir", default=None)
    bench.add_allow_dropped(ap)
    bench.add_out(ap, "bench_distill.json")
    args = ap.parse_args(argv)
    args.ks = bench.int_list(args.ks)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="bench_distill-"))

    target = bench.load_target(args.target)
    settings = DistillSettings(num_layers=args.num_layers, vocab_size=args.vocab_size, lr=args.lr,
                               budget_minutes=args.budget_minutes, patience=1000)
    train = split_prompts(load_prompt_mix(settings.prompts, tokenizer=target.tokenizer))["train"]
    held_out = split_prompts(load_prompt_mix(["mt_bench"], tokenizer=target.tokenizer))
    dm = DistillDataModule(target, train, held_out["val"])  # the pipeline's data (its defaults)
    dm.prepare_data()
    test_seqs = generate_continuations(target, held_out["test"], max_new_tokens=128, progress=False)
    test_prompts = [r["input_ids"] for r in held_out["test"]][: args.live_prompts]
    vocab = int(target.model.get_output_embeddings().out_features)

    rows = []
    base = build_draft(target, num_layers=args.num_layers, vocab_size=args.vocab_size,
                       token_counts=token_counts(dm.train, vocab))
    rows.append(evaluate("undistilled", target, _drafter(base, vocab), test_seqs, test_prompts, args))
    for item in args.reuse:
        name, path = item.split("=", 1)
        rows.append(evaluate(name, target, model_drafter(target, str(Path(path) / "draft")), test_seqs,
                             test_prompts, args))
    curve = [float(m) for m in args.curve.split(",") if m]
    for i, loss in enumerate(l for l in args.losses.split(",") if l):
        s = DistillSettings(**{**settings.__dict__, "loss": loss})
        snaps = Snapshots(curve) if (i == 0 and curve) else None
        factory = functools.partial(L.Trainer, accelerator="cpu", devices=1, max_epochs=1000, enable_progress_bar=True,
                                    default_root_dir=str(workdir))
        metrics = train_draft(target, dm, s, factory, workdir / loss, callbacks=[snaps] if snaps else ())
        row = evaluate(loss, target, model_drafter(target, str(workdir / loss / "draft")), test_seqs, test_prompts,
                       args)
        row.update({"train_steps": metrics["global_step"], "val_match_rate": metrics["val/match_rate"],
                    "train_tokens": metrics["train_tokens"], "budget_minutes": args.budget_minutes})
        rows.append(row)
        for minutes, state in (snaps.saved.items() if snaps else []):
            snap = copy.deepcopy(base)
            snap.model.load_state_dict(state)
            rows.append(evaluate(f"{loss}@{minutes:g}min", target, _drafter(snap, vocab), test_seqs, test_prompts,
                                 args))
    meta = {"target": args.target, "num_layers": args.num_layers, "vocab_size": args.vocab_size,
            "budget_minutes": args.budget_minutes, "test_prompts": len(held_out["test"]),
            "test_positions": sum(len(r["input_ids"]) - r["prompt_len"] for r in test_seqs),
            "live_prompts": len(test_prompts), "max_new_tokens": args.max_new_tokens, "ks": args.ks,
            "torch_threads": torch.get_num_threads(), "workdir": str(workdir)}
    report = {"rows": rows, "meta": meta}
    bench.write_results(args.out, report)
    print(markdown(rows, meta))
    return report


def _drafter(draft, vocab) -> ModelDrafter:
    model = draft.model.eval()
    return ModelDrafter(model, name="draft", d2t=draft.d2t, vocab_size=vocab if draft.d2t is not None else None)


def markdown(rows, meta) -> str:
    head = (f"{meta['num_layers']}-layer drafts, {meta['vocab_size']}-token vocabulary, {meta['budget_minutes']} min "
            f"per loss; held-out MT-Bench first turns ({meta['test_prompts']} prompts, {meta['test_positions']} "
            f"positions; live: {meta['live_prompts']} prompts x {meta['max_new_tokens']} tokens)")
    return head + "\n\n" + bench.table(
        ["draft", "greedy match", "mean beta (T=1)", "draft step / target step", "best k", "live speedup vs AR"],
        ([r["name"], bench.cell(r["match_rate"], ".3f"), bench.cell(r["mean_beta_t1"], ".3f"),
          bench.cell(r["draft_cost"], ".3f"), r.get("best_k", "-"), f"{bench.cell(r.get('speedup_vs_ar'))}x"]
         for r in rows))


if __name__ == "__main__":
    main()
