"""The decoder's vocabulary, plain data: what a request is (``RequestInfo``), the state a policy reads
(``DecodeState``), a decision, a drafted token's confidence, a step's record, a request's result, a draft block and a
drafter's row. A leaf module: it imports nothing from sacpolicy but the sampling math and the token tree's layout,
and every other layer imports it, never the reverse. The two protocols that use this data (``Drafter``, with its
optional capabilities, and ``Policy``) are ``decoding.protocols``; teacher forcing is ``decoding.teacher``.

A policy sees three things, all plain data:
- ``RequestInfo`` once per request (prompt length, category, load signal, drafters on offer), to start its memory
  of the request;
- ``DecodeState`` of every row before each step (``PolicyRow``: the state and that memory), to return a
  ``Decision`` per row (drafter name or None, and k);
- the drafted tokens' confidence (``DraftToken``) as they are drafted, if it wants to stop early
  (``needs_token_feedback``; costs one host sync per drafted token on GPUs), and the finished ``StepRecord``.
New inputs go into these dataclasses, never into new method parameters.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Callable

import torch

from sacpolicy.decoding.sampling import SamplingConfig
from sacpolicy.decoding.tree import TokenTree

__all__ = ["DecodeState", "Decision", "DraftBlock", "DraftRow", "DraftToken", "GenerationResult", "RequestInfo",
           "StepRecord", "StopFn"]


# ---------------------------------------------------------------------- requests, state, decisions
@dataclass(frozen=True)
class RequestInfo:
    """What is known of a request before it is decoded. ``generate`` fills ``prompt_len``, ``max_new_tokens``,
    ``drafters`` and, when left None, ``sampling`` (the decoder's); callers pass the rest (``RequestInfo(category=...,
    load=..., seed=...)``)."""

    prompt_len: int = 0
    max_new_tokens: int = 0
    drafters: tuple[str, ...] = ()
    category: str | None = None
    load: float = 0.0  # serving load signal in [0, 1]; 0 = idle
    seed: int | None = None  # sampling seed of this request (None: the decoder's generator continues)
    sampling: SamplingConfig | None = None  # this request's sampling settings (None: the decoder's); rows of one
    # batch may differ, each is verified with its own


@dataclass
class DecodeState:
    """What the decoder knows before a step (and while drafting it)."""

    request: RequestInfo
    step: int = 0  # speculative steps taken so far (prefill excluded)
    context_len: int = 0  # committed tokens: prompt + generated
    generated: int = 0
    remaining: int = 0  # new tokens still allowed
    drafters: tuple[str, ...] = ()  # drafters still usable (a failing drafter is dropped for the request)
    last: StepRecord | None = None
    # per drafter, its acceptance history in the request (``runtime.features.next_accept_history``)
    accept_history: dict[str, tuple[float, float]] = field(default_factory=dict)
    drafter: str | None = None  # while drafting: the drafter in use
    # before deciding, for policies that ask (``uses_peeks``): drafters that can tell cheaply what they would propose
    # (n-gram, suffix) -> each proposed token's confidence (top-1, entropy, margin), or None when they propose nothing
    peeks: dict[str, tuple[tuple[float, float, float], ...] | None] = field(default_factory=dict)
    batch_size: int = 1  # rows the decoder verifies together this step (live, not configured)
    load: float | None = None  # live load in [0, 1] (rows / max_batch when decoding in batches); None: the request's

    @property
    def load_signal(self) -> float:
        """The load policies and features read: live when the decoder measures it, else the request's."""
        return self.request.load if self.load is None else self.load


@dataclass(frozen=True)
class Decision:
    drafter: str | None  # None = autoregressive step
    k: int  # a chain's length; a tree's depth at most
    # a token tree of at most this many nodes (depth <= k; ``DraftsTrees`` drafters only), 0 a chain of k; None: the
    # drafter's own default (``DraftsTrees.tree_budget``, 0 for drafters that draft chains only)
    tree: int | None = None
    # the policy's guard chose this block in place of its own plan (a learning policy fallen back to the static block
    # its shadow accounting found better: ``runtime.online.ShadowGuard``); the step's record and log say so
    guard: bool = False

    @classmethod
    def autoregressive(cls) -> Decision:
        return cls(None, 0)


@dataclass(frozen=True)
class DraftToken:
    """Confidence of one drafted token, at temperature 1 whatever the sampling settings."""

    position: int  # 0-based index within the draft block
    top1: float
    entropy: float
    margin: float  # top-1 minus top-2 probability


