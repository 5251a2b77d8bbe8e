"""One decoding step of a batch, gpt-fast style: decide, draft, verify-and-commit, record, each a small method of
``BatchStep`` (the part of ``SpeculativeDecoder`` that runs a step; ``decoder.py`` admits requests, prefills them and
retires them). ``Row`` is the mutable state of one request; ``WallClock`` the time the decoder reads."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Protocol

import torch

from sacpolicy.decoding.compat import with_cache
from sacpolicy.decoding.ragged import RaggedCache
from sacpolicy.decoding.sampling import (
    SamplingConfig,
    acceptance_stats,
    copy_acceptance_stats,
    draft_stats,
    probs_from_logits,
    probs_stats,
    verify,
    verify_greedy,
)
from sacpolicy.decoding.types import (
    Decision,
    DecodeState,
    DraftBlock,
    Drafter,
    DraftToken,
    GenerationResult,
    Policy,
    StepRecord,
    StopFn,
)
from sacpolicy.runtime.features import next_accept_history

logger = logging.getLogger("sacpolicy.decoding.decoder")

_T1 = SamplingConfig(temperature=1.0)  # distributions behind the records when decoding greedily


class Clock(Protocol):
    """The time the decoder reads (``now()``, seconds) and waits on while no request has arrived (``sleep``). A replay
    gives the decoder a virtual one whose time advances by what a cost model predicts for each pass."""

    def now(self) -> float: ...

    def sleep(self, seconds: float) -> None: ...


class WallClock:
    """The decoder's default ``Clock``: wall time."""

    def now(self) -> float:
        return time.perf_counter()

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)


def stop_callback(policy: Policy, state: DecodeState) -> StopFn | None:
    """The ``stop`` a drafter calls after each drafted token: the policy's ``should_stop`` on that token's confidence
    (None when the policy does not ask for token feedback). Production proposers that reuse a drafter call it too."""
    if not policy.needs_token_feedback:
        return None

    def stop(position: int, stats: torch.Tensor) -> bool:
        top1, entropy, margin = stats.tolist()
        return policy.should_stop(state, DraftToken(position, top1, entropy, margin))

    return stop


