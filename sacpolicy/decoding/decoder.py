"""SpeculativeDecoder: draft k tokens, verify them in one target pass, keep what the target would have produced.

One loop serves every setting: k = 0 (no drafter) is plain autoregressive decoding, so AR and speculative timings
come from the same code, and one request (``generate``) is a batch of one row (``generate_batch``: continuous batching
over B rows, each with its own draft block and accepted prefix, verified together in one target pass; the ragged KV
cache is ``sacpolicy.decoding.ragged``). The decoder never knows which policy it rows; the policy never sees a cache.

The decoder owns every request's state (``sacpolicy.decoding.rows.Row``: its tokens, the policy's memory of it, each
drafter's state); the policy and the drafters are shared by all rows and called once per step with all of them
(``Policy.decide(rows)``, ``Drafter.propose(rows)``). The step (``_step``, this module's second half) rows five
phases in order, each a method whose typed, frozen result the later phases read: decide (``Planned``), draft
(``Drafted``), verify (one target pass and one verification call over the padded blocks of all rows, one read back
to the host: ``Verified``), commit (buffers, caches, drafters' acceptance), observe (the ``StepRecord``, the
acceptance history and cooldown, ``Policy.observe``). Per drafted token statistics are made only on request
(``DecoderConfig.step_stats``, ``sacpolicy.decoding.stats``).

A draft is a chain or a token tree (``Decision.tree``, drafters that ``DraftsTrees``; ``sacpolicy.decoding.tree``):
a tree's nodes are fed as the row's block with a tree attention mask (``RaggedCache.inputs``), walked by
``sampling.verify_tree`` / ``verify_tree_greedy``, and its accepted path's KV entries are moved to the front of the
step's columns before the cache keeps them (``RaggedCache.commit``). Rows with trees and with chains share a batch.

The batching loop and the step it rows are one concept, read together in one module (the review rule in
docs/architecture.md: a module holds one concept, whatever its length).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, replace

import torch
from torch import nn

from sacpolicy.decoding.aux import AuxCapture
from sacpolicy.decoding.compat import cpu_kernels, with_cache
from sacpolicy.decoding.controller import Controller, Drafted, Planned, ServedView, stop_callback
from sacpolicy.decoding.layout import attention_layout
from sacpolicy.decoding.protocols import Autoregressive, Drafter, Policy, PolicyRow, feature_layers
from sacpolicy.decoding.ragged import RaggedCache, new_cache, prefill_inputs
from sacpolicy.decoding.rows import Clock, Row, WallClock
from sacpolicy.decoding.sampling import (
    SamplingConfig,
    draw_uniforms,
    probs_from_logits,
    select_token,
    verify,
    verify_greedy,
    verify_tree,
    verify_tree_greedy,
)
from sacpolicy.decoding.scheduler import schedule
from sacpolicy.decoding.stats import block_stats
from sacpolicy.decoding.types import DecodeState, DraftBlock, GenerationResult, RequestInfo, StepRecord

__all__ = ["BATCH_K", "DecoderConfig", "Drafted", "Planned", "SpeculativeDecoder", "Verified", "WallClock",
           "stop_callback"]

logger = logging.getLogger(__name__)

BATCH_K = ("row", "shared")


@dataclass
class DecoderConfig:
    k_max: int = 16  # largest block a policy may ask for
    # Cooldown: when the moving acceptance rate (EMA over speculative steps, weight ``cooldown_ema`` on the newest)
    # falls below cooldown_floor, decode autoregressively for cooldown_steps steps, then speculate again. None: off.
    cooldown_floor: float | None = None
    cooldown_ema: float = 0.5
    cooldown_steps: int = 8
    cooldown_min_steps: int = 3  # speculative steps observed before the floor applies
    timing: bool = True  # per-step wall times (synchronizes the device once more per step on GPUs)
    # per drafted token statistics in the step records (StepRecord.top1 ... beta): full-vocabulary passes per step that
    # decoding itself never reads; trace studies and tests ask for them
    step_stats: bool = False
    max_batch: int = 1  # rows generate_batch decodes together by default; the live load is rows / max_batch
    batch_k: str = "row"  # "row": each row's own k (blocks padded to the longest); "shared": one k for the batch (vLLM)
    compact_slack: float = 0.25  # compact the batch's KV cache when rejected columns exceed this share of its width
    # the CPU's faster kernels (``compat.cpu_kernels``) for the target and the drafters' models while the decoder
    # decodes, switched back after each call: the same results up to float rounding, and the caller's models are
    # left as they were. On by default because decoding's few-row passes are what they speed up; False keeps
    # transformers' own kernels throughout
    cpu_kernels: bool = True
    tree_max: int = 64  # the most nodes a token tree may have (``Decision.tree``)
    # Joining requests prefill together only while padding to the group's longest prompt adds at most this share of
    # their own tokens; a longer or shorter one starts a group of its own (a pass over pads costs like real tokens).
    # 0: only prompts of one length share a pass
    prefill_pad_slack: float = 0.25
    # plan as a served engine's proposer sees each request (``controller.ServedView``): a replay of its step log
    view: ServedView | None = None

    def __post_init__(self) -> None:
        if not self.prefill_pad_slack >= 0:
            raise ValueError(f"prefill_pad_slack must be >= 0 (the share of padding a joint prefill may add), got "
                             f"{self.prefill_pad_slack}")
        if not isinstance(self.max_batch, int) or self.max_batch < 1:
            raise ValueError(f"decoder max_batch must be an integer >= 1, got {self.max_batch!r}")
        if self.batch_k not in BATCH_K:
            raise ValueError(f"decoder batch_k must be one of {list(BATCH_K)}, got {self.batch_k!r}")
        if self.k_max < 0:
            raise ValueError(f"decoder k_max must be >= 0, got {self.k_max}")
        if self.cooldown_floor is not None and not 0.0 <= self.cooldown_floor <= 1.0:
            raise ValueError(f"cooldown_floor must be in [0, 1] or None, got {self.cooldown_floor}")
        if not 0.0 < self.cooldown_ema <= 1.0:
            raise ValueError(f"cooldown_ema must be in (0, 1], got {self.cooldown_ema}")


@dataclass(frozen=True)
class Verified:
    """A row's verification: drafted tokens accepted, the tokens it commits (the accepted ones and the target's own,
    ending at a stop token, ``stopped``, and at the length limit), the target's own token on the device, and the
    block's per-token statistics [k][6] when the decoder records them (``DecoderConfig.step_stats``)."""

    accepted: int
    new: tuple[int, ...]
    stopped: bool
    target_token: torch.Tensor
    stats: list | None = None
    path: tuple[int, ...] | None = None  # a token tree's accepted nodes (None: a chain's first ``accepted``)

    @property
    def columns(self) -> list[int] | None:
        """The verify pass's columns the row commits (the last committed token's and the accepted path's), when they
        are not its first ``accepted + 1``."""
        return None if self.path is None else [0] + [j + 1 for j in self.path]


