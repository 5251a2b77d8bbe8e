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

from sacpolicy.decoding.sampling import SamplingConfig, select_token

logger = logging.getLogger(__name__)

# Called after each drafted token with (position in block, that position's draft logits [V]); True stops the block.
StopFn = Callable[[int, torch.Tensor], bool]


@dataclass
class DraftBlock:
    tokens: torch.Tensor  # [k] long, on the target's device
    logits: torch.Tensor | None  # [k, V] raw draft logits the tokens were chosen from; None = deterministic proposal

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


class ModelDrafter:
    """Any causal LM sharing the target's tokenizer, drafting autoregressively with its own KV cache.

    Cache invariant: after ``accept`` the cache holds exactly the first ``_valid`` committed tokens. A proposal feeds
    the committed tokens not yet cached (usually the one token the target emitted last), then each drafted token but
    the last, so after a step the cache holds context + drafts[:-1] and rolling back is one crop.
    """

    def __init__(self, model: nn.Module, name: str = "model"):
        self.model = model
        self.name = name
        self.vocab_size = int(model.get_output_embeddings().out_features)
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
            step_logits = out.logits[0, -1]
            tok = select_token(step_logits, sampling, generator)
            tokens.append(tok)
            logits.append(step_logits)
            if i + 1 == k or (stop is not None and stop(i, step_logits)):
                break
            feed = tok.view(1)
        self._valid = context.shape[0]
        self._pending = max(len(tokens) - 1, 0)
        if not tokens:
            return DraftBlock.empty(context.device)
        return DraftBlock(torch.stack(tokens), torch.stack(logits))

    def accept(self, n_accepted: int) -> None:
        keep = min(n_accepted, self._pending)
        if self._cache is not None and self._pending > keep:
            self._cache.crop(-(self._pending - keep))
        self._valid += keep
        self._pending = 0


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
    # Shallow copies with their own module tables: replacing .layers / .model below leaves the target untouched.
    view_inner = copy.copy(inner)
    view_inner._modules = dict(inner._modules)
    view_inner.layers = nn.ModuleList(list(layers)[:num_layers])
    view_inner.config = cfg
    view = copy.copy(model)
    view._modules = dict(model._modules)
    view.model = view_inner
    view.config = cfg
    return view


class LayerSkipDrafter(ModelDrafter):
    """Self-speculation: the target's first L layers + final norm + LM head, sharing the target's weights."""

    def __init__(self, target: nn.Module, num_layers: int, name: str | None = None):
        super().__init__(truncated_view(target, num_layers), name=name or f"layerskip-{num_layers}")
        self.num_layers = num_layers


class NgramDrafter:
    """Prompt lookup decoding: find the most recent earlier occurrence of the context's last n tokens (longest n
    first, ``max_ngram`` down to ``min_ngram``) and propose the tokens that followed it."""

    vocab_size = None

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, name: str = "ngram"):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"n-gram sizes need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram, self.min_ngram, self.name = max_ngram, min_ngram, name

    def reset(self) -> None:
        pass

    @torch.inference_mode()
    def propose(self, context, k, sampling, generator=None, stop=None) -> DraftBlock:
        L = context.shape[0]
        for n in range(min(self.max_ngram, L - 1), self.min_ngram - 1, -1):
            # windows of context[:-1] so every match has at least one following token
            windows = context[: L - 1].unfold(0, n, 1)
            hits = (windows == context[L - n :]).all(-1).nonzero()
            if hits.numel():
                start = int(hits[-1, 0]) + n
                return DraftBlock(context[start : start + k].clone(), None)
        return DraftBlock.empty(context.device)

    def accept(self, n_accepted: int) -> None:
        pass
