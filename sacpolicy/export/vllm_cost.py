"""A cost model measured inside vLLM, so a rule exported to vLLM is tuned on the engine that will run it.

Our decoder's cost model (``sacpolicy.profiling``) times transformers forwards. vLLM's engine costs differently: its
step grows less with the tokens it verifies than a transformers forward does (docs/benchmarks.md, "vLLM engine"), so a
rule tuned on our costs drafts less than vLLM rewards.

``profile_vllm_steps`` runs one engine per block length k: k = 0 without speculation, k >= 1 with
``FixedBlockProposer``, which drafts exactly k tokens at every decode step, so every step verifies k + 1 tokens per
request. A step's seconds are a phase's seconds over its engine steps (tokens generated minus drafts accepted, over
the rows stepping together: each step emits one token of its own per row plus what it accepted). Batch size 1 is the
serial phase; a batch size B > 1 is a phase of waves of B requests that all run to ``max_tokens`` (``ignore_eos``),
so the engine steps B rows at a time. ``vllm_cost_model`` puts those into the run's cost model in place of its verify
curves (B = 1 and every profiled B), keeping its context term (shifted to the prompts' mean context) and its
drafting costs, so the learned rule prices a step at vLLM's live batch size (the custom proposer passes it):

    python scripts/profile_vllm.py --run runs/vllm_ngram --out runs/vllm_ngram_vcost --batch-sizes 1,4,16
    python scripts/train.py experiment=vllm_ngram "stages=[fit,export]" from_run=runs/vllm_ngram \\
        hydra.run.dir=runs/vllm_ngram_vcost
"""

from __future__ import annotations

import dataclasses
import statistics

from sacpolicy.runtime.cost import CostModel, PiecewiseLinear

__all__ = ["FixedBlockProposer", "fixed_block_config", "profile_vllm_steps", "profile_vllm_verify", "step_seconds",
           "vllm_cost_model"]


class FixedBlockProposer:
    """vLLM ``custom_class`` proposer for profiling: exactly ``num_speculative_tokens`` drafts at every decode step
    (the row's last sampled token, repeated), none during a prefill chunk."""

    def __init__(self, vllm_config, *args, **kwargs):
        self.k = int(vllm_config.speculative_config.num_speculative_tokens)
        self.max_model_len = int(vllm_config.model_config.max_model_len)

    def propose(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=None) -> list[list[int]]:
        return [[int(s[-1])] * self.k if len(s) and int(n) + self.k < self.max_model_len else []
                for s, n in zip(sampled_token_ids, num_tokens_no_spec)]

    def load_model(self, *args, **kwargs) -> None:
        pass


def fixed_block_config(k: int) -> dict | None:
    """vLLM's ``speculative_config`` for k drafted tokens per step (None: no speculation)."""
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    return None if k == 0 else {"method": "custom_class", "num_speculative_tokens": k,
                                "model": f"{__name__}.{FixedBlockProposer.__name__}"}


def step_seconds(result: dict, phase: str = "serial", rows: int = 1) -> dict:
    """Per-step seconds of one ``run_engine`` phase whose engine steps ``rows`` requests together:
    {"steps", "seconds", "step_s", "drafts"}."""
    tokens, spec = result["tokens"][phase], result["spec"][phase]
    steps = (tokens - spec["num_accepted_tokens"]) / rows
    if steps < 1:
        raise ValueError(f"the {phase} phase generated no tokens: nothing to time")
    seconds = result["seconds"][phase]
    return {"steps": steps, "seconds": seconds, "step_s": seconds / steps, "drafts": spec["num_drafts"]}


