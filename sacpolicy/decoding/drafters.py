"""Drafters: propose up to k tokens after a committed context. The protocol is ``sacpolicy.decoding.types.Drafter``;
here are the token-level implementations (a draft model, the target's own first layers, prompt lookup). Building
them from configs lives in ``sacpolicy.build``.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import nn

from sacpolicy.decoding.compat import with_cache
from sacpolicy.decoding.layout import attention_layout
from sacpolicy.decoding.protocols import Drafter, Peekable
from sacpolicy.decoding.sampling import draft_stats, select_token
from sacpolicy.decoding.teacher import TeacherForced, TeacherForcing
from sacpolicy.decoding.types import DraftBlock, DraftRow
from sacpolicy.runtime.features import Peek, peek_of
from sacpolicy.runtime.ngram import MAX_NGRAM, MIN_NGRAM, ngram_confidence, ngram_match

_MAX_BATCHED_FEED = 8  # committed tokens a row may feed its draft in a batched proposal (more: it proposes alone)


@dataclass
class ModelDraftState:
    """A model drafter's row: its KV cache and how much of the row's context it holds."""

    cache: object = None  # the draft's own KV cache (None until the row's first proposal)
    valid: int = 0  # committed tokens whose KV is cached
    pending: int = 0  # drafted tokens fed into the cache during the last proposal


class ModelDrafter(Drafter, TeacherForcing):
    """Any causal LM sharing the target's tokenizer, drafting autoregressively with a KV cache per row.

    Cache invariant: after ``accept`` a row's cache holds exactly its first ``valid`` committed tokens. A proposal
    feeds the committed tokens not yet cached (usually the one token the target emitted last), then each drafted token
    but the last, so after a step the cache holds context + drafts[:-1] and rolling back is one crop.

    Rows whose caches are warm draft together, one forward of the draft per drafted token over all of them (their
    caches stacked into one ragged cache, ``RaggedCache``; a row leaves it, back to its own cache, when its block
    ends). A row whose cache is empty or far behind its context (the request's first proposal), or a row drafting
    alone, runs through the draft by itself.

    Trimmed vocabulary (EAGLE-3's d2t, FR-Spec): when the model's LM head scores only a subset of the target's
    tokens, ``d2t[i]`` is the target id of draft logit i. Draft logits are scattered into the target's vocabulary with
    -inf elsewhere, so q(x) = 0 for tokens the draft cannot propose and verification stays exact.

    Smaller vocabulary (a Qwen2.5-0.5B draft, 151,936 ids, for a 7B target, 152,064): with ``vocab_size=`` the
    target's and no ``d2t``, a draft whose LM head scores fewer ids is taken to score the target's first ids (the
    condition: its token id i is the target's id i for every i it has; ``sacpolicy.build.model_drafter`` checks the
    tokenizers agree on those ids). Its logits are padded with -inf to the target's width (q = 0 for the ids it
    lacks), so verification stays exact; a committed id the draft has no embedding for (the target may emit one)
    is read by the draft as its last id: worse proposals after it, never a wrong output.
    """

    def __init__(self, model: nn.Module, name: str = "model", d2t: torch.Tensor | None = None,
                 vocab_size: int | None = None):
        attention_layout(getattr(model, "config", None), role="draft")  # a family it cannot run: refused here
        self.model = model
        self.name = name
        head = int(model.get_output_embeddings().out_features)
        self.d2t = None
        self.vocab_size = head
        self.pad = 0  # target ids past the draft's head (a smaller-vocabulary draft): their logits are -inf
        self.max_input_id = None  # the draft's last embedded id, when the target has ids past it
        if d2t is None and vocab_size is not None and vocab_size != head:
            if head > vocab_size:
                raise ValueError(
                    f"draft {name!r} scores {head} token ids but the target's vocabulary has {vocab_size}: it could "
                    f"propose ids the target does not have. Fix: pick a draft whose vocabulary is the target's or a "
                    f"prefix of it (same tokenizer, at most {vocab_size} ids), e.g. a smaller model of the target's "
                    "family, or use the n-gram or layer-skip drafters")
            self.pad, self.vocab_size = vocab_size - head, vocab_size
            embedded = int(model.config.vocab_size)  # rows of the draft's input embedding (HF convention)
            self.max_input_id = embedded - 1 if embedded < vocab_size else None
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

    def new_state(self) -> ModelDraftState:
        return ModelDraftState()

    def _new_cache(self):
        """The row's cache: every token of every layer kept (``ragged.new_cache``), so a rollback is one crop on
        sliding-window layers too."""
        from sacpolicy.decoding.ragged import new_cache

        return new_cache(self.model.config)

    @torch.inference_mode()
    def propose(self, rows: list[DraftRow]) -> list[DraftBlock]:
        out: list[DraftBlock | None] = [None] * len(rows)
        together = []
        for i, row in enumerate(rows):
            st = row.state
            if st.pending:  # the previous proposal was never settled: drop its drafts
                self.accept(st, 0)
            if row.k <= 0:
                out[i] = DraftBlock.empty(row.context.device)
            elif st.cache is None or st.valid == 0 or row.context.shape[0] - st.valid > _MAX_BATCHED_FEED:
                out[i] = self._propose_alone(row)
            else:
                together.append(i)
        if len(together) == 1:
            out[together[0]] = self._propose_alone(rows[together[0]])
        elif together:
            for i, block in zip(together, self._propose_together([rows[i] for i in together])):
                out[i] = block
        return out

    def _propose_alone(self, row: DraftRow) -> DraftBlock:
        """One row through the draft, with the row's own cache (filled from its context when empty)."""
        st, context = row.state, row.context
        if st.cache is None:
            st.cache = self._new_cache()
        feed = self.draft_ids(context[st.valid :])
        tokens, logits = [], []
        for i in range(row.k):
            out = self.model(input_ids=feed.view(1, -1), **with_cache(self.model, st.cache), use_cache=True,
                             logits_to_keep=1)
            step_logits = self.full_logits(out.logits[0, -1])
            tok = select_token(step_logits, row.sampling, row.generator)
            tokens.append(tok)
            logits.append(step_logits)
            if i + 1 == row.k or (row.stop is not None and row.stop(i, draft_stats(step_logits))):
                break
            feed = tok.view(1)
        st.valid = context.shape[0]
        st.pending = max(len(tokens) - 1, 0)
        return DraftBlock(torch.stack(tokens), torch.stack(logits))

    def _propose_together(self, rows: list[DraftRow]) -> list[DraftBlock]:
        """Rows with warm caches, one forward of the draft per drafted token over all of them."""
        from sacpolicy.decoding.ragged import RaggedCache

        device, dtype = rows[0].context.device, next(self.model.parameters()).dtype
        feeds = [self.draft_ids(row.context[row.state.valid :]) for row in rows]
        cache = RaggedCache.stack([row.state.cache for row in rows], [row.state.valid for row in rows], device,
                                  self.model.config)
        live = list(range(len(rows)))  # rows still drafting, in cache order
        tokens: list[list] = [[] for _ in rows]
        logits: list[list] = [[] for _ in rows]
        T = max(f.shape[0] for f in feeds)
        ids = torch.stack([torch.cat([f, f[-1:].expand(T - f.shape[0])]) for f in feeds])
        last = [f.shape[0] - 1 for f in feeds]
        while live:
            step = self.model(input_ids=ids, **with_cache(self.model, cache.cache), use_cache=True,
                              logits_to_keep=T, **cache.inputs(T, dtype)).logits
            cache.commit([j + 1 for j in last], T)  # row r fed last[r] + 1 tokens
            done, nxt = [], []
            for r, i in enumerate(live):
                row = rows[i]
                step_logits = self.full_logits(step[r, last[r]])
                tok = select_token(step_logits, row.sampling, row.generator)
                tokens[i].append(tok)
                logits[i].append(step_logits)
                n = len(tokens[i])
                if n == row.k or (row.stop is not None and row.stop(n - 1, draft_stats(step_logits))):
                    done.append(r)
                else:
                    nxt.append(tok)
            for r in done:  # the row's cache now holds its context and its drafts but the last
                st = rows[live[r]].state
                st.cache, st.valid = cache.row_cache(r, self.model.config), rows[live[r]].context.shape[0]
                st.pending = len(tokens[live[r]]) - 1
            keep = [r for r in range(len(live)) if r not in done]
            live = [live[r] for r in keep]
            if live:
                cache.select(keep)
                ids, T, last = torch.stack(nxt).view(-1, 1), 1, [0] * len(live)
        return [DraftBlock(torch.stack(t), torch.stack(lg)) for t, lg in zip(tokens, logits)]

    def draft_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """Target token ids -> ids the draft embeds: unchanged, but for a smaller-vocabulary draft the ids past its
        embedding (which it cannot read) become its last id."""
        return ids if self.max_input_id is None else ids.clamp(max=self.max_input_id)

    def full_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft logits [..., head] -> [..., vocab_size] over the target's ids (-inf where a trimmed or smaller
        draft has no logit); unchanged for a full-vocabulary draft."""
        if self.pad:
            return torch.nn.functional.pad(logits, (0, self.pad), value=float("-inf"))
        if self.d2t is None:
            return logits
        full = logits.new_full((*logits.shape[:-1], self.vocab_size), float("-inf"))
        return full.index_copy_(-1, self.d2t, logits)

    @torch.inference_mode()
    def teacher_force(self, ids, start, k_max, aux=None) -> TeacherForced:
        """One batched pass over the true sequence: row g is the draft's next token after ``ids[:start + g]``."""
        G = ids.shape[0] - start
        logits = self.model(input_ids=self.draft_ids(ids).view(1, -1), logits_to_keep=G + 1).logits[0, :-1]
        logits = self.full_logits(logits.float())
        return TeacherForced(logits.argmax(-1, keepdim=True), chained=False, logits=logits)

    def accept(self, state: ModelDraftState, n_accepted: int) -> None:
        keep = min(n_accepted, state.pending)
        if state.cache is not None and state.pending > keep:
            state.cache.crop(-(state.pending - keep))
        state.valid += keep
        state.pending = 0


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


