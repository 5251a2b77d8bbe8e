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

import argparse
import statistics
import sys
from pathlib import Path

from sacpolicy.data import assign_split, load_prompts
from sacpolicy.export.vllm_cost import profile_vllm_verify, vllm_cost_model
from sacpolicy.export.vllm_run import vllm_status
from sacpolicy.io import write_json
from sacpolicy.models import EMBEDDED_TARGET, load_tokenizer, model_dir
from sacpolicy.runtime.cost import CostModel


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", required=True, help="a run directory with cost.json (e.g. experiment=vllm_ngram's)")
    ap.add_argument("--out", required=True, help="the new run directory (its cost.json: vLLM's verify costs)")
    ap.add_argument("--source", default="mt_bench", help="prompt set; its validation split is used")
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=48)
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
    rows = [r for r in load_prompts(args.source, tokenizer=tok) if assign_split(r["prompt_id"]) == "val"]
    prompts = [r["input_ids"] for r in rows[: args.prompts]]
    ks = [int(k) for k in args.ks.split(",")]
    print(f"vLLM {why}; {len(prompts)} {args.source} validation prompts, {args.max_tokens} tokens, k in {ks}, "
          f"{args.repeats} engine(s) per k", flush=True)
    steps = profile_vllm_verify(model_dir(), prompts, ks, max_tokens=args.max_tokens, repeats=args.repeats)
    mean_context = statistics.fmean(len(p) for p in prompts) + args.max_tokens / 2
    cost = vllm_cost_model(base, steps, mean_context, meta={"vllm": why, "vllm_prompts": len(prompts)})
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cost.to_json(out / "cost.json")
    one, ours1 = statistics.median(steps[0]), base.verify_time(0, mean_context)
    lines = ["| k | tokens fed | vLLM step ms (median; each engine) | vs k = 0 | our decoder's model, ms | vs k = 0 |",
             "|---|---|---|---|---|---|"]
    for k in ks:
        ours = base.verify_time(k, mean_context)
        each = ", ".join(f"{1e3 * s:.1f}" for s in steps[k])
        lines.append(f"| {k} | {k + 1} | {1e3 * statistics.median(steps[k]):.1f} ({each}) | "
                     f"{statistics.median(steps[k]) / one:.2f}x | {1e3 * ours:.1f} | {ours / ours1:.2f}x |")
    md = "\n".join(lines)
    print(md)
    write_json(out / "vllm_profile.json", {"args": vars(args), "mean_context": mean_context,
                                           "step_s": {str(k): v for k, v in steps.items()}, "markdown": md})
    print(f"wrote {out / 'cost.json'}; next: python scripts/train.py experiment=vllm_ngram \"stages=[fit,export]\" "
          f"from_run={args.run} hydra.run.dir={out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
