"""Each peer policy (``sacpolicy.policy.peers``) tuned the way its users tune it: a small grid over the knobs its
engine documents, every setting replayed with the cost model on VALIDATION traces (``simulate``), the fastest kept,
as ``best_static`` picks a static k. ``tune_peer`` is handed validation traces only and sees nothing else, so a peer's
rate on test traces is as held out as the learned policy's (whose rule is tuned on the same split).

The replay decodes one request at a time (batch size 1): of a per-batch-size setting (SGLang's slots, TensorRT-LLM's
``draft_len_schedule``, vLLM's ``num_speculative_tokens_per_batch_size``) only the batch-size-1 part is tuned.
"""

from __future__ import annotations

import logging

from sacpolicy.policy import (
    AdaEDL,
    LlamaCppPMin,
    Policy,
    SglangAdaptive,
    TrtllmAdaptive,
    VllmAdaptiveVerification,
    VllmBatchSchedule,
)
from sacpolicy.policy.peers import SGLANG_DEFAULT_CONFIG
from sacpolicy.runtime.cost import CostModel
from sacpolicy.traces.simulate import simulate

__all__ = ["PEERS", "build_peer", "peer_grid", "tune_peer"]

logger = logging.getLogger(__name__)

PEERS = {"sglang": SglangAdaptive, "trtllm": TrtllmAdaptive, "vllm_schedule": VllmBatchSchedule,
         "vllm_adaptive": VllmAdaptiveVerification, "llamacpp": LlamaCppPMin, "adaedl": AdaEDL}


def _sglang_config(tiers: list[int], down: float, k_max: int) -> dict:
    """SGLang's default adaptive config with slot 1's tiers and down-hysteresis set, every tier capped at k_max."""
    cfg = {b: {**e, "candidate_steps": sorted({min(s, k_max) for s in e["candidate_steps"]})}
           for b, e in SGLANG_DEFAULT_CONFIG.items()}
    cfg["1"] = {**cfg["1"], "candidate_steps": sorted({min(s, k_max) for s in tiers}), "down_hysteresis": down}
    return cfg


def peer_grid(name: str, k_max: int) -> list[dict]:
    """The settings ``tune_peer`` tries for peer ``name``: its constructor's keyword arguments, defaults first."""
    ks = [k for k in (1, 2, 3, 4, 6, 8, 12, 16) if k <= k_max]
    if name == "sglang":  # the code's default tiers, the docs' [1, 3, 7], and denser or cheaper ladders
        tiers = ([1, 3, 5, 7], [1, 3, 7], [1, 2, 4, 8], [1, 2, 3], [0, 1, 2, 4])
        return [{"config": _sglang_config(t, down, k_max), "initial_steps": min(3, k_max)}
                for t in tiers for down in (-0.25, 0.0)]
    if name == "trtllm":
        gates = ((None, None), (16, 0.3), (16, 0.5), (64, 0.3))
        return [{"max_draft_len": k, "acceptance_rate_window_size": w, "acceptance_rate_threshold": t}
                for k in ks for w, t in gates]
    if name == "vllm_schedule":
        return [{"num_speculative_tokens_per_batch_size": [[1, 1, k]]} for k in range(1, k_max + 1)]
    if name == "vllm_adaptive":
        return [{"num_speculative_tokens": k} for k in range(1, k_max + 1)]
    if name == "llamacpp":  # p_min: llama.cpp's 0.75 and the 0.9 it shipped before; draft_max up to 16
        return [{"p_min": p, "draft_max": k} for p in (0.75, 0.9, 0.5) for k in sorted({*ks[1:], k_max})]
    if name == "adaedl":
        return [{"gamma": g, "threshold": t, "k": k_max} for g in (0.3, 0.1, 1.0) for t in (0.4, 0.2, 0.6)]
    raise ValueError(f"unknown peer {name!r}; peers: {sorted(PEERS)}")


def build_peer(name: str, settings: dict, cost: CostModel, drafter: str | None = None) -> Policy:
    """Peer ``name`` with ``settings`` (one of ``peer_grid``'s), drafting with ``drafter`` (None: the decoder's first);
    ``cost``: the profiled cost model adaptive verification budgets with."""
    if name not in PEERS:
        raise ValueError(f"unknown peer {name!r}; peers: {sorted(PEERS)}")
    extra = {"cost": cost} if name == "vllm_adaptive" else {}
    return PEERS[name](**settings, **extra, drafter=drafter)


def tune_peer(name: str, grouped_val: dict, cost: CostModel, *, vocab_size: int, drafter: str | None = None,
              k_max: int = 8, config=None) -> tuple[Policy, dict, float]:
    """(policy, settings, tokens/s): the setting of ``peer_grid(name, k_max)`` whose replay over ``grouped_val``
    (validation traces, ``group_traces``) is fastest under ``cost``, ties to the earlier, and that rate. The policy is
    built anew from the settings: what a learning peer learnt replaying validation traces does not carry over, as an
    engine starts afresh. ``drafter``: replay that drafter only (None: the traces' drafters, the first drafting)."""
    if not grouped_val:
        raise ValueError(f"tune_peer({name!r}): no validation traces to tune on; collect traces over val prompts")
    best = None
    for settings in peer_grid(name, k_max):
        tps = simulate(build_peer(name, settings, cost, drafter), grouped_val, cost, vocab_size=vocab_size,
                       config=config, drafters=[drafter] if drafter else None).tokens_per_s
        if best is None or tps > best[1]:
            best = (settings, tps)
    settings, tps = best
    logger.info("peer %s tuned on %d validation prompts: %s (%.1f tokens/s simulated)", name, len(grouped_val),
                settings, tps)
    return build_peer(name, settings, cost, drafter), settings, tps
