"""Stage ``decode``: a quick live comparison of the configured policy with autoregressive decoding
(``decode.json``)."""

from __future__ import annotations

from sacpolicy.decoding import Autoregressive, RequestInfo, reset_drafters
from sacpolicy.pipeline.context import RunContext


def run(ctx: RunContext) -> dict:
    cfg, target = ctx.cfg, ctx.target
    prompts = ctx.take(ctx.prompts(), cfg.run.num_prompts)
    decoders = {"ar": ctx.decoder(drafters=[], policy=Autoregressive()), "policy": ctx.decoder()}
    for dec in decoders.values():  # warm-up: first calls pay for lazy initialisation
        for row in prompts[: cfg.run.warmup_prompts]:
            dec.generate(row["input_ids"], 8)
        reset_drafters(dec.drafters.values())  # timed from an empty global index (suffix): no warm-up's answers
    results = {}
    for name, dec in decoders.items():
        tokens = seconds = calls = 0
        for row in prompts:
            res = dec.generate(row["input_ids"], cfg.run.max_new_tokens,
                               request=RequestInfo(category=row["category"]))
            tokens, seconds, calls = tokens + len(res.tokens), seconds + res.total_s, calls + res.target_calls
        results[name] = {"policy": repr(dec.policy), "tokens": tokens, "seconds": seconds,
                         "tokens_per_s": tokens / seconds, "tokens_per_call": tokens / calls}
    results["policy"]["speedup_vs_ar"] = results["policy"]["tokens_per_s"] / results["ar"]["tokens_per_s"]
    ctx.tracker.log({f"{n}_tokens_per_s": r["tokens_per_s"] for n, r in results.items()}, "decode")
    return {"target": target.spec, "device": str(target.device), "dtype": str(target.dtype),
            "prompts": len(prompts), "max_new_tokens": cfg.run.max_new_tokens, "rows": results}

