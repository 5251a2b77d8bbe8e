"""Refit's served check: a candidate that the simulated comparison accepts is promoted only if a few held-out
requests, served by a real vLLM engine, show it no slower than the policy serving now.

Why: the simulated comparison prices a replay of the logged sequences with the cost model, and a cost model can miss
what only the engine pays for (the proposer's own work, the engine's step overheads, a different machine), so a gain
in simulated seconds can be a loss served (issue 64). The check measures what production runs.

What it runs (``serve_arms``): each held-out request's logged prompt, served one at a time (``run_engine``'s serial
phase, greedy unless the log was sampled: then at its temperature and top_p), by an engine with the learned proposer
(``learned_config``) reading the candidate's policy directory, and by one reading the current policy's. Both engines
are the server that wrote the log: its k cap (``num_speculative_tokens``) and ``max_model_len``. One engine serves
every prompt to one ``max_tokens`` (``run_engine`` takes one for all), the longest served length among them: a request
the server stopped at its end-of-sequence token stops there again, one it cut short at its own lower ``max_tokens``
runs on (``same_length_as_served`` counts the former). Engines start in turn, ``rounds`` per arm, the order reversed
every round (candidate, current, current, candidate, ...), so a machine that drifts during the check slows both arms
alike; with one round they run one after the other, and the report says so. A request's time and tokens are summed over
its rounds.

How it decides (``verdict``): the candidate's tokens/s over the current's (time per output token, inverted), with the
paired bootstrap interval over the served requests (``evaluation.intervals``). The candidate fails when the interval's
upper end is below ``refit.served_check_threshold`` (1.0: measurably slower beyond the interval's noise). A handful of
served requests cannot confirm the simulated gain (``refit.threshold``), only catch a loss the simulation did not see.
"""

from __future__ import annotations

import logging

from sacpolicy.pipeline.context import PipelineError

logger = logging.getLogger(__name__)

ARMS = ("candidate", "current")


def prepare(spec: str, rs) -> str:
    """The served model directory of target ``spec``, or a refusal naming the fix: vLLM missing or broken
    (``vllm_status``), a target no engine can load, fewer than one round. Called before a refit fits anything."""
    from sacpolicy.export.vllm_run import served_target, vllm_status

    off = "or set refit.served_check_requests=0 to let the simulated comparison decide alone"
    if rs.served_check_rounds < 1:
        raise PipelineError(f"refit.served_check_rounds={rs.served_check_rounds}: the served check needs at least one "
                            f"engine per arm; set refit.served_check_rounds=2 (candidate, current, current, "
                            f"candidate) or 1, {off}")
    ok, why = vllm_status()
    if not ok:
        raise PipelineError(f"refit.served_check_requests={rs.served_check_requests}: a refit promotes a candidate "
                            "only after serving held-out requests with it in a real vLLM engine, but vLLM cannot run "
                            f"here: {why}. Install it (`bash scripts/install.sh .venv --vllm`), {off}")
    try:
        return served_target(spec)
    except ValueError as e:
        raise PipelineError(f"the served check needs a target a vLLM engine can load: {e}; {off}") from e


def order(rounds: int) -> list[str]:
    """The arms' engines in the order they start: candidate, current, then reversed each round (ABBA ...)."""
    return [arm for r in range(rounds) for arm in (ARMS if r % 2 == 0 else ARMS[::-1])]


def serve_arms(model_dir, arms: dict, prompts: list[list[int]], *, max_tokens: int, k_cap: int, max_model_len: int,
               rounds: int = 2, sampling: dict | None = None) -> dict:
    """Serve ``prompts`` one at a time with each arm's policy (``arms``: {"candidate", "current"} -> policy directory)
    in engines started in ``order(rounds)``, each shaped as the logged server (``k_cap``, ``max_model_len``).

    Returns {"per_request": {arm: {"tokens", "seconds"}: per prompt, summed over the arm's rounds}, "outputs": {arm:
    [token ids per prompt] of its first round}, "engines": [{"arm", "startup_s", "seconds", "tokens", "draft_tokens",
    "accepted_tokens"} in the order they ran], "vllm": version}."""
    from sacpolicy.export.vllm import learned_config
    from sacpolicy.export.vllm_run import run_engine
    from sacpolicy.runtime.artifact import ArtifactError

    try:  # each arm as the logged server runs it: the learned proposer under the server's k cap
        configs = {arm: {**learned_config(arms[arm]), "num_speculative_tokens": int(k_cap)} for arm in ARMS}
    except ArtifactError as e:
        raise PipelineError(f"the served check cannot serve a policy in vLLM: {e}") from e
    per = {arm: {"tokens": [0] * len(prompts), "seconds": [0.0] * len(prompts)} for arm in ARMS}
    outputs, engines, version = {}, [], None
    for i, arm in enumerate(order(rounds)):
        logger.info("served check: engine %d of %d, %s (%s), %d requests", i + 1, 2 * rounds, arm, arms[arm],
                    len(prompts))
        res = run_engine(model_dir, prompts, max_tokens=int(max_tokens), speculative_config=configs[arm],
                         policy_dir=arms[arm], phases=("serial",), max_model_len=int(max_model_len),
                         sampling=sampling)
        outs = res["outputs"]["serial"]
        for j, (out, s) in enumerate(zip(outs, res["per_prompt_s"], strict=True)):
            per[arm]["tokens"][j] += len(out)
            per[arm]["seconds"][j] += float(s)
        outputs.setdefault(arm, outs)
        spec = res["spec"]["serial"]
        engines.append({"arm": arm, "startup_s": res["startup_s"], "seconds": res["seconds"]["serial"],
                        "tokens": res["tokens"]["serial"], "draft_tokens": spec["num_draft_tokens"],
                        "accepted_tokens": spec["num_accepted_tokens"]})
        version = res["vllm"]
    return {"per_request": per, "outputs": outputs, "engines": engines, "vllm": version}


