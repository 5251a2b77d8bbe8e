"""Drafter specs become drafters: the one place configs and artifacts turn into decoding objects (and touch files).

    spec = DrafterSpec(kind="ngram", name="ngram", max_ngram=3)      # or instantiate(cfg.draft.ngram)
    drafter = build_drafter(spec, target)                              # target: a sacpolicy.models.LoadedModel
    drafters = build_drafters(load_artifact(path), target)             # a policy's drafters, in its rule's order
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from sacpolicy.decoding.drafters import LayerSkipDrafter, ModelDrafter, trim_lm_head
from sacpolicy.decoding.lookup import LOOKUP_KINDS, lookup_drafter
from sacpolicy.runtime.weights import read_safetensors
from sacpolicy.runtime.artifact import ArtifactError, PolicyArtifact, load_artifact
from sacpolicy.runtime.spec import VOCAB_MAP_FILE, DrafterSpec  # noqa: F401  (VOCAB_MAP_FILE: where it was)

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
HEAD_FILES = ["config.json", "*.safetensors", "*.safetensors.index.json", "pytorch_model.bin*"]


def build_drafter(spec: DrafterSpec, target):
    """The drafter ``spec`` describes, on ``target``'s device and dtype (``target``: a ``LoadedModel``)."""
    if spec.kind in LOOKUP_KINDS:
        return lookup_drafter(spec)
    if spec.kind == "layer_skip":
        return LayerSkipDrafter(target.model, int(spec.layers), name=spec.name)
    if spec.kind == "feature":
        from sacpolicy.decoding.feature import load_feature_drafter

        return load_feature_drafter(target, head_dir(spec.path), name=spec.name, tree=spec.tree,
                                    tree_width=spec.tree_width)
    return model_drafter(target, spec.path, name=spec.name)


def build_drafters(source, target) -> list:
    """The drafters ``source`` describes, in its order, on ``target`` (a ``LoadedModel``). ``source``: drafter specs
    (any iterable of ``DrafterSpec``: a run's ``RunContext.drafter_specs()``, ``artifact_specs(...)`` for a subset of
    a policy's drafters), or a policy artifact (a ``PolicyArtifact`` or its directory): all its drafters, in the order
    its rule was trained with, for ``SpeculativeDecoder(target.model, drafters, LearnedPolicy(artifact.rule))``."""
    if isinstance(source, (PolicyArtifact, str, Path)):
        source = artifact_specs(source)
    return [build_drafter(s, target) for s in source]


def artifact_specs(policy, names=None) -> list[DrafterSpec]:
    """The drafter specs of a policy artifact (a ``PolicyArtifact`` or its directory) in its rule's drafter order;
    ``names``: a subset of them (default: all)."""
    art = policy if isinstance(policy, PolicyArtifact) else load_artifact(policy)
    names = list(art.rule.drafters if names is None else names)
    unknown = [n for n in names if n not in art.drafters]
    if unknown:
        raise ArtifactError(f"policy artifact {art.path} has no drafter {unknown}; its drafters are "
                            f"{list(art.drafters)}. Build one of those, or re-export the policy with this drafter")
    return [art.drafters[name] for name in sorted(names, key=art.rule.drafters.index)]


def head_dir(path: str) -> Path:
    """A local EAGLE-3 head directory for ``path``: the path itself, or for a hub id (``yuhuili/EAGLE3-...``) that is no
    local path, its config and weights in the Hugging Face cache (downloaded once; ``HF_HUB_OFFLINE=1`` reads the
    cache only)."""
    local = Path(path).expanduser()
    if local.exists() or not HUB_ID.match(str(path)):
        return local
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(str(path), allow_patterns=HEAD_FILES))
    except Exception as e:  # no network, no such repository, a gated one
        raise FileNotFoundError(f"{path!r} is no local directory, and as a Hugging Face hub id it could not be "
                                f"fetched ({type(e).__name__}: {e}). Fix: download the head (config.json and its "
                                "weights) on a machine with access and pass its directory") from e


def load_vocab_map(model_dir) -> torch.Tensor | None:
    """The trimmed vocabulary's ``d2t`` map of a draft directory, None without one."""
    from safetensors.torch import load_file

    from sacpolicy.models import ModelSpecError

    path = Path(model_dir) / VOCAB_MAP_FILE
    return read_safetensors(path, load_file, ModelSpecError)["d2t"].long() if path.is_file() else None


def model_drafter(target, spec: str, name: str = "draft", seed: int = 0, trim: bool = True) -> ModelDrafter:
    """Load a draft model from any model spec (see ``sacpolicy.models``) on the target's device and dtype, after
    checking that it shares the target's tokenizer. A draft directory with a vocab map (a distilled draft with a
    trimmed vocabulary) drafts with its trimmed head unless ``trim=False``. A draft scoring fewer ids than the target
    (Qwen2.5-0.5B for Qwen2.5-7B) drafts over the target's first ids, its logits padded to the target's vocabulary,
    once its tokenizer is found to hold the target's tokens at the ids it has; one scoring more is refused."""
    from sacpolicy.models import check_tokenizers_compatible, load_model

    draft = load_model(spec, device=target.device, dtype=target.dtype, seed=seed)
    vocab = int(target.model.get_output_embeddings().out_features)
    smaller = int(draft.model.get_output_embeddings().out_features) < vocab
    check_tokenizers_compatible(target.tokenizer, draft.tokenizer, target_name=target.spec, draft_name=spec,
                                prefix=smaller)
    d2t = load_vocab_map(spec) if trim else None
    if d2t is None:
        return ModelDrafter(draft.model, name=name, vocab_size=vocab)
    return ModelDrafter(trim_lm_head(draft.model, d2t), name=name, d2t=d2t, vocab_size=vocab)
