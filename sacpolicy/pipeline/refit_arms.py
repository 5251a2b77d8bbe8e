"""The arms of stage ``refit`` (``sacpolicy.pipeline.refit``) on the held-out requests and their comparison: each arm
(the candidate, the current policy, the best static, the oracle) replayed over the logged sequences with the run's
cost model (``replay``), or decoded live in our decoder to the served lengths (``check_live``, ``decode_live``), and
the ratios of their tokens/s with paired bootstrap intervals over the requests (``compare``).
"""

from __future__ import annotations

from sacpolicy.pipeline.context import PipelineError, RunContext
from sacpolicy.pipeline.refit_inputs import logged_requests

ARMS = ("candidate", "current", "best-static")


def replay(ctx: RunContext, policy, test: dict, log: dict, drafters: list[str]) -> dict:
    """{"tokens", "seconds"} per held-out request (``test``'s order) of ``policy`` (a policy directory, replayed as
    the server runs it: ``served_config``; a best-static {"drafter", "k"}; or "oracle": ``traces.simulate.Oracle`` over
    the served drafters, the ceiling any policy reaches on them), seconds from the run's cost model."""
    from sacpolicy.decoding import DecoderConfig
    from sacpolicy.policy import Static
    from sacpolicy.policy.learned import LearnedPolicy
    from sacpolicy.runtime.artifact import load_artifact
    from sacpolicy.traces.served_replay import served_config
    from sacpolicy.traces.simulate import Oracle, simulate

    k_cap = int(log["k_cap"])
    if isinstance(policy, dict):
        pol, config = Static(int(policy["k"]), policy["drafter"]), DecoderConfig(k_max=k_cap)
    elif policy == "oracle":  # the ceiling: the served drafters' accepted runs known in advance
        pol, config = Oracle(ctx.cost, k_max=k_cap), DecoderConfig(k_max=k_cap)
    else:
        rule = load_artifact(policy).rule
        pol, config = LearnedPolicy(rule), served_config(rule, k_cap, int(log["max_model_len"]))
    sim = simulate(pol, test, ctx.cost, vocab_size=ctx.vocab_size, config=config, drafters=drafters)
    return {"tokens": [len(out.tokens) for _, out in sim.results],
            "seconds": [float(out.total_s) for _, out in sim.results]}


def check_live(rs, meta: dict) -> None:
    """Refuse live arms the log cannot support: no repeat, or a sampled log (the live arms decode greedily)."""
    if rs.live_repeats < 1:
        raise PipelineError(f"refit.live_repeats={rs.live_repeats}: each live request needs at least one "
                            "decode per arm; set refit.live_repeats=1 or more")
    if float((meta.get("sampling") or {}).get("temperature") or 0.0) > 0:
        raise PipelineError("refit.live_requests decodes the held-out requests greedily, but this log's requests "
                            f"were sampled ({meta['sampling']}); set refit.live_requests=0 (the simulated "
                            "comparison covers sampled logs)")


