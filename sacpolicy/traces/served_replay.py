"""The logged policy replayed over production traces as the served proposer ran it (``replay_logged``): its accepted
tokens per step set beside the logged ones, so a log proves the policy it names, and a refit replays its arms as the
server would run them (``served_config``: the decoder planning through the proposer's ``ServedView``, so the replay
and the server run one controller and cannot drift apart).
"""

from __future__ import annotations

from pathlib import Path

from sacpolicy.decoding import DecoderConfig
from sacpolicy.decoding.controller import ServedView
from sacpolicy.traces.logformat import StepLogError


def replay_logged(trace_dir, policy, learn: bool = True) -> dict:
    """Replay ``policy`` (the logged one: an artifact path or ``PolicyArtifact``) over ``trace_dir/tf`` as the
    served proposer saw each request (``served_config``) and set its accepted tokens per step beside the logged ones in
    ``trace_dir/live``: {"replayed": {id: [...]}, "logged": {id: [...]}, "mismatched": [ids]}. Exact for greedy logs
    of a proposer that planned each row alone; sampled logs (replayed in expectation only) are refused, and so is a
    load-aware proposer's (``SACPOLICY_PROPOSER_LOAD``), which planned a step's rows together, as a replay of one
    request cannot. So is a policy that learned while serving (``DecisionRule.online``): the server taught it steps of
    many requests interleaved, which a replay of one request after another cannot reproduce; ``learn=False`` replays
    its fitted rule alone (then steps may differ where the served one had learned)."""
    from sacpolicy.policy.learned import LearnedPolicy
    from sacpolicy.runtime.artifact import PolicyArtifact, load_artifact
    from sacpolicy.traces.schema import load_traces, read_meta
    from sacpolicy.traces.simulate import group_traces, simulate

    trace_dir = Path(trace_dir)
    meta = read_meta(trace_dir / "tf")
    log = meta["log"]
    if float(meta.get("sampling", {}).get("temperature", 0.0)) > 0:
        raise StepLogError(f"{trace_dir} holds sampled requests: the served tokens were drawn at random, so a replay "
                           "reproduces their accepted counts in expectation, not step for step. Replay logs of greedy "
                           "requests (temperature 0) to check a policy step for step")
    if log["load_aware"]:
        raise StepLogError(f"{trace_dir} was logged by a load-aware proposer, which plans a step's rows together; a "
                           "replay of one request cannot reproduce that. Serve with SACPOLICY_PROPOSER_LOAD=0 for "
                           "exactly replayable logs")
    art = policy if isinstance(policy, PolicyArtifact) else load_artifact(policy)
    if learn and art.rule.online is not None:
        raise StepLogError(f"{art.path} learns while serving (its rule's online settings): the server taught it the "
                           "steps of many requests interleaved, which a replay of one request after another cannot "
                           "reproduce step for step. Replay its fitted rule with replay_logged(..., learn=False), or "
                           "log a policy fitted without online learning (fit.online=null)")
    grouped = group_traces(load_traces(trace_dir / "tf"), meta)
    config = served_config(art.rule, log["k_cap"], log["max_model_len"])
    sim = simulate(LearnedPolicy(art.rule, online=False if not learn else None), grouped, art.rule.cost,
                   vocab_size=int(meta["vocab_size"] or 0) or _vocab(grouped), config=config)
    logged: dict = {}
    for r in sorted(load_traces(trace_dir / "live"), key=lambda r: (r["prompt_id"], r["step"])):
        logged.setdefault(r["prompt_id"], []).append(r["accepted"])
    replayed = {pid: acc for pid, (_, acc) in sim.per_prompt.items()}
    return {"replayed": replayed, "logged": logged,
            "mismatched": sorted(p for p in replayed if replayed[p] != logged.get(p, []))}


def served_config(rule, k_cap: int, max_model_len: int, drafters: tuple[str, ...] | None = None) -> DecoderConfig:
    """The decoder settings that run ``rule``'s policy as the served proposer ran it (a replay of its log, a refit's
    arms): through the same ``ServedView`` the proposer's controller plans with (the rule's ``drafters`` on offer, no
    category, each row priced alone, room for at most ``k_cap`` tokens before ``max_model_len``: the proposer cannot
    see a request's ``max_tokens``; the replay's decoder still stops at the logged sequence's end, where the logged
    block's accepted tokens end too)."""
    view = ServedView(tuple(rule.drafters if drafters is None else drafters), int(k_cap), int(max_model_len))
    return DecoderConfig(k_max=max(rule.k_max, int(k_cap)), view=view)


def _vocab(grouped: dict) -> int:
    return 1 + max(max(c["target_token"]) for p in grouped.values() for c in p["drafters"].values())
