"""Trace benchmark: teacher-forced vs live trace cost, and simulated vs measured tokens/s.

    python scripts/bench_traces.py --prompts 4 --draft outputs/.../distill/draft

On held-out MT-Bench first turns with the embedded target (greedy):
1. seconds per generated position of live decoding (static k) vs of the teacher-forced pass of every drafter over
   the target's output (the target's own decode, shared by all drafters and all policies, reported separately; its
   kept logits give p, so the target never runs a second time);
2. the cost model profiled on this machine, the policies replayed over the traces (simulated tokens/s) and the
   same policies run live (measured tokens/s), side by side.
Prints a Markdown table and writes bench_traces.json.
"""

from __future__ import annotations

import argparse
import time

from sacpolicy.build import model_drafter
from sacpolicy.data import load_prompts, split_prompts
from sacpolicy.decoding import LayerSkipDrafter, NgramDrafter, SpeculativeDecoder
from sacpolicy.io import write_json
from sacpolicy.models import EMBEDDED_TARGET, load_model
from sacpolicy.policy import Autoregressive, Heuristic, Static
from sacpolicy.profiling import profile
from sacpolicy.traces.collect import teacher_forced_rows
from sacpolicy.traces.simulate import group_traces, simulate


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=EMBEDDED_TARGET)
    ap.add_argument("--draft", default=None, help="a draft directory (e.g. distilled); default: layer-skip 4")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--out", default="bench_traces.json")
    args = ap.parse_args(argv)

    lm = load_model(args.target, device="cpu", dtype="float32")
    draft = model_drafter(lm, args.draft, name="draft") if args.draft else LayerSkipDrafter(lm.model, 4, name="draft")
    drafters = [draft, NgramDrafter(name="ngram")]
    prompts = list(split_prompts(load_prompts("mt_bench", tokenizer=lm.tokenizer))["test"])[: args.prompts]
    eos = lm.eos_token_ids
    policies = {f"static-k{k}-{d.name}": (lambda k=k, d=d: Static(k, d.name)) for d in drafters for k in (1, 2, 4)}
    policies["heuristic-draft"] = lambda: Heuristic(k0=3, drafter="draft")

    ar = SpeculativeDecoder(lm.model, [], Autoregressive(), stop_token_ids=eos)
    gen_s = tf_s = 0.0
    rows, generated = [], {}
    for r in prompts:  # the target's own output once, then one teacher-forced pass per drafter
        res = ar.generate(r["input_ids"], args.max_new_tokens, keep_logits=True)
        gen_s += res.total_s
        generated[r["prompt_id"]] = res.tokens
        t0 = time.perf_counter()
        rows += teacher_forced_rows(lm, drafters, r, res.tokens, k_max=16, target_logits=res.logits)
        tf_s += time.perf_counter() - t0
    positions = sum(len(t) for t in generated.values())

    cost = profile(lm.model, drafters, ks=(0, 1, 2, 4, 8), context_lens=(64, 256, 512), repeats=5)
    grouped = group_traces(rows)
    vocab = int(lm.model.get_output_embeddings().out_features)
    results = []
    live_s = live_tokens = 0
    for name, make in policies.items():
        sim = simulate(make(), grouped, cost, vocab_size=vocab)
        dec = SpeculativeDecoder(lm.model, drafters, make(), stop_token_ids=eos)
        tokens = secs = calls = 0
        for r in prompts:
            out = dec.generate(r["input_ids"], args.max_new_tokens)
            tokens, secs, calls = tokens + len(out.tokens), secs + out.total_s, calls + out.target_calls
        live_s, live_tokens = live_s + secs, live_tokens + tokens
        measured = tokens / secs
        results.append({"name": name, "measured_tokens_per_s": measured, "simulated_tokens_per_s": sim.tokens_per_s,
                        "error": sim.tokens_per_s / measured - 1, "live_target_calls": calls,
                        "simulated_target_calls": sim.target_calls})
    live_per_pos = live_s / live_tokens
    report = {"rows": results, "meta": {
        "target": args.target, "draft": args.draft or "layer-skip 4", "prompts": len(prompts), "positions": positions,
        "live_s_per_position": live_per_pos, "teacher_forced_s_per_position": tf_s / positions,
        "target_decode_s_per_position": gen_s / positions,
        "teacher_forced_speedup": live_per_pos / (tf_s / positions),
        "policies_replayed": len(policies), "cost_model": cost.to_dict()}}
    write_json(args.out, report)
    m = report["meta"]
    print(f"live decoding {m['live_s_per_position'] * 1e3:.1f} ms/position; teacher-forced passes of "
          f"{len(drafters)} drafters {m['teacher_forced_s_per_position'] * 1e3:.2f} ms/position "
          f"({m['teacher_forced_speedup']:.0f}x fewer seconds); the target's own decode, shared by every drafter and "
          f"policy: {m['target_decode_s_per_position'] * 1e3:.1f} ms/position\n")
    print("| policy | measured tokens/s | simulated tokens/s | error | target calls live / simulated |")
    print("|---|---|---|---|---|")
    for r in results:
        print(f"| {r['name']} | {r['measured_tokens_per_s']:.1f} | {r['simulated_tokens_per_s']:.1f} | "
              f"{r['error']:+.1%} | {r['live_target_calls']} / {r['simulated_target_calls']} |")
    return report


if __name__ == "__main__":
    main()
