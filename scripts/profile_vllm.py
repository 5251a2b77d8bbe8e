"""Profile a target's verify cost inside a real vLLM engine and write a run directory whose cost model holds it, so
that the learned rule is tuned for vLLM (sacpolicy.export.vllm_cost).

    python scripts/train.py experiment=vllm_ngram hydra.run.dir=runs/vllm_ngram            # traces + our cost model
    python scripts/profile_vllm.py --run runs/vllm_ngram --out runs/vllm_ngram_vcost \
        --batch-sizes 1,4,16                                                                # vLLM's step costs
    python scripts/train.py experiment=vllm_ngram "stages=[fit,export]" from_run=runs/vllm_ngram \\
        hydra.run.dir=runs/vllm_ngram_vcost                                                 # the rule, retuned
    python scripts/bench_vllm.py --policy runs/vllm_ngram_vcost/policies/hgb                # measured in vLLM

``--target``: the model vLLM serves, any model spec (hub id, directory, .gguf, embedded:...); default the run's
target (its config.yaml), the embedded target where that is a random-init tiny model (no weights for vLLM to load,
and the tiny models share the embedded tokenizer).

With ``--head <head dir | speculators dir | shipped>`` it also times vLLM's ``eagle3`` method with that head at every
k >= 1 and B, and prices the run's feature drafter (``--head-name``, default ``feature``) by those steps, so the rule's
k-by-batch-size map for the head is vLLM's (export it with ``scripts/export.py ... format=vllm drafter=feature``).
A head directory of ours is first exported for the target (``export_head_for``: checked against it); ``shipped`` is
the head that ships for the target (the embedded one's).
With ``--idle K`` it also times, at each B, a step with speculation on (up to K tokens, as the learned rule's export
runs it) and nothing drafted against one without speculation, engines interleaved: what vLLM's speculative path
costs before any draft (``cost.meta["vllm_spec_idle"]``: the ratio per B).

Profiles on held-out validation prompts (never the test prompts the benchmark uses), one request at a time and, with
``--batch-sizes``, in waves of B requests, so the rule (and the custom proposer, which passes vLLM's live batch size)
prices a step at the load it runs under and stops drafting where a wide batch makes it lose. Prints a Markdown table
of the step seconds per k and B next to what the run's own cost model predicts at the same context, and writes
``<out>/cost.json`` and ``<out>/vllm_profile.json``.
"""

from __future__ import annotations

import functools
import json
import math
import statistics
import sys
from pathlib import Path

import torch

from sacpolicy import bench
from sacpolicy.export.speculators import export_head_for, export_shipped_head
from sacpolicy.export.vllm_cost import eagle3_config, profile_vllm_idle, profile_vllm_steps, vllm_cost_model
from sacpolicy.export.vllm_run import vllm_status
from sacpolicy.models import EMBEDDED_TARGET, load_tokenizer, served_model
from sacpolicy.runtime.cost import CostModel


