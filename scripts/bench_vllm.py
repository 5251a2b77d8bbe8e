"""vLLM benchmark: the embedded target in a real vLLM engine, without speculation, with vLLM's built-in n-gram
lookup, and with what sacpolicy exports (the learned policy as a custom proposer, its static setting, the EAGLE-3
head, a draft model), side by side on the same held-out prompts.

    python scripts/train.py experiment=vllm_ngram hydra.run.dir=runs/vllm_ngram   # a learned n-gram policy
    python scripts/bench_vllm.py --policy runs/vllm_ngram/policies/hgb            # 16 MT-Bench test prompts
    python scripts/bench_vllm.py --policy ... --source humaneval_edit --prompts 8 --draft runs/x/distill/draft
    python scripts/bench_vllm.py --target embedded:gemma3-270m --policy <gemma run>/policies/mlp --head none

``--target``: any model spec (default the embedded one); a target without a chat template (a base model) gets the
plain prompt format (``data.apply_template``, chat=False), as its runs do. A policy that also chooses drafters vLLM
cannot run per step (layer-skip, a head) is served with its lookup drafters alone (``--drafter``, default all of
them): the rule then plans over those.

Every configuration runs in its own engine (float32, greedy, ``enforce_eager``: torch.compile would add minutes to
every engine's start), one after another: a phase ``serial`` (one request at a time) and a phase ``concurrent``
(``--concurrency`` prompts, default 8, submitted together, wave after wave; vLLM batches them). Every output is
checked against the engine without speculation. Ratios are against that engine (``vs none``) and against vLLM's
n-gram at its documented settings (``vs ngram``: the docs' example, k = 5, ``prompt_lookup_max`` 4), with 95%
paired-bootstrap intervals over prompts for the serial phase. Acceptance comes from vLLM's own counters. vLLM turns
async scheduling off for custom proposers (the learned policy's path); ``--sync-rows`` adds the two baselines without
it, to tell that cost apart. Prints a Markdown table and writes bench_vllm.json (``--out``).
"""

from __future__ import annotations

import sys
import tempfile
import time

import numpy as np
import torch

from sacpolicy import bench
from sacpolicy.decoding.lookup import LOOKUP_KINDS
from sacpolicy.evaluation.intervals import bootstrap_indices, paired_ratio_interval
from sacpolicy.export import static_k
from sacpolicy.export.vllm import learned_config, speculative_config
from sacpolicy.export.vllm_run import run_engine, vllm_status
from sacpolicy.export.vllm_serve import VLLM_NGRAM_DOCS
from sacpolicy.models import EMBEDDED_TARGET, load_tokenizer, served_model
from sacpolicy.runtime import load_artifact


def configs(args, target_dir, tmp) -> dict[str, dict]:
    """name -> run_engine keyword arguments."""
    runs = {"none": {}, "vllm-ngram": {"speculative_config": VLLM_NGRAM_DOCS}}
    if args.sync_rows:  # vLLM turns async scheduling off for custom proposers: the same rows without it
        sync = {"engine_args": {"async_scheduling": False}}
        runs |= {"none-sync": sync, "vllm-ngram-sync": {"speculative_config": VLLM_NGRAM_DOCS, **sync}}
    if args.policy:
        art = load_artifact(args.policy)
        lookups = [n for n, s in art.drafters.items() if s.kind in LOOKUP_KINDS]
        drafter = args.drafter or ",".join(lookups)
        if not drafter:
            raise SystemExit(f"bench_vllm: the policy at {args.policy} has no n-gram or suffix drafter, the ones "
                             "vLLM's custom proposer runs; train one with experiment=vllm_ngram")
        env = {"SACPOLICY_POLICY_DRAFTER": drafter}
        runs["sacpolicy-learned"] = {"speculative_config": learned_config(art, drafter=drafter),
                                     "policy_dir": args.policy, "env": env}
        ngram = [n for n in drafter.split(",") if art.drafters[n].kind == "ngram"]
        if ngram:  # the static row: vLLM's own n-gram lookup at the rule's static k
            static = speculative_config(art, drafter=ngram[0])
            runs[f"sacpolicy-static-k{static['num_speculative_tokens']}"] = {"speculative_config": static}
        print(f"policy {args.policy}: learned rule k<= {art.rule.k_max} with {drafter}"
              + (f", static k {static_k(art.rule, ngram[0])}" if ngram else ""))
    if args.head != "none":
        from sacpolicy.export.speculators import export_speculators
        from sacpolicy.heads import shipped_head

        if args.head == "shipped" and args.target != EMBEDDED_TARGET:
            raise SystemExit(f"bench_vllm: the shipped head is {EMBEDDED_TARGET}'s; pass --head none or a head "
                             f"trained on {args.target}")
        head = shipped_head(EMBEDDED_TARGET) if args.head == "shipped" else args.head
        spec = export_speculators(head, f"{tmp}/eagle3", str(target_dir), args.head_k, dtype=torch.float32)
        runs[f"sacpolicy-eagle3-k{args.head_k}"] = {"speculative_config": {
            "method": "eagle3", "model": str(spec), "num_speculative_tokens": args.head_k}}
    if args.draft:
        runs[f"sacpolicy-draft-k{args.draft_k}"] = {"speculative_config": {
            "method": "draft_model", "model": args.draft, "num_speculative_tokens": args.draft_k}}
    return runs


