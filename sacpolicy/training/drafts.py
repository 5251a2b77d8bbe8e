"""Draft models to distil: the target's first L layers, a fresh small Llama, or any same-tokenizer model; optionally
with a trimmed vocabulary (the draft's LM head scores only the V most frequent target tokens).

A draft is exported as a ``save_pretrained`` directory that ``AutoModelForCausalLM.from_pretrained`` and transformers'
assisted generation load as is (full-vocabulary head: the trained rows scattered into the initial head), plus
``vocab_map.safetensors`` (``d2t``) that sacpolicy's ``ModelDrafter`` uses to draft with the cheap trimmed head.
"""

from __future__ import annotations

import copy
import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from sacpolicy.runtime.spec import VOCAB_MAP_FILE
from sacpolicy.decoding.drafters import trim_lm_head, truncated_view
from sacpolicy.io import write_dir
from sacpolicy.models import LoadedModel, check_tokenizers_compatible, load_model

logger = logging.getLogger(__name__)

DRAFT_META_FILE = "sacpolicy_draft.json"
ARCHS = ("truncate", "fresh", "pretrained")


@dataclass
class DraftModel:
    model: nn.Module  # a causal LM; its LM head has len(d2t) rows when trimmed
    d2t: torch.Tensor | None  # draft logit index -> target token id
    full_head: torch.Tensor | None  # the initial full-vocabulary head, for export of a trimmed draft
    arch: str

    @property
    def vocab_size(self) -> int:
        return int(self.model.get_output_embeddings().out_features)


def select_vocab(token_counts: torch.Tensor, size: int, always: list[int] = ()) -> torch.Tensor:
    """The ``size`` most frequent target ids (plus ``always``, e.g. EOS), sorted: the trimmed draft vocabulary."""
    if not 0 < size <= token_counts.numel():
        raise ValueError(f"trimmed vocabulary size must be in [1, {token_counts.numel()}], got {size}")
    counts = token_counts.double().clone()
    counts[list(always)] = float("inf")
    return torch.topk(counts, size).indices.sort().values


def build_draft(
    target: LoadedModel,
    arch: str = "truncate",
    num_layers: int = 2,
    spec: str | None = None,
    fresh: dict | None = None,
    vocab_size: int | None = None,
    token_counts: torch.Tensor | None = None,
    freeze_embeddings: bool = True,
    seed: int = 0,
) -> DraftModel:
    """(a) ``truncate``: a copy of the target's embeddings, first ``num_layers`` layers, final norm and head;
    (b) ``fresh``: a random-init Llama with ``fresh`` config overrides sharing the target's tokenizer;
    (c) ``pretrained``: any model spec with the target's tokenizer."""
    if arch == "truncate":
        model = copy.deepcopy(truncated_view(target.model, num_layers))
    elif arch == "fresh":
        from transformers import LlamaConfig, LlamaForCausalLM

        tcfg = target.model.config
        cfg = LlamaConfig(**{
            "vocab_size": tcfg.vocab_size, "hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": tcfg.max_position_embeddings,
            "bos_token_id": tcfg.bos_token_id, "eos_token_id": tcfg.eos_token_id, "pad_token_id": tcfg.pad_token_id,
            "tie_word_embeddings": True, **(fresh or {}),
        })
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = LlamaForCausalLM(cfg).to(device=target.device, dtype=target.dtype)
    elif arch == "pretrained":
        if not spec:
            raise ValueError("draft arch 'pretrained' needs spec= a model spec (hub id, directory, .gguf)")
        loaded = load_model(spec, device=target.device, dtype=target.dtype)
        check_tokenizers_compatible(target.tokenizer, loaded.tokenizer, target_name=target.spec, draft_name=spec)
        model = loaded.model
        head, vocab = model.get_output_embeddings().out_features, target.model.get_output_embeddings().out_features
        if head != vocab:  # the distillation losses and the vocab map index the draft's head by target ids
            raise ValueError(f"draft {spec!r} scores {head} token ids, the target {vocab}: distillation needs the "
                             "target's vocabulary size. Fix: decode with this draft as it is (a smaller one is padded "
                             "to the target's vocabulary), or distill a 'truncate' or 'fresh' draft")
    else:
        raise ValueError(f"unknown draft arch {arch!r}; choose one of {list(ARCHS)}")
    model.generation_config = copy.deepcopy(target.model.generation_config)
    d2t = full_head = None
    if vocab_size:
        if token_counts is None:
            raise ValueError("a trimmed draft vocabulary needs token counts from the training data")
        d2t = select_vocab(token_counts, vocab_size, always=[t for t in target.eos_token_ids])
        full_head = model.get_output_embeddings().weight.detach().clone()
        trim_lm_head(model, d2t)
    elif model.config.tie_word_embeddings and freeze_embeddings:
        # a tied head would freeze with the embeddings: give the head its own weights
        head = model.get_output_embeddings()
        model.set_output_embeddings(copy.deepcopy(head))
        model.config.tie_word_embeddings = False
    model.get_input_embeddings().weight.requires_grad_(not freeze_embeddings)
    model.train()
    return DraftModel(model, d2t, full_head, arch)


def export_draft(draft: DraftModel, target: LoadedModel, out_dir: str | Path, meta: dict) -> Path:
    """Write a directory that ``AutoModelForCausalLM.from_pretrained`` loads (full-vocabulary head) plus the vocab
    map and provenance. Written to a temporary sibling and renamed: a half-written draft is never picked up."""
    model = copy.deepcopy(draft.model).eval().to(target.dtype)  # trained in float32: served in the target's dtype
    if draft.d2t is not None:
        full = draft.full_head.clone().to(target.dtype)
        full[draft.d2t] = draft.model.get_output_embeddings().weight.detach().to(target.dtype)
        head = nn.Linear(full.shape[1], full.shape[0], bias=False, device=full.device, dtype=full.dtype)
        head.weight = nn.Parameter(full)
        model.set_output_embeddings(head)
        model.config.tie_word_embeddings = False
    for p in model.parameters():
        p.requires_grad_(False)

    def fill(tmp: Path) -> None:
        model.save_pretrained(tmp, safe_serialization=True)
        target.tokenizer.save_pretrained(tmp)
        if draft.d2t is not None:
            save_file({"d2t": draft.d2t.cpu().contiguous()}, str(tmp / VOCAB_MAP_FILE))
        (tmp / DRAFT_META_FILE).write_text(json.dumps({
            "format": 1, "arch": draft.arch, "target": target.spec,
            "trimmed_vocab": None if draft.d2t is None else draft.d2t.numel(), **meta}, indent=2, default=str))

    out_dir = write_dir(out_dir, fill)
    logger.info("exported draft to %s", out_dir)
    return out_dir