def decode_live(ctx: RunContext, arms: dict, ids: list, specs: list, k_cap: int, max_model_len: int,
                repeats: int = 1) -> tuple[dict, dict]:
    """({arm: {"tokens", "seconds"}}, agreement) of each arm (a policy directory or a best static {"drafter", "k"})
    decoding the held-out requests ``ids`` live in our decoder with the served drafters (``specs``, ``DrafterSpec``s,
    built by ``build.build_drafters``, fresh per arm; a suffix drafter's global index grows with the arm's own
    outputs, request by request, and every repeat of a request starts from the index as it stood before the request,
    so no repeat reads its own answer): each request's logged prompt,
    to the length the server generated, prompt by prompt with the arms in turn (machine noise hits all alike), after
    one warm-up generation each; wall seconds per request, the fastest of ``repeats`` (a shared machine's stalls hit
    one repeat, not all). Greedy: every arm must emit the same tokens (lossless;
    otherwise an error), and ``agreement`` counts the requests whose tokens equal what the server logged (vLLM's
    kernels may round differently: reported, not required) and, per arm, the requests that dropped a drafter (it
    raised, and the arm decoded on without it: ``dropped_drafters``, {arm: {drafter: requests}})."""
    import time

    from sacpolicy.build import build_drafters
    from sacpolicy.decoding import DecoderConfig, SpeculativeDecoder
    from sacpolicy.evaluation.metrics import dropped_counts
    from sacpolicy.policy import Static
    from sacpolicy.policy.learned import LearnedPolicy
    from sacpolicy.runtime.artifact import load_artifact
    from sacpolicy.traces.served_replay import served_config

    reqs = logged_requests(ctx)
    target = ctx.target

    def decoder(policy):  # each arm as the server runs it (served_config: the server's k cap and room), as replay does
        if isinstance(policy, dict):
            pol, config = Static(int(policy["k"]), policy["drafter"]), DecoderConfig(k_max=k_cap)
        else:
            rule = load_artifact(policy).rule
            pol, config = LearnedPolicy(rule), served_config(rule, k_cap, int(max_model_len))
        return SpeculativeDecoder(target.model, build_drafters(specs, target), pol, config=config,
                                  stop_token_ids=target.eos_token_ids)

    decoders = {arm: decoder(p) for arm, p in arms.items()}
    first = reqs[ids[0]]
    for dec in decoders.values():  # first calls pay for lazy initialisation
        dec.generate(first["tokens"][: first["prompt_len"]], 8)
    per = {arm: {"tokens": [], "seconds": []} for arm in arms}
    lost = {arm: [] for arm in arms}  # per request, the drafters it dropped in any repeat
    same_as_logged = 0
    for rid in ids:
        req = reqs[rid]
        prompt, served = req["tokens"][: req["prompt_len"]], req["tokens"][req["prompt_len"]:]
        outs, best, dropped = {}, dict.fromkeys(decoders, float("inf")), {arm: set() for arm in decoders}
        before = {arm: _learned(dec) for arm, dec in decoders.items()}
        for r in range(repeats):  # arms in turn, the order reversed every repeat (ABC CBA ...)
            for arm in (list(decoders) if r % 2 == 0 else list(decoders)[::-1]):
                if r:
                    _restore(decoders[arm], before[arm])
                t0 = time.perf_counter()
                res = decoders[arm].generate(prompt, len(served))
                best[arm] = min(best[arm], time.perf_counter() - t0)
                outs[arm] = res.tokens
                dropped[arm].update(res.dropped_drafters)
        for arm in decoders:
            per[arm]["seconds"].append(best[arm])
            per[arm]["tokens"].append(len(outs[arm]))
            lost[arm].append(dropped[arm])
        if len({tuple(t) for t in outs.values()}) != 1:
            raise PipelineError(f"request {rid}: the arms decoded different tokens greedily ({outs}); speculation "
                                "must not change the output: this is a decoder bug")
        same_as_logged += outs["candidate"] == served[: len(outs["candidate"])]
    return per, {"identical_across_arms": len(ids), "same_as_logged": int(same_as_logged),
                 "dropped_drafters": {arm: dropped_counts(lost[arm]) for arm in arms}}


def _learned(decoder) -> dict:
    """What ``decoder``'s drafters learned from earlier requests (a suffix drafter's global index), copied."""
    import copy

    from sacpolicy.decoding.protocols import Resettable

    return {name: copy.deepcopy(d.index) for name, d in decoder.drafters.items() if isinstance(d, Resettable)}


def _restore(decoder, learned: dict) -> None:
    import copy

    for name, index in learned.items():
        decoder.drafters[name].index = copy.deepcopy(index)


def compare(per: dict, *, seed: int, resamples: int, level: float) -> dict:
    """The candidate's tokens/s over the current policy's and over the best static's, the current's over the best
    static's and, where ``per`` has it, the oracle's over the best static's (the headroom the served drafters leave),
    each with a paired bootstrap interval over the held-out requests (one draw for all)."""
    from sacpolicy.evaluation.intervals import bootstrap_indices, paired_ratio_interval

    idx = bootstrap_indices(len(per["candidate"]["tokens"]), resamples=resamples, seed=seed)
    out = {}
    for a, b in (("candidate", "current"), ("candidate", "best-static"), ("current", "best-static"),
                 ("oracle", "best-static")):
        if a not in per:  # the oracle: simulated arms only
            continue
        lo, hi = paired_ratio_interval(per[a]["tokens"], per[a]["seconds"], per[b]["tokens"], per[b]["seconds"],
                                       idx=idx, level=level)
        ratio = tokens_per_s(per[a]) / tokens_per_s(per[b])
        out[f"{a}_vs_{b}".replace("-", "_")] = {"ratio": ratio, "ci": [lo, hi]}
    return out


def tokens_per_s(arm: dict) -> float:
    """An arm's tokens/s over its requests: all its tokens over all its seconds."""
    return sum(arm["tokens"]) / sum(arm["seconds"])