def main(argv=None) -> int:
    ap = bench.parser(__doc__)
    ap.add_argument("--run", required=True, help="a run directory with cost.json (e.g. experiment=vllm_ngram's)")
    bench.add_out(ap, None, required=True, help="the new run directory (its cost.json: vLLM's verify costs)")
    bench.add_prompt_set(ap, split="val", prompts=6, max_tokens=48)
    ap.add_argument("--ks", default="0,1,2,4,8")
    ap.add_argument("--batch-sizes", default="1", help="batch sizes to time (1: one request at a time; B > 1: waves "
                    "of B requests)")
    ap.add_argument("--repeats", type=int, default=2, help="engines per k, interleaved over k")
    ap.add_argument("--target", default=None, help="the model vLLM serves: any model spec (default: the run's "
                    "target; the embedded one for a tiny run)")
    ap.add_argument("--head", default=None, help="also time vLLM's eagle3 with this EAGLE-3 head (our head "
                    "directory, a speculators export, or 'shipped': the head that ships for the target)")
    ap.add_argument("--idle", type=int, default=0, metavar="K", help="also time speculation on (up to K tokens) with "
                    "nothing drafted (spec-idle) against no speculation at each batch size (0: not)")
    ap.add_argument("--head-name", default="feature", help="the run's drafter that head is (its cost is replaced)")
    args = ap.parse_args(argv)

    base_path = Path(args.run) / "cost.json"
    if not base_path.is_file():
        raise SystemExit(f"profile_vllm: {base_path} is missing; run the pipeline's collect stage first (e.g. "
                         "python scripts/train.py experiment=vllm_ngram hydra.run.dir=<run>)")
    ok, why = vllm_status()
    if not ok:
        raise SystemExit(f"profile_vllm: {why}")
    base = CostModel.from_json(base_path)
    target = args.target or run_target(Path(args.run))
    try:
        served = served_model(target)
    except ValueError as e:  # ModelSpecError: names the spec and the fix
        raise SystemExit(f"profile_vllm: --target: {e}") from e
    tok = load_tokenizer(target)
    prompts = [r["input_ids"] for r in bench.held_out_prompts(args.source, tok, split="val", n=args.prompts)]
    ks, sizes = bench.int_list(args.ks), bench.int_list(args.batch_sizes) or [1]
    print(f"vLLM {why} serving {target} ({served}); {len(prompts)} {args.source} validation prompts, "
          f"{args.max_tokens} tokens, k in {ks}, "
          f"batch sizes {sizes}, {args.repeats} engine(s) per k", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    head = None
    if args.head:
        if args.head_name not in base.draft:
            raise SystemExit(f"profile_vllm: the run's cost model has no drafter {args.head_name!r} (it has "
                             f"{sorted(base.draft)}); pass --head-name <the run's feature drafter>")
        head = head_for(args.head, target, served, out / "head")
    by_batch = profile_vllm_steps(served, prompts, ks, sizes, max_tokens=args.max_tokens, repeats=args.repeats)
    head_steps = None
    if head is not None:
        print(f"vLLM eagle3 with the head at {head}", flush=True)
        head_steps = profile_vllm_steps(served, prompts, [k for k in ks if k >= 1], sizes,
                                        max_tokens=args.max_tokens, repeats=args.repeats,
                                        config=functools.partial(eagle3_config, head))
    idle = None
    if args.idle > 0:
        print(f"vLLM with speculation on (up to {args.idle} tokens) and nothing drafted, against no speculation",
              flush=True)
        idle = profile_vllm_idle(served, prompts, sizes, k=args.idle, max_tokens=args.max_tokens,
                                 repeats=args.repeats)
    steps = by_batch[1]
    mean_context = statistics.fmean(len(p) for p in prompts) + args.max_tokens / 2
    meta = {"vllm": why, "vllm_prompts": len(prompts), "vllm_target": target}
    if idle is not None:
        meta["vllm_spec_idle"] = {str(b): statistics.median(v["idle"]) / statistics.median(v["none"])
                                  for b, v in idle.items()}
    cost = vllm_cost_model(base, steps, mean_context, meta=meta,
                           batch_steps={b: v for b, v in by_batch.items() if b > 1}, head=args.head_name,
                           head_steps=head_steps)
    cost.to_json(out / "cost.json")
    md = "\n\n".join(markdown(by_batch[b], ks, base, mean_context, b, None if head_steps is None else head_steps[b])
                      for b in sorted(by_batch))
    if idle is not None:
        md += "\n\n" + idle_markdown(idle)
    print(md)
    if head_steps is not None:
        print(f"the head's drafting in vLLM: {cost.meta['vllm_head_draft']}")
    bench.write_results(out / "vllm_profile.json", {"target": target, "served": served,
                                                    "head": None if head is None else str(head),
                                                    "mean_context": mean_context,
                                                    "step_s": {str(k): v for k, v in steps.items()},
                                                    "batch_step_s": {str(b): {str(k): v for k, v in s.items()}
                                                                     for b, s in by_batch.items()},
                                                    "head_step_s": None if head_steps is None else
                                                    {str(b): {str(k): v for k, v in s.items()}
                                                     for b, s in head_steps.items()},
                                                    "idle_step_s": None if idle is None else
                                                    {str(b): v for b, v in idle.items()}, "markdown": md},
                        args)
    print(f"wrote {out / 'cost.json'}; next: python scripts/train.py experiment=<the run's, e.g. vllm_ngram or "
          f"vllm_head> \"stages=[fit,export]\" from_run={args.run} hydra.run.dir={out}")
    return 0


def run_target(run: Path) -> str:
    """The target of the run at ``run`` (its config.yaml's ``target.spec``), the embedded target where that is a
    random-init tiny model (vLLM has no weights to load for it; it shares the embedded tokenizer) or the run has no
    config.yaml."""
    if not (run / "config.yaml").is_file():
        return EMBEDDED_TARGET
    from omegaconf import OmegaConf

    spec = str(OmegaConf.load(run / "config.yaml").target.spec)
    return EMBEDDED_TARGET if spec.startswith("tiny:") else spec


def head_for(head: str, target: str, served: str, out: Path) -> Path:
    """The speculators directory vLLM runs for ``--head``: the head that ships for ``target`` (``shipped``), a head
    directory of ours exported for ``target`` (checked against it), or a speculators export as it is."""
    try:
        if head == "shipped":
            return export_shipped_head(out, served, target=target)
        config = Path(head) / "config.json"
        if config.is_file() and "speculators_model_type" not in json.loads(config.read_text()):
            return export_head_for(head, out, target, dtype=torch.float32)
    except (ValueError, FileNotFoundError) as e:  # no head ships for the target; one for another target; no head
        raise SystemExit(f"profile_vllm: --head {head}: {e}\nFix: pass --head <a head trained for {target}> or "
                         "--target <the model it was trained for>") from e
    return Path(head)


def markdown(steps: dict, ks: list[int], base: CostModel, mean_context: float, batch: int = 1,
             head: dict | None = None) -> str:
    """vLLM's step seconds per k at ``batch`` rows (median and each engine's) beside what ``base`` predicts at the same
    context (- where ``base`` was not profiled at that batch size); ``head``: {k: [seconds]} of vLLM's eagle3 steps
    at this batch size, a column of their own."""
    one = statistics.median(steps[0])
    try:
        base.check_batch(batch)
        ours_at = lambda k: base.verify_time(k, mean_context, batch)
    except ValueError:
        ours_at = lambda k: float("nan")
    ours1 = ours_at(0)

    def line(k):
        ours = ours_at(k)
        each = ", ".join(f"{1e3 * s:.1f}" for s in steps[k])
        mine = ["-", "-"] if math.isnan(ours) else [f"{1e3 * ours:.1f}", bench.ratio(ours / ours1)]
        eagle = ([] if head is None else
                 [f"{1e3 * statistics.median(head[k]):.1f}" if head.get(k) else "-"])
        return [k, k + 1, f"{1e3 * statistics.median(steps[k]):.1f} ({each})",
                bench.ratio(statistics.median(steps[k]) / one), *mine, *eagle]

    return f"Batch size {batch}:\n\n" + bench.table(
        ["k", "tokens fed per row", "vLLM step ms (median; each engine)", "vs k = 0", "our decoder's model, ms",
         "vs k = 0", *([] if head is None else ["vLLM eagle3 step ms (median)"])], map(line, ks))


def idle_markdown(idle: dict) -> str:
    """Speculation on with nothing drafted against no speculation, per batch size (medians and each engine's)."""
    def line(b):
        none, on = idle[b]["none"], idle[b]["idle"]
        cell = lambda v: f"{1e3 * statistics.median(v):.1f} (" + ", ".join(f"{1e3 * s:.1f}" for s in v) + ")"
        return [b, cell(none), cell(on), bench.ratio(statistics.median(on) / statistics.median(none))]

    return "Speculation on, nothing drafted (spec-idle):\n\n" + bench.table(
        ["B", "no speculation: step ms (median; each engine)", "spec-idle: step ms", "spec-idle vs none"],
        map(line, sorted(idle)))


if __name__ == "__main__":
    sys.exit(main())