def profile_vllm_steps(model_dir, prompts: list[list[int]], ks=(0, 1, 2, 4, 8), batch_sizes=(1,), *,
                       max_tokens: int = 48, repeats: int = 1, run=None) -> dict[int, dict[int, list[float]]]:
    """{B: {k: [step seconds per repeat]}}: one engine per k and repeat, the repeats interleaved over k (k0, k1, ...,
    k0, k1, ...) so the machine's drift hits every k alike; each engine times B = 1 (one request at a time) and every
    larger B (waves of B requests, the prompts cycled to fill them). ``run``: ``run_engine`` (a stand-in in tests)."""
    if run is None:
        from sacpolicy.export.vllm_run import run_engine as run
    if not prompts or repeats < 1 or not ks or min(ks) < 0 or min(batch_sizes) < 1:
        raise ValueError("profiling vLLM needs prompts, repeats >= 1, block lengths k >= 0 and batch sizes >= 1")
    wide = sorted({int(b) for b in batch_sizes if b > 1})
    kw = {}
    if wide:
        prompts = [prompts[i % len(prompts)] for i in range(max(wide[-1], len(prompts)))]
        kw = {"phases": ("serial", *(f"concurrent:{b}" for b in wide)), "ignore_eos": True}
    out = {b: {int(k): [] for k in ks} for b in (1, *wide)}
    for _ in range(repeats):
        for k in out[1]:
            res = run(model_dir, prompts, max_tokens=max_tokens, speculative_config=fixed_block_config(k), **kw)
            out[1][k].append(step_seconds(res)["step_s"])
            for b in wide:
                out[b][k].append(step_seconds(res, f"concurrent:{b}", rows=b)["step_s"])
    return out


def profile_vllm_verify(model_dir, prompts: list[list[int]], ks=(0, 1, 2, 4, 8), *, max_tokens: int = 48,
                        repeats: int = 1, run=None) -> dict:
    """{k: [step seconds per repeat]} at one request (``profile_vllm_steps`` at B = 1)."""
    return profile_vllm_steps(model_dir, prompts, ks, (1,), max_tokens=max_tokens, repeats=repeats, run=run)[1]


def vllm_cost_model(base: CostModel, steps: dict, mean_context: float, *, meta: dict | None = None,
                    batch_steps: dict | None = None) -> CostModel:
    """``base`` with its B = 1 verify curve replaced by vLLM's median step seconds at k + 1 tokens fed (``steps``:
    {k: [seconds]}), and its batch curves by vLLM's at every profiled B > 1 (``batch_steps``: {B: {k: [seconds]}};
    None: no batch curves, as vLLM was not profiled over batch sizes). The context term stays ``base``'s: a curve is
    stored at context 0 (measured at ``mean_context``, minus that term), so the model still charges longer contexts
    more; at B > 1 the term is ``base``'s at that B where profiled, else B times its one-row term (every row reads
    its own cache)."""
    per_context = base.verify["per_context"]

    def curve(by_k: dict, per_ctx: float) -> dict:
        ks = sorted(int(k) for k in by_k)
        if 0 not in ks:
            raise ValueError("the vLLM profile needs k = 0 (a step without drafts) for the 1-token cost, at every "
                             "batch size")
        ys = [statistics.median(by_k[k]) - per_ctx * mean_context for k in ks]
        return {"tokens": PiecewiseLinear([k + 1 for k in ks], ys), "per_context": per_ctx}

    verify, batch = curve(steps, per_context), {}
    for b, by_k in sorted((batch_steps or {}).items()):
        if int(b) > 1:
            per_b = base.batch[int(b)]["per_context"] if int(b) in base.batch else per_context * int(b)
            batch[int(b)] = curve(by_k, per_b)
    # vLLM's step seconds are the whole engine step: our decoder's own per-step work (step_base, step_draft) is not
    # vLLM's, so it is left out
    kept = {k: v for k, v in base.meta.items() if not k.startswith("overhead_")}
    info = {**kept, "verify_profiled_in": "vllm", "vllm_mean_context": mean_context,
            "vllm_step_s": {str(k): v for k, v in sorted(steps.items())},
            **({"vllm_batch_step_s": {str(b): {str(k): v for k, v in by_k.items()} for b, by_k in batch_steps.items()}}
               if batch_steps else {}), **(meta or {})}
    return dataclasses.replace(base, verify=verify, batch=batch, meta=info, step_base=0.0, step_draft={})
