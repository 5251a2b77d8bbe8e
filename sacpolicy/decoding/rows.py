"""The per-request state the decoder owns (``Row``: one row of a batch, with its policy memory and its drafters'
states), the clock it reads, and the stop callback that turns a policy's ``should_stop`` into a drafter's ``stop``."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Protocol

import torch

from sacpolicy.decoding.sampling import SamplingConfig
from sacpolicy.decoding.types import DraftToken, GenerationResult, Policy, PolicyRow, StopFn


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


def stop_callback(policy: Policy, row: PolicyRow) -> StopFn | None:
    """The ``stop`` a drafter calls after each drafted token: the policy's ``should_stop`` for ``row`` on that token's
    confidence (None when the policy does not ask for token feedback). Production proposers that reuse a drafter
    call it too."""
    if not policy.needs_token_feedback:
        return None

    def stop(position: int, stats: torch.Tensor) -> bool:
        top1, entropy, margin = stats.tolist()
        return policy.should_stop(row, DraftToken(position, top1, entropy, margin))

    return stop


@dataclass
class Row:
    """One request being decoded (one row of the batch): its tokens, the policy's memory of it and each drafter's
    state, all owned by the decoder for the request's lifetime."""

    buf: torch.Tensor  # [prompt + limit + k_max + 1] committed tokens, then scratch space for a block
    stops: frozenset
    limit: int  # new tokens allowed (the budget, or less where the context ends)
    max_new_tokens: int
    policy: PolicyRow  # the decoder's state of the request (``policy.state``) and the policy's memory of it
    drafts: dict  # drafter name -> that drafter's state for this request (``Drafter.new_state``)
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
    def state(self):
        """The ``DecodeState`` the policy reads."""
        return self.policy.state

    @property
    def left(self) -> int:
        return self.limit - len(self.out)

    @property
    def active(self) -> bool:
        """Still decoding: no stop token yet and room for more tokens."""
        return self.finish is None and self.left > 0

    @property
    def context(self) -> torch.Tensor:
        """The committed tokens."""
        return self.buf[: self.n]
