"""The per-request state the decoder owns (``Row``: one row of a batch, the controller's ``Track`` of the request
with the decoder's buffers) and the clock it reads."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Protocol

import torch

from sacpolicy.decoding.controller import Track
from sacpolicy.decoding.types import GenerationResult


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


@dataclass(kw_only=True)
class Row(Track):
    """One request being decoded (one row of the batch): the controller's ``Track`` of it (the policy's row and
    memory, each drafter's state, its sampling and generator) and its tokens, all owned by the decoder for the
    request's lifetime."""

    buf: torch.Tensor  # [prompt + limit + k_max + 1] committed tokens, then scratch space for a block
    stops: frozenset
    limit: int  # new tokens allowed (the budget, or less where the context ends)
    max_new_tokens: int
    arrival: float = 0.0
    index: int = 0
    n: int = 0  # committed tokens in buf (the row's cache holds buf[:n - 1])
    out: list = field(default_factory=list)
    records: list = field(default_factory=list)
    finish: str | None = None
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

    @property
    def context(self) -> torch.Tensor:
        """The committed tokens."""
        return self.buf[: self.n]
