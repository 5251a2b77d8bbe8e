"""The learned policy's vLLM proposer (``PolicyProposer``), served through vLLM's ``custom_class`` hook (the exports
that name it: ``sacpolicy.export.vllm``, which re-exports it so ``"model": "sacpolicy.export.vllm.PolicyProposer"``
keeps loading). For every request in an engine step it runs sacpolicy's one controller (``decoding.controller``) with
the rule's lookup drafters (n-gram, suffix) under the served view of a request; vLLM's hook gives no request ids, so
``_History`` finds a request again by its committed tokens and keeps its memory (``Served``): acceptance history,
drafter states, canary arm, step-log entry. ``SACPOLICY_PROPOSER_LOG=<dir>`` turns on its step log
(``sacpolicy.export.steplog``), which ``sacpolicy.traces.production`` turns into traces; what it reads of vLLM's
internals is ``sacpolicy.export.vllm_adapter``; hot reload and canary, ``sacpolicy.export.reload``.
"""

from __future__ import annotations

import gc
import logging
import os
import sys
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np
import torch

from sacpolicy.decoding import SamplingConfig
from sacpolicy.decoding.controller import Track
from sacpolicy.export.reload import PolicySlot, ServedPolicy, open_policy, served_policy
from sacpolicy.export.request_key import request_key
from sacpolicy.export.vllm_adapter import engine_limits, engine_sampling, is_first_rank
from sacpolicy.io import write_json
from sacpolicy.runtime.artifact import ArtifactError
from sacpolicy.runtime.features import accepted_prefix

logger = logging.getLogger(__name__)

POLICY_ENV = "SACPOLICY_POLICY_DIR"
DRAFTER_ENV = "SACPOLICY_POLICY_DRAFTER"  # optional: which of the policy's lookup drafters it runs ("a,b": several)
STATS_ENV = "SACPOLICY_PROPOSER_STATS"  # optional: a JSON file where the proposer reports its calls and seconds
LOAD_ENV = "SACPOLICY_PROPOSER_LOAD"  # "0": price every step as one request even where the cost model has batches
LOG_ENV = "SACPOLICY_PROPOSER_LOG"  # optional: a directory for the proposer's step log (sacpolicy.export.steplog)
LEARN_ENV = "SACPOLICY_PROPOSER_LEARN"  # "0": serve the fitted rule alone where it learns while serving (rule.online)
_GREEDY = SamplingConfig()  # n-gram proposals are deterministic; the sampling settings do not reach them


class _GcClock:
    """The garbage collector's collections in this process since it was made and the seconds they took, per
    generation (``gc.callbacks``; one per process: ``gc_clock``): the stats file's ``gc``, so that a server whose
    Python allocates more (the step log on) shows what its collections cost beside one that does not."""

    def __init__(self):
        self.collections, self.seconds, self._t0 = [0, 0, 0], [0.0, 0.0, 0.0], None
        gc.callbacks.append(self)

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        elif self._t0 is not None:
            g = min(int(info.get("generation", 2)), 2)
            self.collections[g] += 1
            self.seconds[g] += time.perf_counter() - self._t0
            self._t0 = None

    def stats(self) -> dict:
        return {"collections": list(self.collections), "seconds": [round(x, 6) for x in self.seconds]}


_GC_CLOCK: list[_GcClock] = []  # the process's one clock (collections are per process), made when first asked for


def gc_clock() -> _GcClock:
    if not _GC_CLOCK:
        _GC_CLOCK.append(_GcClock())
    return _GC_CLOCK[0]


