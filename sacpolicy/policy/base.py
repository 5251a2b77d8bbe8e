"""Policies decide which drafter and how many tokens to draft, from a state; they never touch models or caches.

The protocol and the data it reads (``Policy``, ``PolicyRow``, ``Autoregressive``; ``RequestInfo``, ``DecodeState``,
``Decision``, ``DraftToken``) live in the decoder's ``sacpolicy.decoding.protocols`` and ``sacpolicy.decoding.types``;
this module re-exports them with the policies' checks.
"""

from __future__ import annotations

from sacpolicy.decoding.protocols import Autoregressive, Policy, PolicyRow
from sacpolicy.decoding.types import Decision, DecodeState, DraftToken, RequestInfo, StepRecord

__all__ = ["Autoregressive", "DecodeState", "Decision", "DraftToken", "Policy", "PolicyRow", "RequestInfo", "StepRecord", "check_drafter",
           "check_k"]


def check_k(k: int, k_max: int, who: str) -> None:
    if not isinstance(k, int) or k < 0:
        raise ValueError(f"{who}: k must be an integer >= 0 (0 = autoregressive), got {k!r}")
    if k > k_max:
        raise ValueError(
            f"{who}: k={k} exceeds the decoder's k_max={k_max}; lower k or raise decoder.k_max"
        )


def check_drafter(name: str | None, drafters: tuple[str, ...], who: str) -> None:
    if name is not None and name not in drafters:
        raise ValueError(
            f"{who}: drafter {name!r} is not among the decoder's drafters {list(drafters)}; "
            "add it to the decoder's drafters or pick one of those"
        )
