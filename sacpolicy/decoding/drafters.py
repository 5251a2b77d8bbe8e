"""Drafters: propose up to k tokens after a committed context. One small protocol, three implementations.

A drafter owns whatever state it keeps between steps (a KV cache, nothing at all) and is told, after verification,
how many of its proposed tokens the target accepted, so it can roll that state back exactly.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass
from typing import Callable, Protocol, runtime_checkable

import torch
from torch import nn

from sacpolicy.decoding.sampling import SamplingConfig, draft_stats, select_token

logger = logging.getLogger(__name__)

# Called after each drafted token with (position in block, draft_stats of that position: [top-1 prob, entropy,
# margin]); True stops the block after this token.
StopFn = Callable[[int, torch.Tensor], bool]


@dataclass
class DraftBlock:
    tokens: torch.Tensor  # [k] long, on the target's device
    logits: torch.Tensor | None  # [k, V] raw draft logits the tokens were chosen from; None = deterministic proposal
    # deterministic proposals only: [k, 3] confidence in the draft_stats layout (top-1, entropy, margin) the drafter
    # assigns its tokens; None = certain ([1, 0, 1])
    confidence: torch.Tensor | None = None

    @property
    def k(self) -> int:
        return int(self.tokens.shape[0])

    @classmethod
    def empty(cls, device: torch.device) -> DraftBlock:
        return cls(torch.empty(0, dtype=torch.long, device=device), None)


@runtime_checkable
class Drafter(Protocol):
    name: str
    vocab_size: int | None  # logits width; None for drafters without a distribution (n-gram)

    def reset(self) -> None:
        """Forget all per-request state; called before each request."""

    def propose(
        self,
        context: torch.Tensor,
        k: int,
        sampling: SamplingConfig,
        generator: torch.Generator | None = None,
        stop: StopFn | None = None,
    ) -> DraftBlock:
        """context [L]: committed tokens (prompt + output so far). Return at most k tokens."""

    def accept(self, n_accepted: int) -> None:
        """The target accepted the first n_accepted tokens of the last proposal."""

    # Optional, for drafters whose proposal is a cheap lookup (n-gram): ``peek(context)`` returns the confidence
    # (top-1, entropy, margin) of the proposal ``propose`` would make now, or None when it would propose nothing.


class ModelDrafter:
    """Any causal LM sharing the target's tokenizer, drafting autoregressively with its own KV cache.

    Cache invariant: after ``accept`` the cache holds exactly the first ``_valid`` committed tokens. A proposal feeds
    the committed tokens not yet cached (usually the one token the target emitted last), then each drafted token but
    the last, so after a step the cache holds context + drafts[:-1] and rolling back is one crop.

    Trimmed vocabulary (EAGLE-3's d2t, FR-Spec): when the model's LM head scores only a subset of the target's
    tokens, ``d2t[i]`` is the target id of draft logit i. Draft logits are scattered into the target's vocabulary with
    -inf elsewhere, so q(x) = 0 for tokens the draft cannot propose and verification stays exact.
    """

    def __init__(self, model: nn.Module, name: str = "model", d2t: torch.Tensor | None = None,
                 vocab_size: int | None = None):
        self.model = model
        self.name = name
        head = int(model.get_output_embeddings().out_features)
        self.d2t = None
        self.vocab_size = head
        if d2t is not None:
            d2t = torch.as_tensor(d2t, dtype=torch.long)
            if vocab_size is None:
                raise ValueError("a trimmed-vocabulary draft needs vocab_size= the target's vocabulary size")
            if d2t.dim() != 1 or d2t.numel() != head:
                raise ValueError(f"vocab map has {d2t.numel()} entries but the draft's LM head has {head} rows")
            if int(d2t.min()) < 0 or int(d2t.max()) >= vocab_size or d2t.unique().numel() != d2t.numel():
                raise ValueError(f"vocab map must hold distinct target ids in [0, {vocab_size})")
            self.d2t = d2t.to(next(model.parameters()).device)
            self.vocab_size = vocab_size
        self.reset()

    def reset(self) -> None:
        self._cache = None
        self._valid = 0  # committed tokens whose KV is cached
        self._pending = 0  # drafted tokens fed into the cache during the last proposal

    def _new_cache(self):
        from transformers import DynamicCache

        return DynamicCache(config=self.model.config)

    @torch.inference_mode()
    def propose(self, context, k, sampling, generator=None, stop=None) -> DraftBlock:
        if k <= 0:
            return DraftBlock.empty(context.device)
        if self._cache is None:
            self._cache = self._new_cache()
        if self._pending:  # the previous proposal was never settled: drop its drafts
            self.accept(0)
        feed = context[self._valid :]
        tokens, logits = [], []
        for i in range(k):
            out = self.model(input_ids=feed.view(1, -1), cache=self._cache, use_cache=True, logits_to_keep=1)
            step_logits = self.full_logits(out.logits[0, -1])
            tok = select_token(step_logits, sampling, generator)
            tokens.append(tok)
            logits.append(step_logits)
            if i + 1 == k or (stop is not None and stop(i, draft_stats(step_logits))):
                break
            feed = tok.view(1)
        self._valid = context.shape[0]
        self._pending = max(len(tokens) - 1, 0)
        if not tokens:
            return DraftBlock.empty(context.device)
        return DraftBlock(torch.stack(tokens), torch.stack(logits))

    def full_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft logits [..., head] -> [..., vocab_size] over the target's ids (-inf where a trimmed draft has no
        logit); unchanged for a full-vocabulary draft."""
        if self.d2t is None:
            return logits
        full = logits.new_full((*logits.shape[:-1], self.vocab_size), float("-inf"))
        return full.index_copy_(-1, self.d2t, logits)

    def accept(self, n_accepted: int) -> None:
        keep = min(n_accepted, self._pending)
        if self._cache is not None and self._pending > keep:
            self._cache.crop(-(self._pending - keep))
        self._valid += keep
        self._pending = 0


def _shallow(module: nn.Module) -> nn.Module:
    """A copy sharing every tensor but with its own module/parameter tables and hook registries, so replacing a
    submodule, or registering a hook on either object later, leaves the other untouched."""
    clone = copy.copy(module)
    for key, value in vars(module).items():
        if key.startswith("_") and isinstance(value, dict):
            setattr(clone, key, type(value)(value))
    return clone


def truncated_view(model: nn.Module, num_layers: int) -> nn.Module:
    """The target's embeddings, first ``num_layers`` decoder layers, final norm and LM head, as a model object that
    shares every weight with ``model`` (no copy of any tensor)."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None or not hasattr(inner, "norm") or model.get_output_embeddings() is None:
        raise ValueError(
            f"layer-skip drafting needs a decoder-only model with .model.layers, .model.norm and an LM head "
            f"(Llama, Mistral, Qwen2, ...); {type(model).__name__} has another layout. Use a ModelDrafter instead."
        )
    total = len(layers)
    if not 1 <= num_layers <= total:
        raise ValueError(f"layer-skip num_layers must be in [1, {total}] for this target, got {num_layers}")
    cfg = copy.deepcopy(model.config)
    cfg.num_hidden_layers = num_layers
    if getattr(cfg, "layer_types", None):
        cfg.layer_types = list(cfg.layer_types)[:num_layers]
    view_inner = _shallow(inner)
    view_inner.layers = nn.ModuleList(list(layers)[:num_layers])
    view_inner.config = cfg
    view = _shallow(model)
    view.model = view_inner
    view.config = cfg
    if getattr(model, "generation_config", None) is not None:  # own copy: assisted generation writes into it
        view.generation_config = copy.deepcopy(model.generation_config)
    return view


class LayerSkipDrafter(ModelDrafter):
    """Self-speculation: the target's first L layers + final norm + LM head, sharing the target's weights."""

    def __init__(self, target: nn.Module, num_layers: int, name: str | None = None):
        super().__init__(truncated_view(target, num_layers), name=name or f"layerskip-{num_layers}")
        self.num_layers = num_layers


class NgramDrafter:
    """Prompt lookup decoding: find the most recent earlier occurrence of the context's last n tokens (longest n
    first, ``max_ngram`` down to ``min_ngram``) and propose the tokens that followed it.

    Its confidence in a proposal is the matched length: top-1 = margin = n / max_ngram, entropy 0 (a longer matched
    suffix predicts the continuation better), reported to ``stop`` for each token so a policy may cut the block.
    """

    vocab_size = None

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, name: str = "ngram"):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"n-gram sizes need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram, self.min_ngram, self.name = max_ngram, min_ngram, name
        self._peeked = None  # (context length, match) of the last peek, reused by the proposal that follows

    def reset(self) -> None:
        self._peeked = None

    def _match(self, context) -> tuple[int, int] | None:
        """(start of the copied span, matched length n) of the longest, most recent match; None without one."""
        L = context.shape[0]
        for n in range(min(self.max_ngram, L - 1), self.min_ngram - 1, -1):
            # windows of context[:-1] so every match has at least one following token
            windows = context[: L - 1].unfold(0, n, 1)
            hits = (windows == context[L - n :]).all(-1).nonzero()
            if hits.numel():
                return int(hits[-1, 0]) + n, n
        return None

    @torch.inference_mode()
    def peek(self, context) -> tuple[float, float, float] | None:
        """The confidence of the proposal ``propose`` would make now, None when it would propose nothing: a lookup
        as cheap as the proposal, so a policy may choose between drafting and not before it drafts."""
        m = self._match(context)
        self._peeked = (context.shape[0], m)
        return None if m is None else (m[1] / self.max_ngram, 0.0, m[1] / self.max_ngram)

    @torch.inference_mode()
    def propose(self, context, k, sampling, generator=None, stop=None) -> DraftBlock:
        peeked, self._peeked = self._peeked, None
        m = peeked[1] if peeked is not None and peeked[0] == context.shape[0] else self._match(context)
        if m is None:
            return DraftBlock.empty(context.device)
        start, n = m
        tokens = context[start : start + k].clone()
        stats = torch.tensor([n / self.max_ngram, 0.0, n / self.max_ngram])
        for i in range(tokens.shape[0] - 1):
            if stop is not None and stop(i, stats):
                tokens = tokens[: i + 1]
                break
        return DraftBlock(tokens, None, stats.to(context.device).expand(tokens.shape[0], 3))

    def accept(self, n_accepted: int) -> None:
        pass


# ---------------------------------------------------------------- builders (Hydra: `_partial_: true`, called with the target)
def _target_model(target) -> nn.Module:
    from sacpolicy.models import LoadedModel

    return target.model if isinstance(target, LoadedModel) else target


def ngram_drafter(target=None, max_ngram: int = 3, min_ngram: int = 1, name: str = "ngram") -> NgramDrafter:
    return NgramDrafter(max_ngram, min_ngram, name=name)


def layer_skip_drafter(target, num_layers: int, name: str | None = None) -> LayerSkipDrafter:
    return LayerSkipDrafter(_target_model(target), num_layers, name=name)


VOCAB_MAP_FILE = "vocab_map.safetensors"  # beside a draft's save_pretrained files when its vocabulary is trimmed


def trim_lm_head(model: nn.Module, d2t: torch.Tensor) -> nn.Module:
    """Replace the LM head by one that scores only the target ids ``d2t`` (rows copied, input embeddings kept)."""
    head = model.get_output_embeddings()
    new = nn.Linear(head.in_features, d2t.numel(), bias=head.bias is not None,
                    device=head.weight.device, dtype=head.weight.dtype)
    with torch.no_grad():
        new.weight.copy_(head.weight[d2t.to(head.weight.device)])
        if head.bias is not None:
            new.bias.copy_(head.bias[d2t.to(head.weight.device)])
    model.set_output_embeddings(new)
    model.config.tie_word_embeddings = False
    return model


def load_vocab_map(model_dir) -> torch.Tensor | None:
    from pathlib import Path

    from safetensors.torch import load_file

    path = Path(model_dir) / VOCAB_MAP_FILE
    return load_file(str(path))["d2t"].long() if path.is_file() else None


def model_drafter(target, spec: str, name: str = "draft", seed: int = 0, trim: bool = True) -> ModelDrafter:
    """Load a draft model from any model spec (see ``sacpolicy.models``) on the target's device and dtype, after
    checking that it shares the target's tokenizer. A draft directory with a vocab map (a distilled draft with a
    trimmed vocabulary) drafts with its trimmed head unless ``trim=False``."""
    from sacpolicy.models import check_tokenizers_compatible, load_model

    draft = load_model(spec, device=target.device, dtype=target.dtype, seed=seed)
    check_tokenizers_compatible(target.tokenizer, draft.tokenizer, target_name=target.spec, draft_name=spec)
    d2t = load_vocab_map(spec) if trim else None
    if d2t is None:
        return ModelDrafter(draft.model, name=name)
    vocab = int(target.model.get_output_embeddings().out_features)
    return ModelDrafter(trim_lm_head(draft.model, d2t), name=name, d2t=d2t, vocab_size=vocab)
