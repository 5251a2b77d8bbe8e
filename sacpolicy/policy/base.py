"""The policy protocol: decide which drafter and how many tokens to draft, from a state; never touch models or caches.

A policy sees three things, all plain data:
- ``RequestInfo`` once per request (prompt length, category, load signal, drafters on offer);
- ``DecodeState`` before each step, to return a ``Decision`` (drafter name or None, and k);
- the drafted tokens' confidence (``DraftToken``) as they are drafted, if it wants to stop early
  (``needs_token_feedback``; costs one host sync per drafted token on GPUs), and the finished ``StepRecord``.
New inputs go into these dataclasses, never into new method parameters.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # records live with the decoder; policies only read them
    from sacpolicy.decoding.records import StepRecord


@dataclass(frozen=True)
class RequestInfo:
    prompt_len: int
    max_new_tokens: int
    drafters: tuple[str, ...]
    category: str | None = None
    load: float = 0.0  # serving load signal in [0, 1]; 0 = idle


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
    accept_ema: dict[str, float] = field(default_factory=dict)  # per drafter, EMA of accepted / drafted
    drafter: str | None = None  # while drafting: the drafter in use
    # before deciding, for policies that ask (``uses_peeks``): drafters that can tell cheaply what they would propose
    # (n-gram) -> its confidence (top-1, entropy, margin), or None when they would propose nothing
    peeks: dict[str, tuple[float, float, float] | None] = field(default_factory=dict)


@dataclass(frozen=True)
class Decision:
    drafter: str | None  # None = autoregressive step
    k: int

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


class Policy:
    """Base class with the no-op defaults; subclasses override ``decide`` and whatever else they use."""

    name: str = "policy"
    needs_token_feedback: bool = False
    uses_peeks: bool = False  # fill DecodeState.peeks before each decision (one lookup per peekable drafter)

    def validate(self, drafters: tuple[str, ...], max_k: int) -> None:
        """Fail before decoding if this policy cannot run with these drafters and this k limit."""

    def reset(self, request: RequestInfo) -> None:
        """A new request starts."""

    def decide(self, state: DecodeState) -> Decision:
        raise NotImplementedError

    def should_stop(self, state: DecodeState, token: DraftToken) -> bool:
        """Called after each drafted token when ``needs_token_feedback``; True ends the block after this token."""
        return False

    def observe(self, record: StepRecord) -> None:
        """The outcome of the step just taken."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name})"


def check_k(k: int, max_k: int, who: str) -> None:
    if not isinstance(k, int) or k < 0:
        raise ValueError(f"{who}: k must be an integer >= 0 (0 = autoregressive), got {k!r}")
    if k > max_k:
        raise ValueError(
            f"{who}: k={k} exceeds the decoder's max_k={max_k}; lower k or raise decoder.max_k"
        )


def check_drafter(name: str | None, drafters: tuple[str, ...], who: str) -> None:
    if name is not None and name not in drafters:
        raise ValueError(
            f"{who}: drafter {name!r} is not among the decoder's drafters {list(drafters)}; "
            "add it to the decoder's drafters or pick one of those"
        )
