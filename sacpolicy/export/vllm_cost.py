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

An EAGLE-3 head (``head_steps``): the same engines run vLLM's ``eagle3`` method at each k >= 1; a step's seconds
beyond the fixed-block step's at the same k and B are the head's drafting in vLLM (its pass over the tokens the step
accepted, then k - 1 more). ``head_draft_costs`` fits them as a per-proposal plus a per-token cost at one row and a
per-row share g(B) at each B > 1, and ``vllm_cost_model`` puts them in place of the head's draft costs, so the rule's
k-by-batch-size map for the head is priced by vLLM's own steps.
"""

from __future__ import annotations

import dataclasses
import statistics

from sacpolicy.runtime.cost import CostModel, PiecewiseLinear

__all__ = ["FixedBlockProposer", "IdleProposer", "eagle3_config", "fixed_block_config", "head_draft_costs",
           "idle_config", "profile_vllm_idle", "profile_vllm_steps", "profile_vllm_verify", "step_seconds",
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


class IdleProposer:
    """vLLM ``custom_class`` proposer that never drafts: a server with speculation on and nothing proposed, to time
    what vLLM's speculative path costs a step before any draft (``bench_serve.py --configs spec-idle``)."""

    def __init__(self, vllm_config, *args, **kwargs):
        pass

    def propose(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=None) -> list[list[int]]:
        return [[] for _ in sampled_token_ids]

    def load_model(self, *args, **kwargs) -> None:
        pass


def idle_config(k: int = 8) -> dict:
    """vLLM's ``speculative_config`` with speculation on (up to k tokens, as the learned rule's export) and
    ``IdleProposer``: nothing ever drafted."""
    return {"method": "custom_class", "num_speculative_tokens": int(k), "model": f"{__name__}.{IdleProposer.__name__}"}


def fixed_block_config(k: int) -> dict | None:
    """vLLM's ``speculative_config`` for k drafted tokens per step (None: no speculation)."""
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    return None if k == 0 else {"method": "custom_class", "num_speculative_tokens": k,
                                "model": f"{__name__}.{FixedBlockProposer.__name__}"}


def eagle3_config(head, k: int) -> dict:
    """vLLM's ``speculative_config`` for an EAGLE-3 head (speculators format) drafting k tokens per step."""
    if k < 1:
        raise ValueError(f"an EAGLE-3 head drafts k >= 1 tokens per step, got {k}")
    return {"method": "eagle3", "model": str(head), "num_speculative_tokens": int(k)}


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
                       max_tokens: int = 48, repeats: int = 1, run=None,
                       config=fixed_block_config) -> dict[int, dict[int, list[float]]]:
    """{B: {k: [step seconds per repeat]}}: one engine per k and repeat, the repeats interleaved over k (k0, k1, ...,
    k0, k1, ...) so the machine's drift hits every k alike; each engine times B = 1 (one request at a time) and every
    larger B (waves of B requests, the prompts cycled to fill them). ``run``: ``run_engine`` (a stand-in in tests);
    ``config``: k -> vLLM's ``speculative_config`` (default: fixed blocks; ``partial(eagle3_config, head)``: a head)."""
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
            res = run(model_dir, prompts, max_tokens=max_tokens, speculative_config=config(k), **kw)
            out[1][k].append(step_seconds(res)["step_s"])
            for b in wide:
                out[b][k].append(step_seconds(res, f"concurrent:{b}", rows=b)["step_s"])
    return out


def profile_vllm_idle(model_dir, prompts: list[list[int]], batch_sizes=(1,), *, k: int = 8, max_tokens: int = 48,
                      repeats: int = 1, run=None) -> dict[int, dict[str, list[float]]]:
    """{B: {"none": [step seconds per repeat], "idle": [...]}}: a step without speculation beside one with
    speculation on (up to k tokens, as the learned rule's export) and nothing drafted (``idle_config``), engines
    interleaved (none, idle, none, idle, ...): what vLLM's speculative path costs a step before any draft."""
    by_b = profile_vllm_steps(model_dir, prompts, (0, 1), batch_sizes, max_tokens=max_tokens, repeats=repeats,
                              run=run, config={0: None, 1: idle_config(k)}.get)
    return {b: {"none": v[0], "idle": v[1]} for b, v in by_b.items()}


def profile_vllm_verify(model_dir, prompts: list[list[int]], ks=(0, 1, 2, 4, 8), *, max_tokens: int = 48,
                        repeats: int = 1, run=None) -> dict:
    """{k: [step seconds per repeat]} at one request (``profile_vllm_steps`` at B = 1)."""
    return profile_vllm_steps(model_dir, prompts, ks, (1,), max_tokens=max_tokens, repeats=repeats, run=run)[1]