@dataclass(kw_only=True)
class Served(Track):
    """A served request's memory across vLLM steps: the controller's ``Track`` of it (the policy's row, with the
    request's acceptance history per drafter, and each lookup drafter's row state: a suffix drafter's index of the
    request), its context this step, its last plan and draft with the controller that made them (until the next step
    tells how much was accepted), its canary arm, when the proposer last saw it (``time.perf_counter``) and its step
    log entry: what history, canary and log know of a request, in one place."""

    context: torch.Tensor | None = None
    states: dict = field(default_factory=dict)  # drafter object -> the request's row state of it
    served_by: ServedPolicy | None = None  # the policy whose drafters ``drafts`` holds (``serve``)
    last: tuple | None = None  # (controller, Planned, Drafted) of the block drafted at the last step
    arm: tuple[int, bool] | None = None  # (trial number, on the candidate): ``reload.PolicySlot``
    seen_s: float | None = None
    log: list | None = None  # the step log's entry of the request (``export.steplog``), None until logged
    recorded: int = -1  # the engine step (``_History.steps``) it was last recorded at

    def serve(self, served: ServedPolicy) -> None:
        """Hand the request the drafters of the policy that plans it now: their row states (made on first use, kept
        per drafter object, so a drafter a swap kept finds the request's state again) and the names still usable.
        Built when the planning policy changes (a new request, a reload or a canary arm: another frozen value, whose
        drafters may be others); while the same policy plans it, each step, they stand (a drafter dropped meanwhile
        is out of ``state.drafters`` already: the controller's ``drop``)."""
        if served is self.served_by:
            return
        self.served_by = served
        self.drafts = {}
        for name, d in served.lookups.items():
            st = self.states.get(d)
            if st is None:
                st = self.states[d] = d.new_state()
            self.drafts[name] = st
        self.state.drafters = tuple(n for n in served.lookups if n not in self.dropped)


def as_served(memo, served: ServedPolicy) -> Served:
    """A row's memory: a ``Served``, or None for a new request, or the primary drafter's acceptance history as a
    (float, float) tuple (the reload smoke test's rows)."""
    if isinstance(memo, Served):
        return memo
    out = Served(policy=served.request(), sampling=_GREEDY)
    if memo is not None:
        out.state.accept_history[served.primary] = memo
    return out


class _History:
    """Each request's memory (``Served``: acceptance histories, drafter states, canary arm) across vLLM steps: the
    proposer's one request table. The proposer hook gives no request ids, so a request is found again by its
    committed tokens: after a step that committed s tokens (accepted drafts + the target's own), the row's first n - s
    tokens are the context it was drafted on. Requests at equal contexts (the same prompt sent twice) each keep an
    entry under it, taken in turn: exact for greedy decoding (equal contexts saw equal blocks) and a close estimate
    when sampling. Where vLLM ran steps without calling the hook (a request of the batch near the context limit: it
    verifies dummy drafts, not ours), a row is found as the step before's request whose context is its prefix, and its
    block's accepted tokens are those equal to the block; the dummy drafts do not count. A request is found again
    only from the engine step just before: vLLM proposes for every running request each step, so an entry older than
    that is a finished request's, and a later request reaching the same context (the same prompt sent again) starts
    anew instead of continuing it."""

    def __init__(self, capacity: int):
        self.capacity, self.entries = capacity, OrderedDict()
        self.steps = 0  # engine steps begun
        self._last: list = []  # keys recorded at the step before
        self._now: list = []  # keys recorded at this step

    _key = staticmethod(request_key)  # the canary's too (``reload.PolicySlot``)

    def begin_step(self) -> None:
        """A new engine step: what was recorded so far is the step before's."""
        self._last, self._now = self._now, []
        self.steps += 1

    def advance(self, context: np.ndarray, committed: int) -> tuple[Served, int] | None:
        """The request's memory now that its last step committed ``committed`` tokens, and how many of its last block
        the target accepted (None: a new request)."""
        key = self._key(context[: len(context) - committed])
        found, accepted = self._current(key), committed - 1
        if not found:  # steps vLLM ran without the hook: the step before's request whose context is a prefix
            key = next((k for k in self._last if k[0] < len(context) and self._current(k)
                        and self._key(context[: k[0]]) == k), None)
            found = self._current(key) if key is not None else None
            if not found:
                return None
            last = found[0].last
            accepted = accepted_prefix(last[2].block.tokens.tolist() if last else [], context[key[0]:])
        memo = found.pop(0)
        if not found:
            del self.entries[key]
        return memo, accepted

    def _current(self, key) -> list | None:
        """The memories under ``key`` recorded at the step before (older ones, finished requests', are dropped)."""
        found = self.entries.get(key)
        if found:
            found[:] = [m for m in found if m.recorded == self.steps - 1]
            if not found:
                del self.entries[key]
        return found

    def record(self, context: np.ndarray, memo: Served) -> None:
        """The request's memory, its new block (``memo.last``) drafted on ``context``."""
        memo.recorded = self.steps
        key = self._key(context)
        self.entries.setdefault(key, []).append(memo)
        self._now.append(key)
        while len(self.entries) > self.capacity:  # finished requests are never looked up again
            self.entries.popitem(last=False)