class BatchStep:
    """The step methods of ``SpeculativeDecoder`` (a mixin: it reads the decoder's target, drafters, policy, config
    and clock)."""

    def _check_decision(self, d: Decision) -> None:
        if not isinstance(d.k, int) or d.k < 0 or d.k > self.config.k_max:
            raise ValueError(f"policy {self.policy!r} chose k={d.k!r}; k must be an integer in [0, {self.config.k_max}]")
        if d.drafter is not None and d.drafter not in self.drafters:
            raise ValueError(f"policy {self.policy!r} chose unknown drafter {d.drafter!r}; known: {list(self.drafters)}")

    def _draft_probs(self, block: DraftBlock, cfg: SamplingConfig) -> torch.Tensor:
        if block.logits is None:  # deterministic proposal: q is the one-hot of the proposed token
            return torch.nn.functional.one_hot(block.tokens, self.vocab_size).float()
        return probs_from_logits(block.logits, cfg)

    # ------------------------------------------------------------------ one step
    def _step(self, batch: list[Row], cache: RaggedCache) -> list[StepRecord]:
        """Decide, draft, verify every row in one target pass and commit each row's accepted tokens, record."""
        decisions = self._decide(batch)
        drafts, draft_s = self._draft(batch, [d for d, _ in decisions])
        t1 = self._now()
        outcomes = self._verify_and_commit(batch, cache, drafts)
        verify_s = self._now() - t1
        return [self._record(run, decision, name, block, *outcome, cooldown, (ds, verify_s), len(batch))
                for run, (decision, cooldown), (name, block), outcome, ds
                in zip(batch, decisions, drafts, outcomes, draft_s)]

    def _decide(self, batch: list[Row]) -> list[tuple[Decision, bool]]:
        """Each row's decision for this step (autoregressive while a row cools down); the policy sees the rows that
        are not cooling down together (``Policy.decide_batch``), with the live batch size and load."""
        out: list[tuple[Decision, bool] | None] = [None] * len(batch)
        asking = []
        for i, run in enumerate(batch):
            state, n = run.state, run.n
            state.context_len, state.generated, state.remaining, state.drafter = n, len(run.out), run.left, None
            state.batch_size = len(batch)
            if self.config.max_batch > 1:  # the live load: rows over the configured maximum batch
                state.load = min(1.0, len(batch) / self.config.max_batch)
            if run.cooldown > 0:
                run.cooldown -= 1
                out[i] = (Decision.autoregressive(), True)
                continue
            if run.policy.uses_peeks:
                state.peeks = {d: run.drafters[d].peek(run.buf[:n]) for d in state.drafters
                               if run.drafters[d].peekable}
            asking.append(i)
        if asking:
            decisions = self.policy.decide_batch([batch[i].policy for i in asking], [batch[i].state for i in asking])
            for i, decision in zip(asking, decisions):
                self._check_decision(decision)
                out[i] = (decision, False)
        if self.config.batch_k == "shared" and len(batch) > 1:  # one k for the batch, as vLLM drafts
            k = max(d.k for d, _ in out)
            out = [(Decision(d.drafter, k) if d.drafter is not None else d, c) for d, c in out]
        return out

    def _draft(self, batch: list[Row], decisions: list[Decision]) -> tuple[list, list[float]]:
        """Each row's (drafter used or None, its block) and seconds drafting it. Rows drafting with the same drafter
        draft together (``Drafter.propose_batch``: one forward per token for model drafters; a group's time is
        shared among its rows). A drafter that raises is dropped for that row's request; the row decodes on
        autoregressively and its output stays exact."""
        drafts, seconds = [], [0.0] * len(batch)
        groups: dict[str, list[tuple[int, int]]] = {}
        for i, (run, decision) in enumerate(zip(batch, decisions)):
            name = decision.drafter if decision.drafter in run.state.drafters else None
            k = min(decision.k, run.left - 1) if name is not None else 0
            drafts.append((name, DraftBlock.empty(self.device)))
            if k > 0:
                run.state.drafter = name
                groups.setdefault(name, []).append((i, k))
        for name, rows in groups.items():
            t0 = self._now()
            runs = [batch[i] for i, _ in rows]
            args = ([r.drafters[name] for r in runs], [r.buf[: r.n] for r in runs], [k for _, k in rows],
                    [r.sampling for r in runs], [r.generator for r in runs],
                    [stop_callback(r.policy, r.state) for r in runs])
            blocks = None
            if len(rows) > 1 and type(self.drafters[name]).propose_batch is not Drafter.propose_batch:
                try:
                    blocks = self.drafters[name].propose_batch(*args)
                except Exception as exc:  # find the failing row: each proposes alone
                    logger.warning("drafter %r raised %r drafting %d rows together; they propose one by one",
                                   name, exc, len(rows))
            if blocks is None:  # row by row: a failure drops the drafter for that row's request only
                blocks = []
                for j, run in enumerate(runs):
                    try:
                        blocks.append(run.drafters[name].propose(*(a[j] for a in args[1:])))
                    except Exception as exc:
                        self._drop(run, name, exc)
                        blocks.append(None)
            dt = (self._now() - t0) / len(rows)
            for (i, _), block in zip(rows, blocks):
                seconds[i] = dt
                drafts[i] = (name, block) if block is not None else (None, DraftBlock.empty(self.device))
        return drafts, seconds

    def _verify_and_commit(self, batch: list[Row], cache: RaggedCache, drafts) -> list[tuple]:
        """One target pass over every row's [last committed token, block] (padded to the longest); each row commits
        its accepted + 1 tokens, the caches keep what was committed. -> per row (accepted, new tokens, [k, 6] record
        stats or None)."""
        T = max(block.k for _, block in drafts) + 1
        ids = torch.stack([torch.cat([run.buf[run.n - 1 : run.n], block.tokens,
                                      run.buf[run.n - 1 : run.n].expand(T - 1 - block.k)])
                           for run, (_, block) in zip(batch, drafts)])
        with self.features:
            logits = self.target(input_ids=ids, **with_cache(self.target, cache.cache), use_cache=True,
                                 logits_to_keep=T, **cache.inputs(T, self.dtype)).logits
        outcomes = [self._verify_row(i, run, name, block, logits[i, : block.k + 1])
                    for i, (run, (name, block)) in enumerate(zip(batch, drafts))]
        cache.commit([acc + 1 for acc, _, _ in outcomes], T)
        return outcomes

    def _verify_row(self, i: int, run: Row, name: str | None, block: DraftBlock, logits: torch.Tensor):
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
        self._extend_features(run, i, acc + 1)
        if name is not None:
            try:
                run.drafters[name].accept(acc)
            except Exception as exc:
                self._drop(run, name, exc)
        new = head[2 : 2 + acc] + [head[1]]
        for j, tok in enumerate(new):
            if tok in run.stops:
                new, run.finish = new[: j + 1], "eos"
                break
        new = new[: run.left]
        if run.logits is not None:  # row j of the verify pass is the distribution of the step's j-th new token
            run.logits.append(logits[: len(new)])
        run.out.extend(new)
        run.n += len(new)
        return acc, new, stats

    def _record(self, run: Row, decision: Decision, name, block, acc, new, stats, cooldown, times,
                batch_size: int) -> StepRecord:
        rec = StepRecord(step=run.state.step, drafter=name, k=decision.k, drafted=block.k, accepted=acc,
                         emitted=len(new), context_len=run.state.context_len, draft_s=times[0], verify_s=times[1],
                         cooldown=cooldown, batch_size=batch_size)
        if stats is not None:
            rec.top1, rec.entropy, rec.margin, rec.q, rec.p, rec.beta = stats.t().tolist()
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
        conf = draft_stats(block.logits) if block.logits is not None else self._copy_confidence(block)
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
            d = run.drafters[name]
            if d.aux_layers:
                try:
                    d.extend_features(self.features.rows(d.aux_layers, m, row))
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


@dataclass
class Row:
    """Mutable state of one request (one row of the batch)."""

    buf: torch.Tensor  # [prompt + limit + k_max + 1] committed tokens, then scratch space for a block
    stops: frozenset
    limit: int
    max_new_tokens: int
    state: DecodeState
    policy: Policy  # this row's policy (the decoder's own at max_batch=1, a fork otherwise)
    drafters: dict  # this row's drafters, by name
    generator: torch.Generator
    sampling: SamplingConfig  # the request's own settings, or the decoder's
    arrival: float = 0.0
    index: int = 0
    n: int = 0  # committed tokens in buf (the row's cache holds buf[:n - 1])
    out: list = field(default_factory=list)
    records: list = field(default_factory=list)
    dropped: list = field(default_factory=list)
    finish: str | None = None
    ema: float | None = None
    cooldown: int = 0
    spec_steps: int = 0
    logits: list | None = None  # keep_logits: the target's logits of each new token
    t_start: float = 0.0
    prefill_s: float = 0.0
    queued_s: float = 0.0
    result: GenerationResult | None = None

    @property
    def left(self) -> int:
        return self.limit - len(self.out)

    @property
    def active(self) -> bool:
        """Still decoding: no stop token yet and room for more tokens."""
        return self.finish is None and self.left > 0
