"""The decoder's two protocols, frozen early (``shared/STYLE.md``): a ``Drafter`` (propose up to k tokens for the rows
of a batch, with optional capabilities tested with ``isinstance``) and a ``Policy`` (decide a drafter and k per row from
plain data; optionally stop a block early; observe the outcome). The decoder, the served proposer and the replay call
them through one controller (``decoding.controller``); the policies themselves are ``sacpolicy.policy``, which
re-exports ``Policy``, ``PolicyRow`` and ``Autoregressive`` for policy authors.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from sacpolicy.decoding.types import Decision, DecodeState, DraftBlock, DraftRow, DraftToken, RequestInfo, StepRecord

__all__ = ["Autoregressive", "Drafter", "DraftsTrees", "Peekable", "Policy", "PolicyRow", "ReadsFeatures",
           "Resettable", "feature_layers", "fresh_drafters", "reset_drafters"]


# ---------------------------------------------------------------------- drafters
class Drafter(Protocol):
    """The drafter protocol's core, with the defaults of its optional parts (``new_state``, ``accept``): subclass it
    and write ``propose``, or match it structurally. A drafter holds what its rows share (weights, a model); what one
    request needs between steps (a KV cache, nothing at all) lives in a state object it makes with ``new_state`` and
    the decoder keeps for the row, handing it back in every call. After verification the drafter is told how many of
    the row's tokens the target accepted (``accept``), so it can roll that state back exactly.

    ``propose`` takes the rows of a batch together, one row being a list of one: model drafters run their rows
    through one forward per drafted token; others may propose row after row.

    What only some drafters can do is a capability protocol of its own, which callers test with ``isinstance``:
    ``Peekable`` (a cheap look at the next proposal), ``ReadsFeatures`` (the target's hidden states, EAGLE-3 heads),
    ``TeacherForcing`` (a faster teacher-forced pass than proposing position by position: ``teacher_force``) and
    ``Resettable`` (state kept across requests, which an evaluation starts afresh for each run).
    """

    name: str
    vocab_size: int | None = None  # logits width; None for drafters without a distribution (n-gram)

    def new_state(self) -> object:
        """The state of one request's row (a new request gets a new one). The default, None: nothing kept."""
        return None

    def propose(self, rows: list[DraftRow]) -> list[DraftBlock]:
        """One block per row, at most ``row.k`` tokens each."""
        raise NotImplementedError

    def accept(self, state, n_accepted: int) -> None:
        """The target accepted the first n_accepted tokens of the row's last proposal."""


@runtime_checkable
class Peekable(Protocol):
    """A drafter whose proposal is a cheap lookup (the n-gram, the suffix tree): ``peek`` tells what ``propose``
    would make now, as cheaply as proposing it, so a policy (``Policy.uses_peeks``) may decide before drafting."""

    def peek(self, state, context: torch.Tensor) -> tuple[tuple[float, float, float], ...] | None:
        """The proposal ``propose`` would make now: the confidence (top-1, entropy, margin) of each of its tokens
        (``sacpolicy.runtime.features.Peek``), or None when it would propose nothing."""
        ...


@runtime_checkable
class DraftsTrees(Protocol):
    """A drafter that drafts token trees (EAGLE-2): for a row whose ``DraftRow.tree`` is n > 0 it proposes a block
    carrying a ``TokenTree`` of at most n nodes and depth ``k``. ``tree_budget``: the budget a ``Decision`` without one
    (``tree=None``) gets (0: chains). Other drafters are always asked for chains."""

    tree_budget: int


@runtime_checkable
class ReadsFeatures(Protocol):
    """A feature drafter (EAGLE-3 heads) reads the target's hidden states: it lists the target layers it needs in
    ``aux_layers`` (HF ``output_hidden_states`` indices: the input of decoder layer i), and after every target pass
    the decoder hands each row's state those states for the newly committed positions (``extend_features``).
    Token-level drafters do not implement it and never see a hidden state."""

    aux_layers: tuple[int, ...]

    def extend_features(self, state, aux: torch.Tensor) -> None:
        """``aux`` [m, len(aux_layers) * H], the target's hidden states at the row's next m committed positions (in
        order; position t's row is read with token t + 1). After every target pass the row's state holds rows for
        every committed position but the last."""
        ...


@runtime_checkable
class Resettable(Protocol):
    """A drafter that keeps state across requests (the suffix drafter's global index): ``reset`` forgets every
    earlier request by binding a new, empty state, so a shallow copy reset this way shares nothing of it with the
    original. Runs that must not see each other's outputs (policies evaluated live on the same prompts, in turn)
    decode with their own copies (``fresh_drafters``) or reset between them (``reset_drafters``)."""

    def reset(self) -> None:
        ...


def feature_layers(drafter) -> tuple[int, ...]:
    """The target layers whose hidden states ``drafter`` reads (``ReadsFeatures``); () for token-level drafters."""
    return tuple(drafter.aux_layers) if isinstance(drafter, ReadsFeatures) else ()


def reset_drafters(drafters) -> None:
    """Forget what ``drafters`` (an iterable) kept from earlier requests: ``reset`` every ``Resettable`` one."""
    for d in drafters:
        if isinstance(d, Resettable):
            d.reset()


def fresh_drafters(drafters) -> list:
    """``drafters`` for a run of its own: each ``Resettable`` one a shallow copy, reset (its weights and settings
    shared, its cross-request state new and its own), the others as they are (they keep no request's state)."""
    out = []
    for d in drafters:
        if isinstance(d, Resettable):
            d = copy.copy(d)
            d.reset()
        out.append(d)
    return out


# ---------------------------------------------------------------------- policies
@dataclass
class PolicyRow:
    """One row of a ``Policy.decide`` call: the decoder's state of the row's request and the policy's own memory of
    it (``Policy.start``), which the decoder keeps for the row and hands back with every call."""

    state: DecodeState
    memory: object = None


class Policy:
    """The policy protocol, with no-op defaults; subclasses override ``decide`` and whatever else they use. A policy
    never touches models or caches. What it remembers of one request lives in the memory ``start`` returns (the
    decoder keeps it per row); what it learns across requests lives on the policy itself. ``None`` as the decoder's
    policy means autoregressive decoding."""

    name: str = "policy"
    needs_token_feedback: bool = False
    uses_peeks: bool = False  # fill DecodeState.peeks before each decision (one lookup per peekable drafter)

    def validate(self, drafters: tuple[str, ...], k_max: int) -> None:
        """Fail before decoding if this policy cannot run with these drafters and this k limit."""

    def start(self, request: RequestInfo) -> object:
        """A request starts: the policy's memory of it (None: nothing to remember)."""
        return None

    def decide(self, rows: list[PolicyRow]) -> list[Decision]:
        """A decision per row of the batch (one request: a list of one). A policy that plans for the whole batch
        (the learned rule: the batch's tokens/s at its live size) reads all rows at once."""
        raise NotImplementedError

    def should_stop(self, row: PolicyRow, token: DraftToken) -> bool:
        """Called after each drafted token when ``needs_token_feedback``; True ends the block after this token."""
        return False

    def observe(self, row: PolicyRow, record: StepRecord) -> None:
        """The outcome of the step the row just took."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name})"


class Autoregressive(Policy):
    """Never draft: plain autoregressive decoding through the same loop (the decoder's default policy)."""

    name = "ar"

    def decide(self, rows: list[PolicyRow]) -> list[Decision]:
        return [Decision.autoregressive()] * len(rows)
