"""The controller: what runs around a policy in every host, written once.

Three hosts run a policy: the decoder's step (``decoding.decoder``), the vLLM proposer (``export.vllm``: engine rows,
no target pass of its own) and the replay of a served log (``traces``: the decoder over a replay target, seen as the
server saw it). Each asks the same two things of one ``Controller``:

- ``plan(rows)``: each row's state brought up to the step (live batch size and load), the peeks, the policy's
  decisions (checked), the block clamped to the row's room (``room``: the one clamp), the drafter still usable for
  the request -> ``Planned``; then ``draft(rows, plans)``: each drafter proposes for its rows together, a drafter that
  raises is dropped for the request of the row that made it raise -> ``Drafted``.
- after verification, ``settle`` (the drafter's acceptance) and ``observe`` (the step's ``StepRecord``, the
  request's acceptance history, the cooldown, ``Policy.observe``).

A host keeps one ``Track`` per request (the decoder's ``Row`` extends it; the proposer's served memory is one): the
policy's row and memory, each drafter's state, how the request samples, the drafters dropped and the cooldown. The
controller holds no request.

A served engine shows the policy less than the decoder knows (``ServedView``): the rule's drafters but no category,
room for at most the engine's ``k_cap`` tokens before its context limit, each row priced alone unless the proposer is
load-aware. The proposer plans through the view, and a replay of its log plans through the same view, so the two
cannot drift apart.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace

import torch

from sacpolicy.decoding.protocols import Drafter, DraftsTrees, Peekable, Policy, PolicyRow
from sacpolicy.decoding.sampling import SamplingConfig
from sacpolicy.decoding.types import Decision, DecodeState, DraftBlock, DraftRow, DraftToken, StepRecord, StopFn
from sacpolicy.runtime.features import next_accept_history

__all__ = ["Controller", "Drafted", "Planned", "ServedView", "Track", "room", "stop_callback"]

logger = logging.getLogger(__name__)


def room(remaining: int, *caps: int | None) -> int:
    """The most tokens a block may draft when ``remaining`` new tokens are still allowed (the target's own token
    follows the block: ``remaining - 1``), within every cap given (None: no cap); never below 0. The one clamp: the
    decoder, the policies, the served proposer and the replay all call it."""
    return max(0, min([remaining - 1, *(c for c in caps if c is not None)]))


@dataclass(frozen=True)
class ServedView:
    """What a served engine's proposer shows the policy of a request (vLLM's hook gives token arrays, no request):
    the rule's ``drafters`` as the request's, no category, room for at most ``k_cap`` tokens (the engine's
    ``num_speculative_tokens``) before the context limit ``max_model_len`` (the proposer cannot see a request's
    ``max_tokens``), and the step's rows priced together at the live batch size only when ``load_aware``, else each
    alone."""

    drafters: tuple[str, ...]
    k_cap: int
    max_model_len: int
    load_aware: bool = False

    def remaining(self, context_len: int) -> int:
        """New tokens the served request may still get as the proposer sees it: its room and the target's token."""
        return room(self.max_model_len - context_len, self.k_cap) + 1

    def state(self, s: DecodeState) -> DecodeState:
        """``s`` as the served proposer sees it."""
        return replace(s, request=replace(s.request, drafters=self.drafters, category=None),
                       remaining=self.remaining(s.context_len), batch_size=s.batch_size if self.load_aware else 1,
                       load=None)


def stop_callback(policy: Policy, row: PolicyRow) -> StopFn | None:
    """The ``stop`` a drafter calls after each drafted token: the policy's ``should_stop`` for ``row`` on that token's
    confidence (None when the policy does not ask for token feedback)."""
    if not policy.needs_token_feedback:
        return None

    def stop(position: int, stats: torch.Tensor) -> bool:
        top1, entropy, margin = stats.tolist()
        return policy.should_stop(row, DraftToken(position, top1, entropy, margin))

    return stop


@dataclass(kw_only=True)
class Track:
    """One request as the controller keeps it between steps, owned by its host: the policy's row (the ``DecodeState``
    and the policy's memory), each drafter's state, how the request samples, the drafters dropped for it and the
    cooldown's moving acceptance. A host's row type extends it with what it needs besides, and gives the request's
    committed tokens as ``context`` ([n] long tensor)."""

    policy: PolicyRow
    drafts: dict = field(default_factory=dict)  # drafter name -> its state for this request (``Drafter.new_state``)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    generator: torch.Generator | None = None
    dropped: list = field(default_factory=list)
    ema: float | None = None  # moving acceptance rate of speculative steps (the cooldown's)
    cooldown: int = 0  # autoregressive steps left before the policy decides again
    spec_steps: int = 0  # speculative steps since the cooldown last ended

    @property
    def state(self) -> DecodeState:
        return self.policy.state