def summarize(name: str, res: dict, base: dict, ngram: dict | None, idx: np.ndarray) -> dict:
    row = {"name": name, "startup_s": res["startup_s"]}
    toks = [len(o) for o in res["outputs"]["serial"]]
    row["identical"] = all(res["outputs"][p] == base["outputs"][p] for p in res["outputs"])
    for phase in res["seconds"]:
        row[f"{phase}_tokens_per_s"] = res["tokens"][phase] / res["seconds"][phase]
        row[f"{phase}_vs_none"] = row[f"{phase}_tokens_per_s"] / (base["tokens"][phase] / base["seconds"][phase])
        if ngram is not None:
            row[f"{phase}_vs_ngram"] = row[f"{phase}_tokens_per_s"] / (ngram["tokens"][phase]
                                                                        / ngram["seconds"][phase])
    for ref, key in ((base, "none"), (ngram, "ngram")):
        if ref is not None:
            row[f"serial_vs_{key}_ci"] = list(paired_ratio_interval(
                toks, res["per_prompt_s"], [len(o) for o in ref["outputs"]["serial"]], ref["per_prompt_s"], idx=idx))
    spec = res["spec"]["serial"]
    row["spec"] = res["spec"]
    if spec["num_drafts"]:
        row["accept_per_pos"] = [a / spec["num_drafts"] for a in spec["accepted_per_pos"]]
        row["accept_len"] = 1 + spec["num_accepted_tokens"] / spec["num_drafts"]  # tokens per verified step
        row["draft_token_acceptance"] = spec["num_accepted_tokens"] / max(spec["num_draft_tokens"], 1)
    return row


def table(rows: list[dict]) -> str:
    nan = float("nan")
    return bench.table(
        ["vLLM config", "same output", "serial tok/s", "vs none", "vs vLLM ngram", "concurrent tok/s", "vs none",
         "tokens/step", "accept per position"],
        ([r["name"], "yes" if r["identical"] else "**NO**", f"{r['serial_tokens_per_s']:.1f}",
          bench.ratio(r["serial_vs_none"], r.get("serial_vs_none_ci")),
          bench.ratio(r.get("serial_vs_ngram", nan), r.get("serial_vs_ngram_ci")),
          f"{r.get('concurrent_tokens_per_s', nan):.1f}", bench.ratio(r.get("concurrent_vs_none", nan)),
          f"{r.get('accept_len', 1.0):.2f}", " ".join(f"{a:.2f}" for a in r.get("accept_per_pos", [])) or "-"]
         for r in rows))


def main(argv=None) -> int:
    ap = bench.parser(__doc__)
    ap.add_argument("--policy", help="a learned policy artifact with an n-gram or suffix drafter")
    ap.add_argument("--drafter", default=None,
                    help="the policy's lookup drafters to serve it with, comma-separated (default: all of them)")
    ap.add_argument("--target", default=EMBEDDED_TARGET, help="the target's model spec (default: the embedded one)")
    ap.add_argument("--head", default="shipped", help="EAGLE-3 head directory, 'shipped' (default) or 'none'")
    ap.add_argument("--head-k", type=int, default=3)
    ap.add_argument("--draft", help="a draft model directory (e.g. <run>/distill/draft) for method draft_model")
    ap.add_argument("--draft-k", type=int, default=3)
    bench.add_prompt_set(ap, split="test", prompts=16, max_tokens=64, prompts_help="held-out test prompts")
    ap.add_argument("--concurrency", type=int, default=8, help="requests submitted together in the concurrent phase")
    ap.add_argument("--sync-rows", action="store_true",
                    help="add none and vLLM-ngram rows without async scheduling, which vLLM turns off for custom "
                         "proposers (ours)")
    bench.add_out(ap, "bench_vllm.json")
    args = ap.parse_args(argv)

    ok, why = vllm_status()
    if not ok:
        raise SystemExit(f"bench_vllm: {why}")
    tok = load_tokenizer(args.target)
    chat = bool(getattr(tok, "chat_template", None))  # a base model: the plain format its runs use
    prompts = [r["input_ids"] for r in bench.held_out_prompts(args.source, tok, n=args.prompts, chat=chat)]
    target_dir = served_model(args.target)  # what vLLM loads
    print(f"vLLM {why}; {args.target}; {len(prompts)} {args.source} test prompts"
          f"{'' if chat else ' (plain format: no chat template)'}, {args.max_tokens} new tokens, greedy, float32")
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, kw in configs(args, target_dir, tmp).items():
            t = time.perf_counter()
            results[name] = run_engine(target_dir, prompts, max_tokens=args.max_tokens,
                                       phases=("serial", "concurrent"), concurrency=args.concurrency, **kw)
            print(f"  {name}: {time.perf_counter() - t:.0f} s (startup {results[name]['startup_s']:.0f} s)",
                  flush=True)
    idx = bootstrap_indices(len(prompts))
    rows = [summarize(n, r, results["none"], results.get("vllm-ngram"), idx) for n, r in results.items()]
    md = table(rows)
    print(md)
    bench.write_results(args.out, {"vllm": results["none"]["vllm"], "n_prompts": len(prompts), "rows": rows,
                                   "markdown": md}, args)
    print(f"wrote {args.out}")
    return 0 if all(r["identical"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
