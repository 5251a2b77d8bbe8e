"""A learned policy in transformers' assisted generation (``model.generate(assistant_model=...)``).

    out, rounds = generate_with_policy(model, input_ids, assistant, "out/policy", max_new_tokens=128)

``PolicyCandidateGenerator`` is transformers' ``AssistedCandidateGenerator`` with the exported rule deciding each
round: before it, ``rule.plan`` chooses k (``num_assistant_tokens`` for the round) or autoregressive decoding (the
generator then returns no candidates and the target decodes one token alone, transformers' own path for an
exhausted draft budget); while the assistant drafts, the rule's stop rule runs as a ``StoppingCriteria`` on the
assistant's ``generate`` (mode "stop"), fed the draft's raw temperature-1 confidence read off its LM head. Every
row comes from ``sacpolicy.runtime.features.feature_row``, as in sacpolicy's own decoder. transformers has no
public hook to choose the candidate generator, so ``generate_with_policy`` overrides the model's
``_get_candidate_generator`` for the one call (not thread-safe on a shared model object).

Decoders without the hook use a static fallback: ``export_generation_config`` writes the rule's static k and a
confidence threshold into the draft directory's ``generation_config.json``, which ``from_pretrained`` picks up.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from transformers import StoppingCriteria, StoppingCriteriaList
from transformers.generation.candidate_generator import AssistedCandidateGenerator

from sacpolicy.decoding.sampling import draft_stats
from sacpolicy.export import (
    REFERENCE_CONTEXT,
    confidence_threshold,
    pick_drafter,
    resolve,
    static_k,
)
from sacpolicy.io import write_json
from sacpolicy.runtime.features import RowContext, accept_rate, feature_row, next_accept_history, plan_rows
from sacpolicy.runtime.rule import Block, DecisionRule

MODEL_KINDS = ("model", "layer_skip")  # drafters an assistant model can stand for


class PolicyCandidateGenerator(AssistedCandidateGenerator):
    """``rounds`` records every round: context length, the planned k (0 = autoregressive), tokens drafted and
    accepted."""

    def __init__(self, *args, rule: DecisionRule, drafter: str, category: str | None = None, load: float = 0.0,
                 **kwargs):
        super().__init__(*args, **kwargs)
        rule.check_drafter(drafter)
        self.rule, self.drafter, self.category, self.load = rule, drafter, category, load
        self.generation_config.assistant_confidence_threshold = 0.0  # the rule, not a threshold, ends a block
        self.accept_history: tuple[float, float] | None = None
        self.rounds: list[dict] = []
        self._block: Block | None = None
        self._prev_top1: float | None = None
        self._logits: torch.Tensor | None = None  # the assistant's raw logits of the token it just drafted

    def _ctx(self, context_len: int) -> RowContext:
        return RowContext(context_len=context_len, drafter_index=self.rule.drafters.index(self.drafter),
                          accept_ema=accept_rate(self.accept_history), load=self.load, category=self.category)

    def get_candidates(self, input_ids: torch.LongTensor, **kwargs):
        n = input_ids.shape[-1]
        k_cap = min(self.rule.k_max, self.main_model_max_length - n - 1)
        rows = {self.drafter: np.array(plan_rows(self._ctx(n), k_cap))} if k_cap > 0 else {}
        name, k = self.rule.plan(rows, n, k_cap)
        self.rounds.append({"context_len": n, "k": k, "drafted": 0, "accepted": 0})
        if name is None:
            return input_ids, None  # no candidates: the target decodes one token alone
        self._block, self._prev_top1 = Block(name, n, k), None
        self.num_assistant_tokens = k
        ids, logits = super().get_candidates(input_ids)
        self.rounds[-1]["drafted"] = ids.shape[-1] - n
        return ids, logits

    def _generate_candidates(self, generation_args: dict):
        if self.rule.mode != "stop":
            return super()._generate_candidates(generation_args)
        generation_args["stopping_criteria"] = StoppingCriteriaList([_RuleStop(self)])
        hook = self.assistant_model.get_output_embeddings().register_forward_hook(self._keep_logits)
        try:
            return super()._generate_candidates(generation_args)
        finally:
            hook.remove()

    def _keep_logits(self, module, inputs, output) -> None:
        self._logits = output[0, -1]

    def should_stop(self) -> bool:
        """The stop rule after the token the assistant just drafted."""
        b = self._block
        stats = tuple(draft_stats(self._logits).tolist())
        ctx = self._ctx(b.context_len)
        row, nxt = feature_row(ctx, b.n, stats, self._prev_top1), feature_row(ctx, b.n + 1, prev_top1=stats[0])
        self._prev_top1 = stats[0]
        return self.rule.stop(b, np.array(row), np.array(nxt))

    def update_candidate_strategy(self, input_ids: torch.LongTensor, scores: torch.Tensor, num_matches: int):
        r = self.rounds[-1]
        if r["drafted"]:
            r["accepted"] = int(num_matches)
            self.accept_history = next_accept_history(self.accept_history, r["accepted"], r["drafted"])


class _RuleStop(StoppingCriteria):
    def __init__(self, generator: PolicyCandidateGenerator):
        self.generator = generator

    def __call__(self, input_ids: torch.LongTensor, scores, **kwargs) -> torch.BoolTensor:
        stop = self.generator.should_stop()
        return torch.full((input_ids.shape[0],), stop, dtype=torch.bool, device=input_ids.device)


def generate_with_policy(model, input_ids, assistant_model, policy, *, drafter: str | None = None,
                         category: str | None = None, load: float = 0.0, **generate_kwargs):
    """``model.generate(input_ids, assistant_model=assistant_model, **generate_kwargs)`` with ``policy`` (an artifact
    directory, a ``PolicyArtifact`` or a ``DecisionRule``) choosing every round. ``drafter``: which of the policy's
    drafters the assistant is (default: its fallback or only model drafter). Returns (generate's output, rounds)."""
    rule, specs = resolve(policy)
    drafter = pick_drafter(rule, specs, drafter, MODEL_KINDS)
    made: list[PolicyCandidateGenerator] = []

    def candidate_generator(generation_config, input_ids, inputs_tensor, logits_processor, model_kwargs,
                            assistant_model=None, **_):
        made.append(PolicyCandidateGenerator(
            input_ids=input_ids, assistant_model=assistant_model, generation_config=generation_config,
            model_kwargs=model_kwargs, inputs_tensor=inputs_tensor, logits_processor=logits_processor, rule=rule,
            drafter=drafter, category=category, load=load))
        return made[-1]

    model._get_candidate_generator = candidate_generator
    try:
        out = model.generate(input_ids, assistant_model=assistant_model, **generate_kwargs)
    finally:
        del model._get_candidate_generator
    return out, made[-1].rounds if made else []


def export_generation_config(policy, draft_dir, *, drafter: str | None = None,
                             context_len: int = REFERENCE_CONTEXT) -> dict:
    """Write the rule's static setting into ``draft_dir/generation_config.json`` (other keys kept, written
    atomically), for stock assisted generation: ``num_assistant_tokens`` = the rule's static k (at least 1),
    ``num_assistant_tokens_schedule`` = "constant", ``assistant_confidence_threshold`` = the draft top-1 below which
    the stop rule ends a block (``sacpolicy.export.confidence_threshold``). Returns the three settings."""
    rule, specs = resolve(policy)
    drafter = pick_drafter(rule, specs, drafter, MODEL_KINDS)
    settings = {"num_assistant_tokens": max(1, static_k(rule, drafter, context_len)),
                "num_assistant_tokens_schedule": "constant",
                "assistant_confidence_threshold": confidence_threshold(rule, drafter, context_len)}
    path = Path(draft_dir) / "generation_config.json"
    if not path.parent.is_dir():
        raise FileNotFoundError(f"draft directory {path.parent} does not exist; pass the directory the draft was "
                                "exported to (save_pretrained)")
    current = json.loads(path.read_text()) if path.is_file() else {}
    write_json(path, current | settings)
    return settings