class PolicyProposer:
    """vLLM ``custom_class`` proposer: lookup proposals (n-gram, suffix), the drafter and block decided per request by
    the learned rule.

    It runs sacpolicy's one controller (``decoding.controller``: peek, plan, clamp, draft under the stop rule,
    observe) with the rule's ``LearnedPolicy`` and lookup drafters (``NgramDrafter``, ``SuffixDrafter``) on each
    row, under the served view of a request (``ServedView``), so vLLM decodes with the decisions sacpolicy's decoder
    makes on the same context, and a replay of the step log plans through the same code: the chosen drafter, the
    request's acceptance history per drafter (its memory, ``Served``, found again by ``_History``) and an unknown
    category. It serves every n-gram and suffix drafter of the rule (``SACPOLICY_POLICY_DRAFTER``: the named ones);
    the rule's other drafters (a head, a draft model) are not on offer in this hook, as when a decoder drops a
    drafter. A suffix drafter keeps each request's index across steps and one global index over every request the
    proposer has seen, fed as their tokens commit: the server's traffic teaches it, as SuffixDecoding's global tree
    does (bounded: ``max_nodes``, ``max_requests`` of its spec; kept across policy swaps of the same spec).

    The policy that serves is one frozen value (``reload.ServedPolicy``) held by the slot (``reload.PolicySlot``),
    which swaps it by one assignment on a hot reload and hands a canary's requests the candidate's.

    Load: the rows of one engine step are planned together, priced at the step's live batch size (the requests vLLM
    scheduled) when the rule's cost model was profiled over batch sizes (``scripts/profile_vllm.py --batch-sizes``:
    vLLM's own batched step costs), so the rule drafts less, or nothing, where a wide batch makes drafting lose; a
    rule profiled at one request prices every row as a step of its own.

    A failure inside the proposer never reaches vLLM's engine: the step goes without drafts (lossless: vLLM then
    decodes one token per request), the failure is logged once and counted (``failures`` in the stats file); the
    step log's hand-off and the stats file run inside the same guard. Under tensor parallelism every rank builds a
    proposer; only the first rank writes the stats file and the step log (``vllm_adapter.is_first_rank``)."""

    def __init__(self, vllm_config, policy=None, drafter: str | None = None):
        policy, drafter = policy or os.environ.get(POLICY_ENV), drafter or os.environ.get(DRAFTER_ENV) or None
        if not policy:
            raise ArtifactError(f"PolicyProposer needs a policy artifact: set {POLICY_ENV}=<artifact dir>")
        art, root, policy_id = open_policy(policy)  # a deploy root: its `current` version
        load = os.environ.get(LOAD_ENV, "1") != "0"
        learn = os.environ.get(LEARN_ENV, "1") != "0"
        self.k_cap, self.max_model_len, seqs = engine_limits(vllm_config)
        self.history = _History(4 * seqs)
        served = served_policy(art, drafter, policy_id, k_cap=self.k_cap, max_model_len=self.max_model_len,
                               load=load, learn=learn)
        # hot reload and canary (sacpolicy.export.reload): the slot holds the served policy and swaps it
        self.slot = PolicySlot(served, art, root, drafter, k_cap=self.k_cap, max_model_len=self.max_model_len,
                               load=load, learn=learn, notify=self.write_stats)
        first = is_first_rank(vllm_config)  # under tensor parallelism one rank reports and logs
        self.calls, self.seconds, self.failures = 0, 0.0, 0
        self.dropped_drafters = 0  # drafters dropped for a request (one raised): counted, as the decoder's results do
        self.stats_path = os.environ.get(STATS_ENV) if first else None
        self.gc = gc_clock() if self.stats_path else None
        self.batch_sizes: dict[int, int] = {}  # steps per live batch size
        self.steplog = self._open_steplog(vllm_config, art)  # None unless logging, and on every worker but the first
        self._logged, self._unsampled = None, False

    # the policy serving now (read-only views of ``slot.current``: a swap is the slot's one assignment)
    served = property(lambda self: self.slot.current)
    rule = property(lambda self: self.slot.current.rule)
    policy = property(lambda self: self.slot.current.policy)
    lookups = property(lambda self: self.slot.current.lookups)
    lookup_specs = property(lambda self: self.slot.current.specs)
    drafter = property(lambda self: self.slot.current.primary)
    load_aware = property(lambda self: self.slot.current.load_aware)
    policy_id = property(lambda self: self.slot.current.policy_id)

    def propose(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=None) -> list[list[int]]:
        t0, failed = time.perf_counter(), False
        caller = sys._getframe(1)
        try:
            out = self._propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu, t0)
        except Exception:  # a proposer failure must never take the engine down
            self._failed()
            failed, out = True, [[] for _ in sampled_token_ids]
        seconds = time.perf_counter() - t0
        self.calls, self.seconds = self.calls + 1, self.seconds + seconds
        try:  # the step log's hand-off and the stats file: inside the guard too
            if self.steplog is not None:
                self._log_step(seconds, engine_sampling(caller))
            if self.stats_path and (self.calls % 20 == 0 or failed):
                self.write_stats()
        except Exception:
            self._failed()
        return out

    def _failed(self) -> None:
        if not self.failures:
            logger.exception("the sacpolicy proposer failed; this step goes without drafts (counted as 'failures' in "
                             "%s)", self.stats_path or f"the proposer's stats ({STATS_ENV})")
        self.failures += 1

    def write_stats(self) -> None:
        """The proposer lives in vLLM's worker: it reports through a JSON file (``SACPOLICY_PROPOSER_STATS``)."""
        if self.stats_path:
            write_json(self.stats_path, {"calls": self.calls, "seconds": self.seconds, "failures": self.failures,
                                         "dropped_drafters": self.dropped_drafters, "load_aware": self.load_aware,
                                         "batch_sizes": {str(b): n for b, n in sorted(self.batch_sizes.items())}}
                       | self.slot.stats()  # policy_id, reloads, reload_failures, canary (sacpolicy.export.reload)
                       | ({"steplog": self.steplog.cost()} if self.steplog is not None else {})
                       | ({"gc": self.gc.stats()} if self.gc is not None else {}))

    def _propose(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu, now: float) -> list[list[int]]:
        out: list[list[int]] = [[] for _ in sampled_token_ids]
        live = []
        self.history.begin_step()
        for i, sampled in enumerate(sampled_token_ids):
            n = int(num_tokens_no_spec[i])
            if not len(sampled) or n >= self.max_model_len:  # a prefill chunk mid-way, or no room: no drafts
                continue
            context = np.asarray(token_ids_cpu[i, :n], dtype=np.int64)
            memo, seconds = self._advance(context, len(sampled), now)
            live.append((i, context, memo, seconds))
        batch = len(sampled_token_ids)  # the requests this engine step verifies together
        self.batch_sizes[batch] = self.batch_sizes.get(batch, 0) + 1
        seen = [] if self.steplog is not None else None  # the step log's: each row's state, k and policy
        # hot reload and canary (sacpolicy.export.reload): each request planned by its arm's policy
        blocks = self.slot.blocks([(c, m, len(sampled_token_ids[i]), t) for i, c, m, t in live], self.blocks, batch,
                                  seen=seen)
        for (i, context, memo, _), block in zip(live, blocks):
            memo.seen_s = now
            self.history.record(context, memo)
            out[i] = block
        if seen is not None:
            self._logged = ([(c, len(sampled_token_ids[i]), i, m) for i, c, m, _ in live], blocks, seen, batch)
        return out

    def _advance(self, context: np.ndarray, committed: int, now: float) -> tuple[Served, float | None]:
        """The request's memory, its last block observed (the controller that planned it settles and observes it:
        acceptance history, the policy's observation), and the seconds since the proposer last saw it (None: new)."""
        found = self.history.advance(context, committed)
        if found is None:
            return as_served(None, self.served), None
        memo, accepted = found
        if memo.last is not None:
            controller, plan, drafted = memo.last
            controller.settle(memo, drafted, accepted)
            controller.observe(memo, plan, drafted, accepted, committed)
            memo.last = None
        return memo, (None if memo.seen_s is None else now - memo.seen_s)

    # ------------------------------------------------------------------ the step log (sacpolicy.export.steplog)
    def _open_steplog(self, vllm_config, art):
        """The step log when ``SACPOLICY_PROPOSER_LOG`` names a directory, else None (no cost per step); None too on
        every worker but its engine's first (``StepLogger.for_proposer``)."""
        if not os.environ.get(LOG_ENV):
            return None
        from sacpolicy.export.steplog import StepLogger

        return StepLogger.for_proposer(vllm_config, art, self, os.environ[LOG_ENV])

    def _log_step(self, seconds: float, sampling) -> None:
        """Hand the step just proposed to the step log (a failed step: nothing to log). ``sampling``: vLLM's input
        batch (``engine_sampling``), or None when it could not be found (the log then records no sampling)."""
        step, self._logged = self._logged, None
        if step is None:
            return
        if sampling is None and not self._unsampled:
            self._unsampled = True
            logger.warning("the sacpolicy step log cannot read the requests' sampling settings (vLLM's model runner "
                           "exposes no input_batch to the proposer hook); the log records none, and production traces "
                           "take them from build_production_traces(sampling=...)")
        rows, blocks, seen, batch = step
        for served in {id(x[2]): x[2] for x in seen}.values():  # the policies that planned this step
            self.steplog.describe(served)
        self.steplog.step([(c, s, state, k, b, served.policy_id, None if sampling is None else sampling(i), name, m,
                            guard) for (c, s, i, m), b, (state, k, served, name, guard) in zip(rows, blocks, seen)],
                          batch, seconds, self.drafter)

    def block(self, context: np.ndarray, history=None) -> list[int]:
        """The tokens the decoder would draft on ``context`` alone (``history``: the request's memory, see
        ``as_served``; None before its first block)."""
        return self.blocks([(context, history)])[0]

    def blocks(self, rows: list[tuple[np.ndarray, Served | tuple | None]], batch: int = 1, seen: list | None = None,
               served: ServedPolicy | None = None) -> list[list[int]]:
        """The tokens the decoder would draft on each (context, memory) row, planned by ``served`` (default: the
        policy serving now) through its controller: every lookup drafter peeks (in row order: a suffix drafter
        indexes the row's new tokens as it peeks, so later rows read them in its global index), the policy plans
        (drafter, k) within the row's room, the chosen drafter drafts under the stop rule. ``batch``: the engine
        step's live size (where the policy is load-aware its rows are planned together at that size; else each
        alone). A ``Served`` memory gets its new block (``last``). ``seen``: a list that gets each row's (state
        decided on, k chosen, the planning ``ServedPolicy``, the drafter or None, whether the policy's guard
        decided)."""
        served = served or self.served
        memos = []
        for context, memo in rows:
            memo = as_served(memo, served)
            memo.serve(served)
            memo.context, n = torch.from_numpy(context), len(context)
            memo.state.context_len, memo.state.remaining = n, self.max_model_len - n
            memos.append(memo)
        controller = served.controller
        dropped = sum(len(m.dropped) for m in memos)
        plans = controller.plan(memos, max(batch, 1))
        drafts = controller.draft(memos, plans)
        self.dropped_drafters += sum(len(m.dropped) for m in memos) - dropped
        out = []
        for memo, plan, drafted in zip(memos, plans, drafts):
            name = drafted.drafter if drafted.block.k else None
            memo.last = (controller, plan, drafted)  # observed at the next step, drafted or not (as the decoder does)
            if seen is not None:
                seen.append((plan.row.state, plan.k if name else 0, served, name, plan.decision.guard))
            out.append(drafted.block.tokens.tolist())
        return out

    def load_model(self, *args, **kwargs) -> None:
        pass  # nothing to load: vLLM calls this on every proposer


# Exports written before the proposer served suffix drafters name it by its first name in their speculative_config
PolicyNgramProposer = PolicyProposer