def _by_sampling(batch: list[Row]) -> list[tuple[SamplingConfig, list[int]]]:
    """The batch's rows grouped by how their tokens are chosen (seeds aside): one group when all rows share it."""
    groups: dict[tuple, tuple[SamplingConfig, list[int]]] = {}
    for i, row in enumerate(batch):
        cfg = row.sampling
        key = ("greedy",) if cfg.greedy else (cfg.temperature, cfg.top_k, cfg.top_p)
        groups.setdefault(key, (cfg, []))[1].append(i)
    return list(groups.values())


def _pad_rows(x: torch.Tensor, n: int) -> torch.Tensor:
    """``x`` [m, ...] with zero rows appended up to n."""
    return x if x.shape[0] == n else torch.cat([x, x.new_zeros((n - x.shape[0], *x.shape[1:]))])


class SpeculativeDecoder:
    def __init__(
        self,
        target: nn.Module,
        drafters: Sequence[Drafter] | Mapping[str, Drafter] = (),
        policy: Policy | None = None,
        sampling: SamplingConfig | None = None,
        config: DecoderConfig | None = None,
        stop_token_ids: Sequence[int] | None = None,
    ):
        self.target = target
        # the target's attention (full, sliding-window layers): a family the decoder cannot run is refused here
        self.layout = attention_layout(getattr(target, "config", None))
        items = drafters.values() if isinstance(drafters, Mapping) else drafters
        self.drafters: dict[str, Drafter] = {}
        for d in items:
            if d.name in self.drafters:
                raise ValueError(f"two drafters are named {d.name!r}; give each drafter a unique name")
            self.drafters[d.name] = d
        self.policy = policy if policy is not None else Autoregressive()
        self.sampling = sampling or SamplingConfig()
        self.config = config or DecoderConfig()
        self.vocab_size = int(target.get_output_embeddings().out_features)
        for d in self.drafters.values():
            if d.vocab_size is not None and d.vocab_size != self.vocab_size:
                fix = (f"build it with ModelDrafter(draft, vocab_size={self.vocab_size}) (sacpolicy.build."
                       "model_drafter does), which pads its logits to the target's vocabulary"
                       if d.vocab_size < self.vocab_size else
                       "pick a draft whose vocabulary is the target's or a prefix of it")
                raise ValueError(
                    f"drafter {d.name!r} has a vocabulary of {d.vocab_size} tokens but the target has "
                    f"{self.vocab_size}; drafts must share the target's tokenizer (the same id for the same token). "
                    f"Fix: {fix}, or use the n-gram or layer-skip drafters"
                )
        view = self.config.view  # a replay of a served log: the policy knows the rule's drafters, as served
        self.policy.validate(view.drafters if view is not None else tuple(self.drafters), self.config.k_max)
        self.max_context = getattr(target.config, "max_position_embeddings", None)
        if stop_token_ids is None:
            eos = getattr(getattr(target, "generation_config", None), "eos_token_id", None)
            stop_token_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        self.stop_token_ids = frozenset(int(t) for t in stop_token_ids)
        self.device = next(target.parameters()).device
        self.dtype = next(target.parameters()).dtype
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(self.sampling.seed or 0)
        # each drafter's capabilities, read once: peeks before deciding, the target's hidden states after each pass
        self.feature_layers = {n: layers for n, d in self.drafters.items() if (layers := feature_layers(d))}
        self.features = AuxCapture(target, [i for layers in self.feature_layers.values() for i in layers])
        self.clock: Clock = WallClock()  # every time the decoder reads or waits on (a replay sets a virtual one)
        # plan, draft and observe: the one controller, which the served proposer and the replay row too
        self.controller = Controller(self.policy, self.drafters, self.config, self.now, self.config.view)

    # ------------------------------------------------------------------ helpers
    def now(self) -> float:
        if self.config.timing and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return self.clock.now()

    def _prompt(self, input_ids, index: int = 0) -> torch.Tensor:
        ids = torch.as_tensor(input_ids, dtype=torch.long)
        if ids.dim() == 2:
            if ids.shape[0] != 1:
                raise ValueError(
                    f"generate decodes one sequence; got a batch of {ids.shape[0]}. Pass the prompts as a list to "
                    "generate_batch (rows of different lengths need no padding)"
                )
            ids = ids[0]
        if ids.dim() != 1 or ids.numel() == 0:
            raise ValueError(f"empty prompt (request {index}): give at least one token (e.g. the chat template's "
                             "generation prompt)")
        if self.max_context is not None and ids.numel() >= self.max_context:
            raise ValueError(
                f"prompt of request {index} has {ids.numel()} tokens and does not fit the target's context of "
                f"{self.max_context} tokens; truncate it (data.max_prompt_tokens) or use a longer-context target"
            )
        return ids.to(self.device)

    def generate(
        self,
        input_ids,
        max_new_tokens: int = 128,
        *,
        request: RequestInfo | None = None,
        stop_token_ids: Sequence[int] | None = None,
        keep_logits: bool = False,
    ) -> GenerationResult:
        """Decode one prompt. Returns the new tokens (ending at the first stop token, included) and step records.

        ``request``: what the policy may know of the request (category, load) and its sampling seed; the decoder
        fills prompt length, token budget and drafters. ``keep_logits``: also return the target's raw logits behind
        every new token (``result.logits``, [new, V], on the device), the distributions the target's own decode saw:
        trace collection reads them instead of running the target again. The same loop as ``generate_batch`` with
        one row."""
        return self.generate_batch([input_ids], max_new_tokens, requests=[request], stop_token_ids=stop_token_ids,
                                   keep_logits=keep_logits, max_batch=1)[0]

    @torch.inference_mode()
    def generate_batch(
        self,
        prompts: Sequence,
        max_new_tokens: int | Sequence[int] = 128,
        *,
        requests: Sequence[RequestInfo | None] | None = None,
        max_batch: int | None = None,
        arrivals: Sequence[float] | None = None,
        stop_token_ids: Sequence[int] | None = None,
        keep_logits: bool = False,
    ) -> list[GenerationResult]:
        """Decode many prompts, up to ``max_batch`` rows at a time (default ``config.max_batch``) with continuous
        batching: a finished row leaves the batch at once and the next waiting request takes its place. Each row
        drafts its own block; the target verifies all rows in one pass; each row keeps its own accepted prefix, so
        every row's output is what decoding it alone would give.

        ``arrivals``: seconds after the call at which each request arrives (Poisson traces); a request is admitted
        when it has arrived and a row is free, and its ``queued_s`` is the wait. Results come back in input order."""
        B = self.config.max_batch if max_batch is None else max_batch
        if not isinstance(B, int) or B < 1:
            raise ValueError(f"max_batch must be an integer >= 1 (rows decoded together), got {B!r}")
        if not len(prompts):
            raise ValueError("generate_batch needs at least one prompt")
        budgets = [max_new_tokens] * len(prompts) if isinstance(max_new_tokens, int) else list(max_new_tokens)
        requests = [None] * len(prompts) if requests is None else list(requests)
        arrivals = [0.0] * len(prompts) if arrivals is None else [float(a) for a in arrivals]
        if not len(budgets) == len(requests) == len(arrivals) == len(prompts):
            raise ValueError(f"{len(prompts)} prompts need as many token budgets, requests and arrival times; got "
                             f"{len(budgets)}, {len(requests)} and {len(arrivals)}")
        if any(a < 0 for a in arrivals):
            raise ValueError("arrival times are seconds after the call: they must be >= 0")
        stops = self.stop_token_ids if stop_token_ids is None else frozenset(int(t) for t in stop_token_ids)
        rows = [self._new_row(i, p, m, r, a, stops, keep_logits)
                for i, (p, m, r, a) in enumerate(zip(prompts, budgets, requests, arrivals))]
        kernels = cpu_kernels(self.target, self.drafters.values()) if self.config.cpu_kernels else nullcontext()
        with kernels:
            schedule(self, rows, B, self.config.prefill_pad_slack)
        return [row.result for row in rows]

    def _new_row(self, index, input_ids, max_new_tokens, request, arrival, stops, keep_logits) -> Row:
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens} (request {index})")
        prompt = self._prompt(input_ids, index)
        L = prompt.numel()
        request = request or RequestInfo()
        if request.sampling is not None and not isinstance(request.sampling, SamplingConfig):
            raise ValueError(f"request {index}: sampling must be a SamplingConfig (or None for the decoder's), got "
                             f"{type(request.sampling).__name__}")
        # the policy is told the row's sampling settings too (a learned policy checks them against its fit's)
        request = replace(request, prompt_len=L, max_new_tokens=max_new_tokens, drafters=tuple(self.drafters),
                          sampling=request.sampling or self.sampling)
        limit = max_new_tokens if self.max_context is None else min(max_new_tokens, self.max_context - L)
        # a seeded request samples from its own generator; the others continue the decoder's
        generator = self.generator if request.seed is None else torch.Generator(device=self.device)
        row = Row(
            buf=torch.empty(L + limit + self.config.k_max + 1, dtype=torch.long, device=self.device),
            stops=stops, limit=limit, max_new_tokens=max_new_tokens,
            policy=PolicyRow(DecodeState(request, drafters=tuple(self.drafters))), drafts={},
            logits=[] if keep_logits else None, generator=generator,
            arrival=arrival, index=index, sampling=request.sampling,
        )
        row.buf[:L] = prompt
        row.n = L
        return row

    def prefill(self, rows: list[Row]) -> RaggedCache:
        """Admit requests together: prefill their prompts in one target pass and pick each one's first token. -> their
        cache, one row per request in order.

        Prompts of different lengths are left-padded to the longest (``ragged.prefill_inputs``: each prompt's own
        positions, a mask keeping every token to its own prompt), so every row's last position is its prompt's last
        token; one request is the unpadded single-sequence pass. Per request, in order, as when each prefilled alone:
        its seed, its drafters' fresh states and the policy's memory before the pass; its first token (drawn from its
        own generator, or the decoder's in request order: the same draws), its kept logits and its feature drafters'
        hidden states of its prompt's positions after it. A row's ``prefill_s`` is its share of the pass (the rows'
        seconds add up to the pass's, as a drafter's rows share a proposal's)."""
        for row in rows:
            if row.state.request.seed is not None:
                row.generator.manual_seed(row.state.request.seed)
            row.drafts = {name: d.new_state() for name, d in self.drafters.items()}
            row.policy.memory = self.policy.start(row.state.request)
        lengths = [row.n for row in rows]
        W = max(lengths)
        t0 = self.now()
        # pads repeat the row's first token: any id serves (masked), and a replay target names the row by it
        ids = torch.stack([torch.cat([row.buf[:1].expand(W - row.n), row.context]) for row in rows])
        cache = new_cache(self.target.config)
        with self.features:
            last = self.target(input_ids=ids, **with_cache(self.target, cache), use_cache=True, logits_to_keep=1,
                               **prefill_inputs(lengths, self.device, self.dtype, self.layout)).logits[:, -1]
        for i, row in enumerate(rows):
            self._first_token(row, last[i], i, W - row.n)
        seconds = (self.now() - t0) / len(rows)
        for row in rows:
            row.t_start, row.prefill_s = t0, seconds
        return RaggedCache.prefilled(cache, lengths, self.device, self.config.compact_slack, self.layout)

    def _first_token(self, row: Row, logits: torch.Tensor, i: int, pad: int) -> None:
        """Row ``i`` of the prefill pass (its prompt after ``pad`` pads; ``logits`` [V] at its last token): the
        request's first token, its kept logits and its feature drafters' hidden states of the prompt."""
        L = row.n
        first = select_token(logits, row.sampling, row.generator)
        self._extend_features(row, i, L, pad)
        if row.logits is not None:
            row.logits.append(logits[None])
        row.buf[L] = first
        row.out, row.n = [int(first)], L + 1
        if row.out[0] in row.stops:
            row.finish = "eos"

    def finish(self, row: Row) -> None:
        if row.finish is None:
            row.finish = "length" if len(row.out) >= row.max_new_tokens else "context"
        logits = torch.cat(row.logits)[: len(row.out)] if row.logits is not None else None
        row.result = GenerationResult(row.out, row.records, row.state.request.prompt_len, row.prefill_s,
                                      self.now() - row.t_start, row.finish, row.dropped, logits, row.queued_s)

    # ------------------------------------------------------------------ one step of the batch
    def step(self, batch: list[Row], cache: RaggedCache) -> list[StepRecord]:
        """One step of every row, in order: plan and draft (the controller), verify (one target pass over every row's
        block, one verification call per sampling setting, one read back to the host), commit, observe (the
        controller). Each phase returns typed results that the later phases read and never change."""
        for row in batch:
            state = row.state
            state.context_len, state.generated, state.remaining = row.n, len(row.out), row.left
        # the live load: rows over the configured maximum batch
        load = min(1.0, len(batch) / self.config.max_batch) if self.config.max_batch > 1 else None
        plans = self.controller.plan(batch, len(batch), load)
        drafts = self.controller.draft(batch, plans, self.device)
        t0 = self.now()
        logits = self._score(batch, cache, drafts)
        verified = self._verify(batch, drafts, logits)
        self._commit(batch, cache, drafts, verified, logits)
        verify_s = self.now() - t0
        records = [self.controller.observe(row, plan, drafted, v.accepted, len(v.new), verify_s, len(batch), v.stats)
                   for row, plan, drafted, v in zip(batch, plans, drafts, verified)]
        for row, rec in zip(batch, records):
            row.records.append(rec)
        return records

    def _score(self, batch: list[Row], cache: RaggedCache, drafts: list[Drafted]) -> torch.Tensor:
        """One target pass over every row's [last committed token, block] (padded to the longest) -> logits
        [B, T, V]: row i's position j is the target's distribution after its j-th fed token (a token tree's node:
        after its path, the tree attention mask of ``TokenTree.attention``)."""
        T = max(d.block.k for d in drafts) + 1
        ids = torch.stack([torch.cat([row.buf[row.n - 1 : row.n], d.block.tokens,
                                      row.buf[row.n - 1 : row.n].expand(T - 1 - d.block.k)])
                           for row, d in zip(batch, drafts)])
        trees = [d.block.tree.attention(T, self.device) if d.block.tree is not None and not d.block.tree.is_chain
                 else None for d in drafts]
        with self.features:
            return self.target(input_ids=ids, **with_cache(self.target, cache.cache), use_cache=True,
                               logits_to_keep=T, **cache.inputs(T, self.dtype, trees)).logits

    def _verify(self, batch: list[Row], drafts: list[Drafted], logits: torch.Tensor) -> list[Verified]:
        """Accept each row's longest drafted prefix the target agrees with (greedy) or that rejection sampling keeps,
        then the target's own next token: the blocks padded to the longest and verified in one call per sampling
        setting (rows of a batch mostly share one), the results read back to the host once for all rows. A row's
        new tokens end at its first stop token and at its length limit. A token tree's row is walked on its own
        (``_verify_tree``): its longest accepted path, then the target's token after it."""
        B, K = logits.shape[0], logits.shape[1] - 1
        lengths = [d.block.k for d in drafts]
        tokens = (torch.nn.utils.rnn.pad_sequence([d.block.tokens for d in drafts], batch_first=True)
                  if K else logits.new_zeros((B, 0), dtype=torch.long))
        # random numbers in row order, each from its row's generator: the draws a row-by-row verification makes
        draws = [None if row.sampling.greedy else draw_uniforms(k, row.generator, self.device)
                 for row, k in zip(batch, lengths)]
        n = torch.empty(B, dtype=torch.long, device=self.device)
        nxt = torch.empty_like(n)
        stats: list[torch.Tensor | None] = [None] * B
        paths: list[list[int] | None] = [None] * B
        for cfg, idx in _by_sampling(batch):
            for i in idx:
                if drafts[i].block.tree is not None:
                    paths[i] = self._verify_tree(drafts[i].block, logits[i, : lengths[i] + 1], cfg, draws[i], n, nxt, i)
            idx = [i for i in idx if paths[i] is None]
            if not idx:
                continue
            sel = slice(None) if len(idx) == B else torch.tensor(idx, device=self.device)
            lens = torch.tensor([lengths[i] for i in idx], device=self.device)
            if cfg.greedy:
                n[sel], nxt[sel] = verify_greedy(logits[sel], tokens[sel], lens)
            else:
                p = probs_from_logits(logits[sel], cfg)
                q = torch.stack([_pad_rows(self._draft_probs(drafts[i].block, cfg), K) for i in idx])
                u = torch.stack([_pad_rows(draws[i][0], K) for i in idx])
                n[sel], nxt[sel] = verify(p, q, tokens[sel], lengths=lens,
                                          uniforms=(u, torch.stack([draws[i][1] for i in idx])))
            if self.config.step_stats:
                for j, i in enumerate(idx):
                    if lengths[i]:
                        row_pq = None if cfg.greedy else (p[j, : lengths[i] + 1], q[j, : lengths[i]])
                        stats[i] = block_stats(drafts[i].block, logits[i, : lengths[i] + 1], row_pq)
        head = torch.cat([n[:, None], nxt[:, None], tokens], dim=1).tolist()  # the step's one read to the host
        out = []
        for i, (row, (acc, target_token, *drafted)) in enumerate(zip(batch, head)):
            new = (drafted[:acc] if paths[i] is None else [drafted[j] for j in paths[i]]) + [target_token]
            stop = next((j for j, t in enumerate(new) if t in row.stops), None)
            if stop is not None:
                new = new[: stop + 1]
            new = new[: row.left]
            out.append(Verified(acc, tuple(new), stop is not None and stop < len(new), nxt[i],
                                None if stats[i] is None else stats[i].tolist(),
                                None if paths[i] is None else tuple(paths[i])))
        return out

    def _verify_tree(self, block: DraftBlock, logits: torch.Tensor, cfg: SamplingConfig, draws, n: torch.Tensor,
                     nxt: torch.Tensor, i: int) -> list[int]:
        """One token tree's verification (``sampling.verify_tree_greedy`` / ``verify_tree``: its nodes are proposals
        of probability one) from its logits [N + 1, V]: writes the accepted count and the next token into n[i] and
        nxt[i], returns the accepted path."""
        children = block.tree.children()
        if cfg.greedy:
            path, token = verify_tree_greedy(logits, block.tokens, children)
        else:
            path, token = verify_tree(probs_from_logits(logits, cfg), block.tokens, children, uniforms=draws)
        n[i], nxt[i] = len(path), token
        return path

    def _commit(self, batch: list[Row], cache: RaggedCache, drafts: list[Drafted], verified: list[Verified],
                logits: torch.Tensor) -> None:
        """Each row keeps its verified tokens: its buffer, output and length, the target's logits of them (when
        kept), its feature drafters' hidden states and its drafter's acceptance; the cache keeps the committed
        columns of every row."""
        for i, (row, d, v) in enumerate(zip(batch, drafts, verified)):
            cols = v.columns  # a token tree's: the root's and its accepted path's
            if cols is not None:
                if v.accepted:
                    row.buf[row.n : row.n + v.accepted] = d.block.tokens[list(v.path)]
            elif d.block.k:
                row.buf[row.n : row.n + d.block.k] = d.block.tokens
            row.buf[row.n + v.accepted] = v.target_token  # a device-side copy: no sync
            if row.logits is not None:  # row j of the verify pass is the distribution of the step's j-th new token
                row.logits.append(logits[i, : len(v.new)] if cols is None else logits[i, cols[: len(v.new)]])
            self._extend_features(row, i, v.accepted + 1, columns=cols)
            if d.drafter is not None:
                self.controller.settle(row, d, v.accepted)
            row.out.extend(v.new)
            row.n += len(v.new)
            if v.stopped:
                row.finish = "eos"
        trees = [v.columns for v in verified]
        cache.commit([v.accepted + 1 for v in verified], logits.shape[1],
                     None if all(c is None for c in trees) else trees)

    def _draft_probs(self, block: DraftBlock, cfg: SamplingConfig) -> torch.Tensor:
        if block.probs is not None:  # the drafter's own q, the very one its tokens were drawn from
            return block.probs
        if block.logits is None:  # deterministic proposal: q is the one-hot of the proposed token
            return torch.nn.functional.one_hot(block.tokens, self.vocab_size).float()
        return probs_from_logits(block.logits, cfg)

    def _extend_features(self, row: Row, i: int, m: int, start: int = 0, columns: list[int] | None = None) -> None:
        """Hand the row's feature drafters the target's hidden states of m positions of its row in the last pass,
        from ``start`` on (or of ``columns``, a token tree's committed ones): the ones that are now committed (the
        prompt after prefill, after its row's pads; the last token and the accepted drafts after a verify)."""
        if not self.features.layers:
            return
        for name in row.state.drafters:
            layers = self.feature_layers.get(name)
            if layers:
                try:
                    self.drafters[name].extend_features(row.drafts[name],
                                                        self.features.rows(layers, m, i, start, columns))
                except Exception as exc:
                    self.controller.drop(row, name, exc)
