"""A learned policy in vLLM.

Static: ``speculative_config(artifact)`` is the ``speculative_config`` (``LLM(..., speculative_config=...)`` or
``vllm serve --speculative-config``) of the rule's static choice (``sacpolicy.export.static_k``): its fallback
drafter and k (the best static setting on validation traces), or, when that one is autoregressive or a layer-skip
drafter (no vLLM method), its model or n-gram drafter fastest at the reference state, as
``{"method": "draft_model", "model": <draft dir>, "num_speculative_tokens": k}`` or
``{"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": .., "prompt_lookup_min": ..}``.
``write_vllm_config`` writes it as JSON.

Learned, per request: ``PolicyNgramProposer`` is a vLLM custom proposer class (experimental vLLM hook
``{"method": "custom_class", "model": "sacpolicy.export.vllm.PolicyNgramProposer", "num_speculative_tokens": <cap>}``,
policy directory in the ``SACPOLICY_POLICY_DIR`` environment variable). Each step, for each request, it plans k with
the rule from the request's context length and proposes that many tokens by sacpolicy's n-gram lookup (the drafter
the rule was trained with), or none when the rule prefers autoregressive decoding. The hook is duck-typed (a
constructor taking ``VllmConfig`` and ``propose``), so this module never imports vLLM. The hook gives no request
ids, so the acceptance-history features stay unknown, as at a request's first block; model drafters in vLLM keep
the static k (vLLM offers no per-request draft-length hook for them).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import numpy as np

from sacpolicy.export import pick_drafter, static_k
from sacpolicy.io import write_json
from sacpolicy.runtime.artifact import ArtifactError, PolicyArtifact, load_artifact
from sacpolicy.runtime.features import RowContext, plan_rows
from sacpolicy.runtime.ngram import ngram_confidence, ngram_match
from sacpolicy.runtime.rule import DecisionRule

logger = logging.getLogger(__name__)

VLLM_KINDS = ("model", "ngram")
POLICY_ENV = "SACPOLICY_POLICY_DIR"


def speculative_config(artifact, draft_dir=None, *, drafter: str | None = None) -> dict:
    """vLLM's ``speculative_config`` for the rule's static choice (``drafter``: another of its drafters; layer-skip
    drafters have no vLLM method). ``draft_dir`` overrides the model drafter's path (e.g. where the draft lives on
    the serving machine)."""
    art = artifact if isinstance(artifact, PolicyArtifact) else load_artifact(artifact)
    name = pick_drafter(art.rule, art.drafters, drafter, VLLM_KINDS)
    spec, k = art.drafters[name], static_k(art.rule, name)
    if k < 1:
        logger.warning("the policy at %s expects no speedup from drafter %r at any k; exporting the minimum k=1 "
                       "(consider serving without speculative decoding)", art.path, name)
        k = 1
    if spec.kind == "ngram":
        return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": spec.max_ngram,
                "prompt_lookup_min": spec.min_ngram}
    return {"method": "draft_model", "model": str(draft_dir or spec.path), "num_speculative_tokens": k}


def write_vllm_config(artifact_dir, out_path, draft_dir=None) -> Path:
    """``speculative_config(artifact_dir, draft_dir)`` as JSON at ``out_path`` (atomically)."""
    return write_json(out_path, speculative_config(artifact_dir, draft_dir))


def draft_length(rule: DecisionRule, drafter: str, context_len: int, k_cap: int, *, load: float = 0.0,
                 category: str | None = None, confidence: tuple[float, float, float] | None = None) -> int:
    """The rule's k for one request about to draft on top of ``context_len`` tokens (0: decode without drafts).
    ``confidence``: the peeked proposal's (top-1, entropy, margin), shared by all its tokens (n-gram match length)."""
    k_cap = min(k_cap, rule.k_max)
    if k_cap < 1:
        return 0
    ctx = RowContext(context_len=context_len, drafter_index=rule.drafters.index(drafter), load=load,
                     category=category, peek=confidence)
    return rule.plan({drafter: np.array(plan_rows(ctx, k_cap))}, context_len, k_cap)[1]


class PolicyNgramProposer:
    """vLLM ``custom_class`` proposer: n-gram proposals, k per request from the learned rule."""

    def __init__(self, vllm_config, policy=None, drafter: str | None = None):
        policy = policy or os.environ.get(POLICY_ENV)
        if not policy:
            raise ArtifactError(f"PolicyNgramProposer needs a policy artifact: set {POLICY_ENV}=<artifact dir>")
        art = policy if isinstance(policy, PolicyArtifact) else load_artifact(policy)
        self.rule, self.drafter = art.rule, pick_drafter(art.rule, art.drafters, drafter, ("ngram",))
        spec = art.drafters[self.drafter]
        self.max_ngram, self.min_ngram = spec.max_ngram, spec.min_ngram
        self.k_cap = vllm_config.speculative_config.num_speculative_tokens
        self.max_model_len = vllm_config.model_config.max_model_len

    def propose(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=None) -> list[list[int]]:
        out = []
        for i in range(len(sampled_token_ids)):
            n = int(num_tokens_no_spec[i])
            context = np.asarray(token_ids_cpu[i, :n])
            m = ngram_match(context, self.max_ngram, self.min_ngram)
            if m is None:
                out.append([])
                continue
            conf = ngram_confidence(m[1], self.max_ngram)  # the drafter's peek: match length
            k = draft_length(self.rule, self.drafter, n, min(self.k_cap, self.max_model_len - n - 1), confidence=conf)
            out.append(context[m[0] : m[0] + k].tolist())
        return out

    def load_model(self, *args, **kwargs) -> None:
        pass  # nothing to load: vLLM calls this on every proposer