@dataclass(frozen=True)
class Planned:
    """A row's plan for a step: the policy's decision, whether the controller overrode it (cooldown: autoregressive),
    and what the row drafts: a drafter still usable for the request (None: none) and k within the row's room.
    ``row``: the policy's row as the policy saw it (through a ``ServedView`` where one is set), which the stop rule and
    ``observe`` hand back to the policy."""

    decision: Decision
    cooldown: bool
    drafter: str | None
    k: int
    tree: int = 0  # a token tree of at most this many nodes and depth k; 0: a chain of k
    row: PolicyRow | None = None


@dataclass(frozen=True)
class Drafted:
    """A row's draft for a step: the drafter used (None: no draft), its block and the row's seconds drafting it."""

    drafter: str | None
    block: DraftBlock
    seconds: float = 0.0


class Controller:
    """Plans and observes a policy's steps over any host's rows (module docstring). ``config``: the settings it
    reads of a ``DecoderConfig`` (``k_max``, ``tree_max``, ``batch_k``, the cooldown's); ``now``: the host's clock
    (seconds), which times each drafter's proposals; ``view``: the served proposer's view of a request (None: the
    decoder's own)."""

    def __init__(self, policy: Policy, drafters: Mapping[str, Drafter], config,
                 now: Callable[[], float], view: ServedView | None = None):
        self.policy, self.drafters, self.config, self.now, self.view = policy, dict(drafters), config, now, view
        self.peekable = frozenset(n for n, d in self.drafters.items() if isinstance(d, Peekable))

    # ------------------------------------------------------------------ plan
    def plan(self, rows: Sequence[Track], batch_size: int | None = None, load: float | None = None) -> list[Planned]:
        """Each row's plan. The host has set each state's ``context_len``, ``generated`` and ``remaining``; the
        controller sets the live ``batch_size`` (default: these rows) and ``load`` (None: the request's), peeks for a
        policy that uses peeks, and asks the policy for the rows that are not cooling down in one call (through the
        view: each row alone unless it is load-aware). The row's state names the drafter while it drafts."""
        batch_size = len(rows) if batch_size is None else batch_size
        decisions: list[tuple[Decision, bool] | None] = [None] * len(rows)
        seen: list[PolicyRow] = [row.policy for row in rows]
        asking = []
        for i, row in enumerate(rows):
            state = row.state
            state.drafter, state.batch_size, state.load = None, batch_size, load
            if row.cooldown > 0:
                row.cooldown -= 1
                decisions[i] = (Decision.autoregressive(), True)
                continue
            if self.view is not None:
                seen[i] = PolicyRow(self.view.state(state), row.policy.memory)
            if self.policy.uses_peeks:
                seen[i].state.peeks = {name: self.drafters[name].peek(row.drafts[name], row.context)
                                       for name in state.drafters if name in self.peekable}
            asking.append(i)
        if asking:
            if self.view is None or self.view.load_aware:
                answers = self.policy.decide([seen[i] for i in asking])
            else:  # each row priced as a step of its own, as the proposer that is not load-aware plans it
                answers = [self.policy.decide([seen[i]])[0] for i in asking]
            for i, decision in zip(asking, answers):
                self._check(decision)
                decisions[i] = (decision, False)
        if self.config.batch_k == "shared" and len(rows) > 1:  # one k for the batch, as vLLM drafts
            k = max(d.k for d, _ in decisions)
            decisions = [(replace(d, k=k) if d.drafter is not None else d, c) for d, c in decisions]
        plans = []
        for row, prow, (decision, cooldown) in zip(rows, seen, decisions):
            name = decision.drafter if decision.drafter in row.state.drafters else None
            k = min(decision.k, room(row.state.remaining), room(prow.state.remaining)) if name is not None else 0
            row.state.drafter = prow.state.drafter = name if k > 0 else None
            plans.append(Planned(decision, cooldown, name, k, self._tree_budget(name, decision) if k > 0 else 0,
                                 prow))
        return plans

    def _check(self, d: Decision) -> None:
        if not isinstance(d.k, int) or d.k < 0 or d.k > self.config.k_max:
            raise ValueError(f"policy {self.policy!r} chose k={d.k!r}; k must be an integer in "
                             f"[0, {self.config.k_max}]")
        if d.drafter is not None and d.drafter not in self.drafters:
            raise ValueError(f"policy {self.policy!r} chose unknown drafter {d.drafter!r}; known: "
                             f"{list(self.drafters)}")
        if d.tree is not None and (not isinstance(d.tree, int) or not 0 <= d.tree <= self.config.tree_max):
            raise ValueError(f"policy {self.policy!r} chose a token tree of {d.tree!r} nodes; it must be None (the "
                             f"drafter's default), 0 (a chain) or an integer up to decoder tree_max="
                             f"{self.config.tree_max}")

    def _tree_budget(self, name: str, decision: Decision) -> int:
        """The row's token-tree budget: the decision's, else the drafter's default; 0 (a chain) for a drafter that
        drafts chains only."""
        drafter = self.drafters[name]
        if not isinstance(drafter, DraftsTrees):
            return 0
        return int(drafter.tree_budget) if decision.tree is None else decision.tree

    # ------------------------------------------------------------------ draft
    def draft(self, rows: Sequence[Track], plans: list[Planned], device=None) -> list[Drafted]:
        """Each row's draft. Rows drafting with the same drafter draft together (one ``propose`` call; a model
        drafter runs one forward per drafted token for all of them) and share its time. A drafter that raises is
        dropped for the request of the row that made it raise (found by proposing its rows one by one); that row
        decodes on without a draft and its output stays exact. ``device``: where an empty block lives."""
        empty = DraftBlock.empty(device if device is not None else torch.device("cpu"))
        drafts = [Drafted(plan.drafter, empty) for plan in plans]
        groups: dict[str, list[int]] = {}
        for i, plan in enumerate(plans):
            if plan.k > 0:
                groups.setdefault(plan.drafter, []).append(i)
        for name, idx in groups.items():
            t0 = self.now()
            blocks = self._propose(name, [self._draft_row(rows[i], plans[i]) for i in idx], [rows[i] for i in idx])
            seconds = (self.now() - t0) / len(idx)
            for i, block in zip(idx, blocks):
                drafts[i] = Drafted(name, block, seconds) if block is not None else Drafted(None, empty, seconds)
        return drafts

    def _draft_row(self, row: Track, plan: Planned) -> DraftRow:
        return DraftRow(row.drafts[plan.drafter], row.context, plan.k, row.sampling, row.generator,
                        stop_callback(self.policy, plan.row), plan.tree)

    def _propose(self, name: str, draft_rows: list[DraftRow], rows: list[Track]) -> list[DraftBlock | None]:
        """``draft_rows``' blocks from drafter ``name``, None for a row whose request dropped it."""
        try:
            return self.drafters[name].propose(draft_rows)
        except Exception as exc:
            if len(draft_rows) == 1:
                self.drop(rows[0], name, exc)
                return [None]
            logger.warning("drafter %r raised %r drafting %d rows together; they propose one by one",
                           name, exc, len(draft_rows))
        return [self._propose(name, [d], [r])[0] for d, r in zip(draft_rows, rows)]

    def drop(self, row: Track, name: str, exc: Exception) -> None:
        """Drop drafter ``name`` for the row's request (it raised): counted in ``row.dropped``."""
        logger.warning("drafter %r raised %r; dropped for this request, decoding continues", name, exc)
        row.dropped.append(name)
        row.state.drafters = tuple(d for d in row.state.drafters if d != name)

    # ------------------------------------------------------------------ observe
    def settle(self, row: Track, drafted: Drafted, accepted: int) -> None:
        """Tell the row's drafter how many of its drafted tokens the target accepted (one that raises is dropped)."""
        if drafted.drafter is None:
            return
        try:
            self.drafters[drafted.drafter].accept(row.drafts[drafted.drafter], accepted)
        except Exception as exc:
            self.drop(row, drafted.drafter, exc)

    def observe(self, row: Track, plan: Planned, drafted: Drafted, accepted: int, emitted: int, verify_s: float = 0.0,
                batch_size: int = 1, stats: list | None = None) -> StepRecord:
        """The step's record for the row (``stats``: the block's per-token statistics [k][6], when recorded), its
        acceptance history and cooldown, and the policy's observation."""
        state = row.state
        rec = StepRecord(step=state.step, drafter=drafted.drafter, k=plan.decision.k, drafted=drafted.block.k,
                         accepted=accepted, emitted=emitted, context_len=state.context_len,
                         draft_s=drafted.seconds, verify_s=verify_s, cooldown=plan.cooldown, batch_size=batch_size,
                         tree=plan.tree if drafted.block.tree is not None else 0, guard=plan.decision.guard)
        if stats is not None:
            rec.top1, rec.entropy, rec.margin, rec.q, rec.p, rec.beta = (list(c) for c in zip(*stats))
        state.step += 1
        state.last = rec
        self._track_acceptance(row, rec)
        self.policy.observe(plan.row if plan.row is not None else row.policy, rec)
        return rec

    def _track_acceptance(self, row: Track, rec: StepRecord) -> None:
        """Per-drafter acceptance history for policies (the ``accept_ema`` feature, weight fixed by the feature spec);
        the overall EMA of accepted / drafted drives the cooldown (autoregressive steps)."""
        if not rec.drafted or rec.drafter is None:
            return
        rate = rec.accepted / rec.drafted
        history = row.state.accept_history
        history[rec.drafter] = next_accept_history(history.get(rec.drafter), rec.accepted, rec.drafted)
        cfg = self.config
        row.ema = rate if row.ema is None else cfg.cooldown_ema * rate + (1 - cfg.cooldown_ema) * row.ema
        row.spec_steps += 1
        floor = cfg.cooldown_floor
        if floor is not None and row.spec_steps >= cfg.cooldown_min_steps and row.ema < floor:
            logger.info("moving acceptance %.3f < floor %.3f: autoregressive for %d steps",
                        row.ema, floor, cfg.cooldown_steps)
            row.cooldown, row.ema, row.spec_steps = cfg.cooldown_steps, None, 0
