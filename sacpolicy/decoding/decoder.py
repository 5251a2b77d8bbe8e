"""SpeculativeDecoder: draft k tokens, verify them in one target pass, keep what the target would have produced.

One loop serves every setting: k = 0 (no drafter) is plain autoregressive decoding, so AR and speculative timings
come from the same code, and one request (``generate``) is a batch of one row (``generate_batch``: continuous batching
over B rows, each with its own draft block and accepted prefix, verified together in one target pass; the ragged KV
cache is ``sacpolicy.decoding.ragged``). The decoder never knows which policy it runs; the policy never sees a cache.

The decoder owns every request's state (``sacpolicy.decoding.rows.Row``: its tokens, the policy's memory of it, each
drafter's state); the policy and the drafters are shared by all rows and called once per step with all of them
(``Policy.decide(rows)``, ``Drafter.propose(rows)``). A step, in this module's second half: decide, draft, verify
and commit, record, each a method with a typed result (``Drafted``, ``Verified``).

This module is over the project's 400-line cap on purpose: the batching loop and the step it runs are one concept,
read together (``tests/test_layers.py`` names the exception).
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
from sacpolicy.decoding.ragged import RaggedCache, new_cache
from sacpolicy.decoding.rows import Clock, Row, WallClock, stop_callback
from sacpolicy.decoding.sampling import (
    SamplingConfig,
    acceptance_stats,
    copy_acceptance_stats,
    draft_stats,
    probs_from_logits,
    probs_stats,
    select_token,
    verify,
    verify_greedy,
)
from sacpolicy.decoding.types import (
    Autoregressive,
    Decision,
    DecodeState,
    DraftBlock,
    Drafter,
    DraftRow,
    GenerationResult,
    Policy,
    PolicyRow,
    RequestInfo,
    StepRecord,
)
from sacpolicy.runtime.features import next_accept_history

__all__ = ["BATCH_K", "DecoderConfig", "Drafted", "SpeculativeDecoder", "Verified", "WallClock", "stop_callback"]

logger = logging.getLogger(__name__)

BATCH_K = ("row", "shared")
_T1 = SamplingConfig(temperature=1.0)  # distributions behind the records when decoding greedily


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
    max_batch: int = 1  # rows generate_batch decodes together by default; the live load is rows / max_batch
    batch_k: str = "row"  # "row": each row's own k (blocks padded to the longest); "shared": one k for the batch (vLLM)
    compact_slack: float = 0.25  # compact the batch's KV cache when rejected columns exceed this share of its width
    # the CPU's faster kernels (``compat.cpu_kernels``) for the target and the drafters' models while the decoder
    # decodes, switched back after each call: the same results up to float rounding, and the caller's models are
    # left as they were. On by default because decoding's few-row passes are what they speed up; False keeps
    # transformers' own kernels throughout
    cpu_kernels: bool = True

    def __post_init__(self) -> None:
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


@dataclass
class Drafted:
    """A row's draft for a step: the drafter used (None: no draft), its block and the row's seconds drafting it."""

    drafter: str | None
    block: DraftBlock
    seconds: float = 0.0


@dataclass
class Verified:
    """A row's verification: drafted tokens accepted, the new tokens committed (accepted + the target's own, fewer
    at a stop token or the length limit), and the block's [k, 6] statistics for the record (None without a block)."""

    accepted: int
    new: list
    stats: torch.Tensor | None


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
                raise ValueError(
                    f"drafter {d.name!r} has a vocabulary of {d.vocab_size} tokens but the target has "
                    f"{self.vocab_size}; drafts must share the target's tokenizer and vocabulary: pick a draft from "
                    "the target's model family, or use the n-gram or layer-skip drafters"
                )
        self.policy.validate(tuple(self.drafters), self.config.k_max)
        self.max_context = getattr(target.config, "max_position_embeddings", None)
        if stop_token_ids is None:
            eos = getattr(getattr(target, "generation_config", None), "eos_token_id", None)
            stop_token_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        self.stop_token_ids = frozenset(int(t) for t in stop_token_ids)
        self.device = next(target.parameters()).device
        self.dtype = next(target.parameters()).dtype
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(self.sampling.seed or 0)
        self.features = AuxCapture(target, [i for d in self.drafters.values() for i in d.aux_layers])
        self.clock: Clock = WallClock()  # every time the decoder reads or waits on (a replay sets a virtual one)

    # ------------------------------------------------------------------ helpers
    def _now(self) -> float:
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
        runs = [self._new_run(i, p, m, r, a, stops, keep_logits)
                for i, (p, m, r, a) in enumerate(zip(prompts, budgets, requests, arrivals))]
        kernels = cpu_kernels(self.target, self.drafters.values()) if self.config.cpu_kernels else nullcontext()
        with kernels:
            self._run(runs, B)
        return [r.result for r in runs]

    def _run(self, runs: list[Row], B: int) -> None:
        """Continuous batching: admit arrived requests while rows are free, step the batch, retire finished rows."""
        waiting = sorted(runs, key=lambda r: r.arrival)[::-1]  # pop() takes the earliest
        batch: list[Row] = []
        cache: RaggedCache | None = None
        t0 = self._now()
        while waiting or batch:
            while waiting and len(batch) < B and waiting[-1].arrival <= self._now() - t0:
                run = waiting.pop()
                run.queued_s = self._now() - t0 - run.arrival
                row_cache = self._prefill(run)
                if run.active:
                    if cache is None:
                        cache = row_cache
                    else:
                        cache.join(row_cache)
                    batch.append(run)
                else:
                    self._finish(run)
            if not batch:
                if waiting:
                    self.clock.sleep(max(0.0, waiting[-1].arrival - (self._now() - t0)))
                continue
            for rec, run in zip(self._step(batch, cache), batch):
                self._track_acceptance(run, rec)
                self.policy.observe(run.policy, rec)
            live = [i for i, r in enumerate(batch) if r.active]
            for r in batch:
                if not r.active:
                    self._finish(r)
            if len(live) < len(batch):
                batch = [batch[i] for i in live]
                if batch:
                    cache.select(live)
                else:
                    cache = None

    def _new_run(self, index, input_ids, max_new_tokens, request, arrival, stops, keep_logits) -> Row:
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
        run = Row(
            buf=torch.empty(L + limit + self.config.k_max + 1, dtype=torch.long, device=self.device),
            stops=stops, limit=limit, max_new_tokens=max_new_tokens,
            policy=PolicyRow(DecodeState(request, drafters=tuple(self.drafters))), drafts={},
            logits=[] if keep_logits else None, generator=generator,
            arrival=arrival, index=index, sampling=request.sampling,
        )
        run.buf[:L] = prompt
        run.n = L
        return run

    def _prefill(self, run: Row) -> RaggedCache:
        """Admit a request: prefill its prompt alone, pick its first token. -> its one-row cache."""
        request, L = run.state.request, run.n
        if request.seed is not None:
            run.generator.manual_seed(request.seed)
        run.drafts = {name: d.new_state() for name, d in self.drafters.items()}
        run.policy.memory = self.policy.start(request)
        run.t_start = self._now()
        cache = new_cache(self.target.config)
        with self.features:
            prefill = self.target(input_ids=run.buf[:L].view(1, -1), **with_cache(self.target, cache),
                                  use_cache=True, logits_to_keep=1).logits[0]
        first = select_token(prefill[-1], run.sampling, run.generator)
        self._extend_features(run, 0, L)
        if run.logits is not None:
            run.logits.append(prefill[-1:])
        run.buf[L] = first
        run.out, run.n = [int(first)], L + 1
        run.prefill_s = self._now() - run.t_start
        if run.out[0] in run.stops:
            run.finish = "eos"
        return RaggedCache(cache, L, self.device, self.config.compact_slack)

    def _finish(self, run: Row) -> None:
        if run.finish is None:
            run.finish = "length" if len(run.out) >= run.max_new_tokens else "context"
        logits = torch.cat(run.logits)[: len(run.out)] if run.logits is not None else None
        run.result = GenerationResult(run.out, run.records, run.state.request.prompt_len, run.prefill_s,
                                      self._now() - run.t_start, run.finish, run.dropped, logits, run.queued_s)

    # ------------------------------------------------------------------ one step of the batch
    def _check_decision(self, d: Decision) -> None:
        if not isinstance(d.k, int) or d.k < 0 or d.k > self.config.k_max:
            raise ValueError(f"policy {self.policy!r} chose k={d.k!r}; k must be an integer in "
                             f"[0, {self.config.k_max}]")
        if d.drafter is not None and d.drafter not in self.drafters:
            raise ValueError(f"policy {self.policy!r} chose unknown drafter {d.drafter!r}; known: "
                             f"{list(self.drafters)}")

    def _draft_probs(self, block: DraftBlock, cfg: SamplingConfig) -> torch.Tensor:
        if block.probs is not None:  # the drafter's own q, the very one its tokens were drawn from
            return block.probs
        if block.logits is None:  # deterministic proposal: q is the one-hot of the proposed token
            return torch.nn.functional.one_hot(block.tokens, self.vocab_size).float()
        return probs_from_logits(block.logits, cfg)

    # ------------------------------------------------------------------ one step
    def _step(self, batch: list[Row], cache: RaggedCache) -> list[StepRecord]:
        """Decide, draft, verify every row in one target pass and commit each row's accepted tokens, record."""
        decisions = self._decide(batch)
        drafts = self._draft(batch, [d for d, _ in decisions])
        t1 = self._now()
        verified = self._verify_and_commit(batch, cache, drafts)
        verify_s = self._now() - t1
        return [self._record(run, decision, cooldown, drafted, v, verify_s, len(batch))
                for run, (decision, cooldown), drafted, v in zip(batch, decisions, drafts, verified)]

    def _decide(self, batch: list[Row]) -> list[tuple[Decision, bool]]:
        """Each row's decision for this step and whether the row is cooling down (then autoregressive); the policy
        decides for the rows that are not cooling down in one call, with the live batch size and load."""
        out: list[tuple[Decision, bool] | None] = [None] * len(batch)
        asking = []
        for i, run in enumerate(batch):
            state = run.state
            state.context_len, state.generated, state.remaining, state.drafter = run.n, len(run.out), run.left, None
            state.batch_size = len(batch)
            if self.config.max_batch > 1:  # the live load: rows over the configured maximum batch
                state.load = min(1.0, len(batch) / self.config.max_batch)
            if run.cooldown > 0:
                run.cooldown -= 1
                out[i] = (Decision.autoregressive(), True)
                continue
            if self.policy.uses_peeks:
                state.peeks = {name: self.drafters[name].peek(run.drafts[name], run.context)
                               for name in state.drafters if self.drafters[name].peekable}
            asking.append(i)
        if asking:
            for i, decision in zip(asking, self.policy.decide([batch[i].policy for i in asking])):
                self._check_decision(decision)
                out[i] = (decision, False)
        if self.config.batch_k == "shared" and len(batch) > 1:  # one k for the batch, as vLLM drafts
            k = max(d.k for d, _ in out)
            out = [(Decision(d.drafter, k) if d.drafter is not None else d, c) for d, c in out]
        return out

    def _draft(self, batch: list[Row], decisions: list[Decision]) -> list[Drafted]:
        """Each row's draft. Rows drafting with the same drafter draft together (one ``propose`` call; a model
        drafter runs one forward per drafted token for all of them) and share its time. A drafter that raises is
        dropped for the request of the row that made it raise (found by proposing its rows one by one); that row
        decodes on autoregressively and its output stays exact."""
        drafts = []
        groups: dict[str, list[tuple[int, DraftRow]]] = {}
        for i, (run, decision) in enumerate(zip(batch, decisions)):
            name = decision.drafter if decision.drafter in run.state.drafters else None
            k = min(decision.k, run.left - 1) if name is not None else 0
            drafts.append(Drafted(name, DraftBlock.empty(self.device)))  # the record names the drafter chosen
            if k > 0:
                run.state.drafter = name
                groups.setdefault(name, []).append((i, DraftRow(
                    run.drafts[name], run.context, k, run.sampling, run.generator,
                    stop_callback(self.policy, run.policy))))
        for name, rows in groups.items():
            t0 = self._now()
            blocks = self._propose(name, [r for _, r in rows], [batch[i] for i, _ in rows])
            seconds = (self._now() - t0) / len(rows)
            for (i, _), block in zip(rows, blocks):
                drafts[i] = Drafted(name, block, seconds) if block is not None else Drafted(None, drafts[i].block,
                                                                                            seconds)
        return drafts

    def _propose(self, name: str, rows: list[DraftRow], runs: list[Row]) -> list[DraftBlock | None]:
        """``rows``' blocks from drafter ``name``, None for a row whose request dropped it."""
        drafter = self.drafters[name]
        try:
            return drafter.propose(rows)
        except Exception as exc:
            if len(rows) == 1:
                self._drop(runs[0], name, exc)
                return [None]
            logger.warning("drafter %r raised %r drafting %d rows together; they propose one by one",
                           name, exc, len(rows))
        return [self._propose(name, [row], [run])[0] for row, run in zip(rows, runs)]

    def _verify_and_commit(self, batch: list[Row], cache: RaggedCache, drafts: list[Drafted]) -> list[Verified]:
        """One target pass over every row's [last committed token, block] (padded to the longest); each row commits
        its accepted + 1 tokens, the caches keep what was committed."""
        T = max(d.block.k for d in drafts) + 1
        ids = torch.stack([torch.cat([run.buf[run.n - 1 : run.n], d.block.tokens,
                                      run.buf[run.n - 1 : run.n].expand(T - 1 - d.block.k)])
                           for run, d in zip(batch, drafts)])
        with self.features:
            logits = self.target(input_ids=ids, **with_cache(self.target, cache.cache), use_cache=True,
                                 logits_to_keep=T, **cache.inputs(T, self.dtype)).logits
        out = []
        for i, (run, d) in enumerate(zip(batch, drafts)):
            v = self._verify(run, d.block, logits[i, : d.block.k + 1])
            self._extend_features(run, i, v.accepted + 1)
            if d.drafter is not None:
                self._settle(run, d.drafter, v.accepted)
            self._commit(run, v, logits[i])
            out.append(v)
        cache.commit([v.accepted + 1 for v in out], T)
        return out

    def _verify(self, run: Row, block: DraftBlock, logits: torch.Tensor) -> Verified:
        """Accept the longest prefix of ``block`` the target agrees with (greedy) or that rejection sampling keeps,
        then the target's own next token. ``logits`` [k + 1, V]: the target's at the block's positions."""
        n, kb = run.n, block.k
        if run.sampling.greedy:
            n_acc, nxt, pq = *verify_greedy(logits, block.tokens), None
        else:
            p, q = probs_from_logits(logits, run.sampling), self._draft_probs(block, run.sampling)
            n_acc, nxt, pq = *verify(p, q, block.tokens, run.generator), (p, q)
        run.buf[n : n + kb] = block.tokens
        run.buf[n + n_acc] = nxt  # device-side index: no sync before the write
        stats = self._block_stats(block, logits, pq) if kb else None
        head = torch.cat([n_acc.view(1), nxt.view(1), block.tokens]).tolist()  # the row's one host sync
        acc = head[0]
        return Verified(acc, head[2 : 2 + acc] + [head[1]], stats)

    def _commit(self, run: Row, v: Verified, logits: torch.Tensor) -> None:
        """Append the row's new tokens, up to a stop token and the length limit (``v.new`` is cut to them)."""
        new = v.new
        for j, tok in enumerate(new):
            if tok in run.stops:
                new, run.finish = new[: j + 1], "eos"
                break
        v.new = new[: run.left]
        if run.logits is not None:  # row j of the verify pass is the distribution of the step's j-th new token
            run.logits.append(logits[: len(v.new)])
        run.out.extend(v.new)
        run.n += len(v.new)

    def _settle(self, run: Row, name: str, accepted: int) -> None:
        """Tell the drafter how many of the row's drafted tokens were accepted."""
        try:
            self.drafters[name].accept(run.drafts[name], accepted)
        except Exception as exc:
            self._drop(run, name, exc)

    def _record(self, run: Row, decision: Decision, cooldown: bool, drafted: Drafted, v: Verified, verify_s: float,
                batch_size: int) -> StepRecord:
        rec = StepRecord(step=run.state.step, drafter=drafted.drafter, k=decision.k, drafted=drafted.block.k,
                         accepted=v.accepted, emitted=len(v.new), context_len=run.state.context_len,
                         draft_s=drafted.seconds, verify_s=verify_s, cooldown=cooldown, batch_size=batch_size)
        if v.stats is not None:
            rec.top1, rec.entropy, rec.margin, rec.q, rec.p, rec.beta = v.stats.t().tolist()
        run.records.append(rec)
        run.state.step += 1
        run.state.last = rec
        return rec

    def _block_stats(self, block: DraftBlock, logits: torch.Tensor, pq) -> torch.Tensor:
        """[k, 6] = draft (top1, entropy, margin) + (q(x), p(x), beta), on device. ``pq``: the processed (p, q)
        verification used when sampling; None when greedy, where the records use temperature-1 distributions."""
        k = block.k
        if pq is None:  # greedy: temperature-1 softmax of the target and, for a model draft, of the draft, made once
            p = probs_from_logits(logits[:k], _T1)
            if block.logits is None:  # a copy: q is one-hot, nothing [k, V] to build
                return torch.cat([self._copy_confidence(block), copy_acceptance_stats(p, block.tokens)], dim=-1)
            q = probs_from_logits(block.logits, _T1)
            return torch.cat([probs_stats(q), acceptance_stats(p, q, block.tokens)], dim=-1)
        p, q = pq
        if block.logits is None:
            conf = self._copy_confidence(block)
        else:
            conf = block.confidence if block.confidence is not None else draft_stats(block.logits)
        return torch.cat([conf, acceptance_stats(p, q, block.tokens)], dim=-1)

    def _copy_confidence(self, block: DraftBlock) -> torch.Tensor:
        """[k, 3] confidence of a deterministic proposal: the drafter's own, else certain."""
        if block.confidence is not None:
            return block.confidence.to(self.device, torch.float32)
        return torch.tensor([[1.0, 0.0, 1.0]], device=self.device).expand(block.k, 3)

    def _extend_features(self, run: Row, row: int, m: int) -> None:
        """Hand the row's feature drafters the target's hidden states of the first m positions of its row in the
        last pass: the ones that are now committed (the prompt after prefill; the last token and the accepted drafts
        after a verify)."""
        if not self.features.layers:
            return
        for name in run.state.drafters:
            d = self.drafters[name]
            if d.aux_layers:
                try:
                    d.extend_features(run.drafts[name], self.features.rows(d.aux_layers, m, row))
                except Exception as exc:
                    self._drop(run, name, exc)

    def _drop(self, run: Row, name: str, exc: Exception) -> None:
        logger.warning("drafter %r raised %r; dropped for this request, decoding continues", name, exc)
        run.dropped.append(name)
        run.state.drafters = tuple(d for d in run.state.drafters if d != name)

    def _track_acceptance(self, run: Row, rec: StepRecord) -> None:
        """Per-drafter acceptance history for policies (the ``accept_ema`` feature, weight fixed by the feature spec);
        the overall EMA of accepted / drafted drives the cooldown (autoregressive steps)."""
        if not rec.drafted or rec.drafter is None:
            return
        rate = rec.accepted / rec.drafted
        history = run.state.accept_history
        history[rec.drafter] = next_accept_history(history.get(rec.drafter), rec.accepted, rec.drafted)
        a = self.config.cooldown_ema
        run.ema = rate if run.ema is None else a * rate + (1 - a) * run.ema
        run.spec_steps += 1
        floor = self.config.cooldown_floor
        if floor is not None and run.spec_steps >= self.config.cooldown_min_steps and run.ema < floor:
            logger.info("moving acceptance %.3f < floor %.3f: autoregressive for %d steps",
                        run.ema, floor, self.config.cooldown_steps)
            run.cooldown, run.ema, run.spec_steps = self.config.cooldown_steps, None, 0