def verdict(per: dict, *, threshold: float, seed: int, resamples: int, level: float) -> dict:
    """The decision on served timings ``per`` ({arm: {"tokens", "seconds"}} per request, paired across the arms):
    {"ratio": candidate tokens/s over current's, "ci": its paired bootstrap interval over requests,
    "seconds_per_token": {arm}, "per_request_ratio": [candidate tokens/s over current's, per request], "accepted":
    the interval's upper end is at least ``threshold`` (not slower beyond noise)}."""
    from sacpolicy.evaluation.intervals import bootstrap_indices, paired_ratio_interval

    cand, cur = per["candidate"], per["current"]
    idx = bootstrap_indices(len(cand["tokens"]), resamples=resamples, seed=seed)
    lo, hi = paired_ratio_interval(cand["tokens"], cand["seconds"], cur["tokens"], cur["seconds"], idx=idx,
                                   level=level)
    spt = {arm: sum(per[arm]["seconds"]) / sum(per[arm]["tokens"]) for arm in ARMS}
    return {"ratio": spt["current"] / spt["candidate"], "ci": [lo, hi], "seconds_per_token": spt,
            "per_request_ratio": [(tc / sc) / (tu / su) for tc, sc, tu, su in
                                  zip(cand["tokens"], cand["seconds"], cur["tokens"], cur["seconds"], strict=True)],
            "threshold": threshold, "accepted": bool(hi >= threshold)}


def served_check(model_dir, arms: dict, requests: dict, *, log: dict, sampling: dict, rs, seed: int) -> dict:
    """The served check of refit.json: ``requests`` ({log id: ``requests_of``'s request}, the held-out ones to serve)
    served by ``serve_arms`` as the logged server ran (``log``: its k cap and max_model_len; ``sampling``: the log's
    {"temperature", "top_p"}), judged by ``verdict`` with ``refit``'s settings ``rs``."""
    prompts = [r["tokens"][: r["prompt_len"]] for r in requests.values()]
    lengths = [len(r["tokens"]) - r["prompt_len"] for r in requests.values()]
    greedy = float(sampling.get("temperature") or 0.0) == 0.0
    got = serve_arms(model_dir, arms, prompts, max_tokens=max(lengths), k_cap=int(log["k_cap"]),
                     max_model_len=int(log["max_model_len"]), rounds=rs.served_check_rounds,
                     sampling=None if greedy else sampling)
    judged = verdict(got["per_request"], threshold=rs.served_check_threshold, seed=seed, resamples=rs.resamples,
                     level=rs.level)
    logger.info("served check: candidate/current %.3f [%.3f, %.3f] over %d requests: %s", judged["ratio"],
                *judged["ci"], len(prompts), "passed" if judged["accepted"] else "failed")
    out, run_order = got["outputs"], [e["arm"] for e in got["engines"]]
    drift = "" if rs.served_check_rounds > 1 else " (one after the other: a machine's drift is not balanced)"
    how = "greedy" if greedy else f"sampled at {sampling}"
    mode = (f"served: a real vLLM engine ({got['vllm']}) per arm and round, requests one at a time, {how}, up to "
            f"{max(lengths)} tokens; engines in the order {', '.join(run_order)}{drift}")
    return {"requests": len(prompts), "mode": mode, "order": run_order, "max_tokens": max(lengths),
            "sampling": None if greedy else sampling,
            "identical_across_arms": sum(a == b for a, b in zip(out["candidate"], out["current"])),
            "same_length_as_served": sum(len(t) == n for t, n in zip(out["candidate"], lengths)),
            **judged,
            "engines": got["engines"],
            "per_request": {"request": list(requests), "served_tokens": lengths, **got["per_request"]}}


def report_lines(s: dict) -> list[str]:
    """refit.md's lines for the served check ``s`` (refit.json's ``served_check``)."""
    if "skipped" in s:
        return ["", f"Served check: not run ({s['skipped']})."]
    spt = s["seconds_per_token"]
    return ["", (f"Served check: {s['requests']} held-out requests, {s['mode']}; identical across arms: "
                 f"{s['identical_across_arms']}, as long as served: {s['same_length_as_served']}"), "",
            "| arm | ms per output token |", "|---|---:|",
            *(f"| {arm} | {1000 * spt[arm]:.2f} |" for arm in ARMS), "",
            (f"Served candidate / current: {s['ratio']:.3f} [{s['ci'][0]:.3f}, {s['ci'][1]:.3f}] (tokens/s, paired "
             f"bootstrap over the served requests): {'passed' if s['accepted'] else 'failed'}, the upper end "
             f"{'at least' if s['accepted'] else 'below'} refit.served_check_threshold={s['threshold']}.")]