def head_draft_costs(fixed: dict, head: dict) -> dict:
    """The head's drafting in vLLM from step seconds with it (``head``: {B: {k: [seconds]}}, k >= 1) and with fixed
    blocks (``fixed``: the same shape, the same ks): the median difference at each B and k, fitted at one row as
    ``fixed_s + k * per_token_s`` (least squares over k, both floored at 0 and 1e-6 s) and at each B > 1 as the
    per-row share g(B) = difference / (B * one row's), averaged over k: {"per_token_s", "fixed_s", "share": {B: g},
    "diff_s": {B: {k: s}}}."""
    diff = {int(b): {int(k): statistics.median(head[b][k]) - statistics.median(fixed[b][k])
                     for k in head[b] if int(k) >= 1 and k in fixed.get(b, {})} for b in head}
    one = diff.get(1, {})
    if not one:
        raise ValueError("the head's vLLM profile needs batch size 1 at some k >= 1 with a fixed-block step at the "
                         f"same k; got head ks {sorted(head.get(1, {}))} and fixed ks {sorted(fixed.get(1, {}))}")
    ks = sorted(one)
    if len(ks) == 1:
        slope, intercept = one[ks[0]] / ks[0], 0.0
    else:
        mk, my = statistics.fmean(ks), statistics.fmean(one[k] for k in ks)
        slope = sum((k - mk) * (one[k] - my) for k in ks) / sum((k - mk) ** 2 for k in ks)
        intercept = my - slope * mk
    per_token, fixed_s = max(1e-6, slope), max(0.0, intercept)
    share = {}
    for b, by_k in sorted(diff.items()):
        if b > 1 and by_k:
            share[b] = max(0.05, statistics.fmean(d / (b * (fixed_s + k * per_token)) for k, d in by_k.items()))
    return {"per_token_s": per_token, "fixed_s": fixed_s, "share": share, "diff_s": diff}


def vllm_cost_model(base: CostModel, steps: dict, mean_context: float, *, meta: dict | None = None,
                    batch_steps: dict | None = None, head: str | None = None,
                    head_steps: dict | None = None) -> CostModel:
    """``base`` with its B = 1 verify curve replaced by vLLM's median step seconds at k + 1 tokens fed (``steps``:
    {k: [seconds]}), and its batch curves by vLLM's at every profiled B > 1 (``batch_steps``: {B: {k: [seconds]}};
    None: no batch curves, as vLLM was not profiled over batch sizes). The context term stays ``base``'s: a curve is
    stored at context 0 (measured at ``mean_context``, minus that term), so the model still charges longer contexts
    more; at B > 1 the term is ``base``'s at that B where profiled, else B times its one-row term (every row reads
    its own cache). ``head``, ``head_steps``: the head's drafter name and vLLM's step seconds with it ({B: {k:
    [seconds]}}): its draft costs become vLLM's (``head_draft_costs``). The pass is priced by the tokens it feeds
    (``verify_pass="total"``): the rows of a step draft unequal k and vLLM feeds only their tokens."""
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
    draft, per_token, fixed, share = dict(base.draft), dict(base.per_token_draft), dict(base.draft_fixed), \
        dict(base.draft_batch)
    if head_steps:
        if head is None:
            raise ValueError("head_steps needs head=: the name of the policy's feature drafter they time")
        fixed_steps = {1: steps, **{int(b): v for b, v in (batch_steps or {}).items()}}
        h = head_draft_costs(fixed_steps, {int(b): v for b, v in head_steps.items()})
        draft[head], per_token[head] = PiecewiseLinear([0.0], [h["per_token_s"]]), True
        fixed[head] = PiecewiseLinear([0.0], [h["fixed_s"]])
        share.pop(head, None)
        if h["share"]:
            share[head] = PiecewiseLinear([1.0, *h["share"]], [1.0, *h["share"].values()])
        info.update(vllm_head=head, vllm_head_step_s={str(b): {str(k): v for k, v in by_k.items()}
                                                      for b, by_k in sorted(head_steps.items())},
                    vllm_head_draft={k: v for k, v in h.items() if k != "diff_s"})
    # vLLM flattens a step's tokens into one pass: it costs the tokens fed (rows of unequal k priced as the profiled
    # step at their mean width; ``CostModel.verify_total_time``)
    return dataclasses.replace(base, verify=verify, batch=batch, meta=info, step_base=0.0, step_draft={},
                               draft=draft, per_token_draft=per_token, draft_fixed=fixed, draft_batch=share,
                               verify_pass="total")
