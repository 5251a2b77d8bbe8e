"""Profile the embedded target's verify cost inside a real vLLM engine and write a run directory whose cost model
holds it, so that the learned rule is tuned for vLLM (sacpolicy.export.vllm_cost).

    python scripts/train.py experiment=vllm_ngram hydra.run.dir=runs/vllm_ngram            # traces + our cost model
    python scripts/profile_vllm.py --run runs/vllm_ngram --out runs/vllm_ngram_vcost        # vLLM's step costs
    python scripts/train.py experiment=vllm_ngram "stages=[fit,export]" from_run=runs/vllm_ngram \\
        hydra.run.dir=runs/vllm_ngram_vcost                                                 # the rule, retuned
    python scripts/bench_vllm.py --policy runs/vllm_ngram_vcost/policies/hgb                # measured in vLLM

Profiles on held-out validation prompts (never the test prompts the benchmark uses). Prints a Markdown table of the
step seconds per k next to what the run's own cost model predicts at the same context, and writes
``<out>/cost.json`` and ``<out>/vllm_profile.json``.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

from sacpolicy import bench
from sacpolicy.export.vllm_cost import profile_vllm_verify, vllm_cost_model
from sacpolicy.export.vllm_run import vllm_status
from sacpolicy.models import EMBEDDED_TARGET, load_tokenizer, model_dir
from sacpolicy.runtime.cost import CostModel


def main(argv=None) -> int:
    ap = bench.parser(__doc__)
    ap.add_argument("--run", required=True, help="a run directory with cost.json (e.g. experiment=vllm_ngram's)")
    bench.add_out(ap, None, required=True, help="the new run directory (its cost.json: vLLM's verify costs)")
    bench.add_prompt_set(ap, split="val", prompts=6, max_tokens=48)
    ap.add_argument("--ks", default="0,1,2,4,8")
    ap.add_argument("--repeats", type=int, default=2, help="engines per k, interleaved over k")
    args = ap.parse_args(argv)

    base_path = Path(args.run) / "cost.json"
    if not base_path.is_file():
        raise SystemExit(f"profile_vllm: {base_path} is missing; run the pipeline's collect stage first (e.g. "
                         "python scripts/train.py experiment=vllm_ngram hydra.run.dir=<run>)")
    ok, why = vllm_status()
    if not ok:
        raise SystemExit(f"profile_vllm: {why}")
    base = CostModel.from_json(base_path)
    tok = load_tokenizer(EMBEDDED_TARGET)
    prompts = [r["input_ids"] for r in bench.held_out_prompts(args.source, tok, split="val", n=args.prompts)]
    ks = bench.int_list(args.ks)
    print(f"vLLM {why}; {len(prompts)} {args.source} validation prompts, {args.max_tokens} tokens, k in {ks}, "
          f"{args.repeats} engine(s) per k", flush=True)
    steps = profile_vllm_verify(model_dir(), prompts, ks, max_tokens=args.max_tokens, repeats=args.repeats)
    mean_context = statistics.fmean(len(p) for p in prompts) + args.max_tokens / 2
    cost = vllm_cost_model(base, steps, mean_context, meta={"vllm": why, "vllm_prompts": len(prompts)})
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cost.to_json(out / "cost.json")
    md = markdown(steps, ks, base, mean_context)
    print(md)
    bench.write_results(out / "vllm_profile.json", {"mean_context": mean_context,
                                                    "step_s": {str(k): v for k, v in steps.items()}, "markdown": md},
                        args)
    print(f"wrote {out / 'cost.json'}; next: python scripts/train.py experiment=vllm_ngram \"stages=[fit,export]\" "
          f"from_run={args.run} hydra.run.dir={out}")
    return 0


def markdown(steps: dict, ks: list[int], base: CostModel, mean_context: float) -> str:
    """vLLM's step seconds per k (median and each engine's) beside what ``base`` predicts at the same context."""
    one, ours1 = statistics.median(steps[0]), base.verify_time(0, mean_context)

    def line(k):
        ours = base.verify_time(k, mean_context)
        each = ", ".join(f"{1e3 * s:.1f}" for s in steps[k])
        return [k, k + 1, f"{1e3 * statistics.median(steps[k]):.1f} ({each})",
                bench.ratio(statistics.median(steps[k]) / one), f"{1e3 * ours:.1f}", bench.ratio(ours / ours1)]

    return bench.table(["k", "tokens fed", "vLLM step ms (median; each engine)", "vs k = 0", "our decoder's model, ms",
                        "vs k = 0"], map(line, ks))


if __name__ == "__main__":
    sys.exit(main())