# ---------------------------------------------------------------------- what the decoder returns
@dataclass
class StepRecord:
    """One speculative step: draft (maybe nothing), verify in one target pass, emit accepted + 1 tokens.

    Per drafted token (lists of length ``drafted``): draft confidence at temperature 1 (``top1``, ``entropy``,
    ``margin``), and ``q``/``p``/``beta``: the draft and target probability of the drafted token and
    beta = sum_x min(p, q). When sampling they come from the processed distributions (the ones verification uses);
    when greedy (where processed distributions are one-hot) from the temperature-1 distributions, so they stay
    informative.
    """

    step: int
    drafter: str | None
    k: int  # decided
    drafted: int  # actually drafted (a drafter may stop early or find nothing)
    accepted: int
    emitted: int  # tokens appended to the output (accepted + 1, fewer when EOS or the length limit cut the block)
    context_len: int  # committed tokens before the step
    draft_s: float
    verify_s: float
    cooldown: bool = False  # the decoder overrode the policy with an autoregressive step (low moving acceptance)
    batch_size: int = 1  # rows verified in the same target pass (verify_s is that whole pass)
    tree: int = 0  # a token tree's node budget (``drafted`` its nodes, ``accepted`` its accepted path); 0: a chain
    guard: bool = False  # the policy's guard decided the step (``Decision.guard``)
    top1: list[float] = field(default_factory=list)
    entropy: list[float] = field(default_factory=list)
    margin: list[float] = field(default_factory=list)
    q: list[float] = field(default_factory=list)
    p: list[float] = field(default_factory=list)
    beta: list[float] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class GenerationResult:
    tokens: list[int]  # new tokens only
    steps: list[StepRecord]
    prompt_len: int
    prefill_s: float
    total_s: float
    finish_reason: str  # "eos" | "length" | "context"
    dropped_drafters: list[str] = field(default_factory=list)
    logits: object = None  # generate(keep_logits=True): the target's logits behind each new token, [new, V] tensor
    queued_s: float = 0.0  # generate_batch: from the request's arrival to its admission into the batch

    @property
    def latency_s(self) -> float:
        """Arrival to last token: time queued + prefill + decoding."""
        return self.queued_s + self.total_s

    @property
    def target_calls(self) -> int:
        return len(self.steps) + 1  # + the prefill pass

    @property
    def decode_s(self) -> float:
        return self.total_s - self.prefill_s

    @property
    def tokens_per_s(self) -> float:
        return len(self.tokens) / self.total_s if self.total_s > 0 else 0.0

    @property
    def tokens_per_call(self) -> float:
        """Tokens emitted per target call (the 'tau' of the papers), counting the prefill pass's first token."""
        return len(self.tokens) / self.target_calls

    @property
    def acceptance_rate(self) -> float:
        drafted = sum(s.drafted for s in self.steps)
        return sum(s.accepted for s in self.steps) / drafted if drafted else 0.0

    @property
    def draft_s(self) -> float:
        return sum(s.draft_s for s in self.steps)

    @property
    def verify_s(self) -> float:
        return sum(s.verify_s for s in self.steps)


# ---------------------------------------------------------------------- drafts
# Called after each drafted token with (position in block, draft_stats of that position: [top-1 prob, entropy,
# margin]); True stops the block after this token.
StopFn = Callable[[int, torch.Tensor], bool]


@dataclass
class DraftBlock:
    tokens: torch.Tensor  # [k] long, on the target's device
    logits: torch.Tensor | None  # [k, V] raw draft logits the tokens were chosen from; None = deterministic proposal
    # [k, 3] confidence in the draft_stats layout (top-1, entropy, margin) the drafter assigns its tokens: a
    # deterministic proposal's own (None = certain, [1, 0, 1]), or a model draft's draft_stats of ``logits`` made
    # by the drafter over its own vocabulary (None = the decoder makes them)
    confidence: torch.Tensor | None = None
    # sampled model drafts only: [k, V] the processed distribution q each token was drawn from (sampling.
    # probs_from_logits of ``logits`` at the row's settings), handed to verification as is; None = the decoder makes it
    probs: torch.Tensor | None = None
    # a token tree (``tokens`` its nodes in order; ``logits`` and ``probs`` None: its nodes are verified as proposals
    # of probability one, ``sampling.verify_tree``); None: a chain
    tree: TokenTree | None = None

    @property
    def k(self) -> int:
        return int(self.tokens.shape[0])

    @classmethod
    def empty(cls, device: torch.device) -> DraftBlock:
        return cls(torch.empty(0, dtype=torch.long, device=device), None)


@dataclass
class DraftRow:
    """One row of a ``Drafter.propose`` call: what to draft after which context, with the row's own state."""

    state: object  # the drafter's state for this row's request (``Drafter.new_state``), owned by the decoder
    context: torch.Tensor  # [n] committed tokens (prompt + output so far)
    k: int  # at most this many tokens
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    generator: torch.Generator | None = None
    stop: StopFn | None = None  # called after each drafted token; True ends the block there
    tree: int = 0  # ``DraftsTrees`` drafters: draft a token tree of at most this many nodes and depth k (0: a chain)