@dataclass
class NgramState:
    """An n-gram drafter's row: the match of its last ``peek``, reused by the proposal that follows."""

    peeked: tuple | None = None  # (context length, match or None)


class NgramDrafter(Drafter, Peekable):
    """Prompt lookup decoding: find the most recent earlier occurrence of the context's last n tokens (longest n
    first, ``max_ngram`` down to ``min_ngram``) and propose the tokens that followed it.

    Its confidence in a proposal is the matched length: top-1 = margin = n / max_ngram, entropy 0 (a longer matched
    suffix predicts the continuation better), reported to ``stop`` for each token so a policy may cut the block.
    """

    vocab_size = None

    def __init__(self, max_ngram: int = MAX_NGRAM, min_ngram: int = MIN_NGRAM, name: str = "ngram"):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"n-gram sizes need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram, self.min_ngram, self.name = max_ngram, min_ngram, name

    def new_state(self) -> NgramState:
        return NgramState()

    def _match(self, context) -> tuple[int, int] | None:
        return ngram_match(context.cpu().numpy(), self.max_ngram, self.min_ngram)

    def peek(self, state: NgramState | None, context) -> Peek | None:
        """The proposal ``propose`` would make now (``Peek``: one confidence for each token of the span it would
        copy, and its first token), None when it would propose nothing: a lookup as cheap as the proposal, so a
        policy may choose between drafting and not before it drafts."""
        m = self._match(context)
        if state is not None:
            state.peeked = (context.shape[0], m)
        return None if m is None else peek_of(ngram_confidence(m[1], self.max_ngram), context.shape[0] - m[0],
                                              int(context[m[0]]))

    @torch.inference_mode()
    def propose(self, rows: list[DraftRow]) -> list[DraftBlock]:
        return [self._propose(row) for row in rows]

    def _propose(self, row: DraftRow) -> DraftBlock:
        context, st = row.context, row.state
        peeked = st.peeked if st is not None else None
        if st is not None:
            st.peeked = None
        m = peeked[1] if peeked is not None and peeked[0] == context.shape[0] else self._match(context)
        if m is None or row.k <= 0:
            return DraftBlock.empty(context.device)
        start, n = m
        tokens = context[start : start + row.k].clone()
        stats = torch.tensor(ngram_confidence(n, self.max_ngram))
        for i in range(tokens.shape[0] - 1):
            if row.stop is not None and row.stop(i, stats):
                tokens = tokens[: i + 1]
                break
        return DraftBlock(tokens, None, stats.to(context.device).expand(tokens.shape[0], 3))


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
