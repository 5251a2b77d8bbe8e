"""The logged policy replayed over production traces as the served proposer ran it (``replay_logged``): its accepted
tokens per step set beside the logged ones, so a log proves the policy it names, and a refit replays its arms as the
server would run them (``AsServed``).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from sacpolicy.policy.base import Policy, PolicyRow
from sacpolicy.traces.logformat import StepLogError


def replay_logged(trace_dir, policy) -> dict:
    """Replay ``policy`` (the logged one: an artifact path or ``PolicyArtifact``) over ``trace_dir/tf`` as the
    served proposer saw each request (``AsServed``) and set its accepted tokens per step beside the logged ones in
    ``trace_dir/live``: {"replayed": {id: [...]}, "logged": {id: [...]}, "mismatched": [ids]}. Exact for greedy logs
    of a proposer that planned each row alone; sampled logs (replayed in expectation only) are refused, and so is a
    load-aware proposer's (``SACPOLICY_PROPOSER_LOAD``), which planned a step's rows together, as a replay of one
    request cannot."""
    from sacpolicy.decoding import DecoderConfig
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
    grouped = group_traces(load_traces(trace_dir / "tf"), meta)
    served = AsServed(LearnedPolicy(art.rule), tuple(log["rule_drafters"]), log["k_cap"], log["max_model_len"])
    sim = simulate(served, grouped, art.rule.cost, vocab_size=int(meta["vocab_size"] or 0) or _vocab(grouped),
                   config=DecoderConfig(k_max=max(art.rule.k_max, log["k_cap"])))
    logged: dict = {}
    for r in sorted(load_traces(trace_dir / "live"), key=lambda r: (r["prompt_id"], r["step"])):
        logged.setdefault(r["prompt_id"], []).append(r["accepted"])
    replayed = {pid: acc for pid, (_, acc) in sim.per_prompt.items()}
    return {"replayed": replayed, "logged": logged,
            "mismatched": sorted(p for p in replayed if replayed[p] != logged.get(p, []))}


def _vocab(grouped: dict) -> int:
    return 1 + max(max(c["target_token"]) for p in grouped.values() for c in p["drafters"].values())


class AsServed(Policy):
    """A policy seen through the served proposer's eyes, for a replay (``replay_logged``): the request knows the
    rule's drafters (vLLM serves one of them, as when a decoder drops the others), no category, each row is priced
    alone, and room for a block is what the server had (``min(k_cap, max_model_len - context - 1)``: the proposer
    cannot see a request's ``max_tokens``; the replay's decoder still stops at the logged sequence's end, where the
    logged block's accepted tokens end too)."""

    def __init__(self, policy, drafters: tuple[str, ...], k_cap: int, max_model_len: int):
        self.inner, self.drafters, self.k_cap, self.max_model_len = policy, drafters, k_cap, max_model_len
        self.name, self.uses_peeks = policy.name, policy.uses_peeks
        self.needs_token_feedback = policy.needs_token_feedback

    def validate(self, drafters, k_max) -> None:
        for name in drafters:
            self.inner.rule.check_drafter(name)

    def start(self, request):
        return self.inner.start(request)

    def _row(self, row):
        s = row.state
        room = min(self.k_cap, self.max_model_len - s.context_len - 1)
        state = replace(s, request=replace(s.request, drafters=self.drafters, category=None), remaining=room + 1,
                        batch_size=1, load=None)
        return PolicyRow(state, row.memory)

    def decide(self, rows):
        return self.inner.decide([self._row(r) for r in rows])

    def should_stop(self, row, token) -> bool:
        return self.inner.should_stop(self._row(row), token)

    def observe(self, row, record) -> None:
        self.inner.observe(self._row(row), record)
