"""Speculation policies: which drafter, how many tokens, when to stop drafting."""

from sacpolicy.policy.base import Autoregressive, Decision, DecodeState, DraftToken, Policy, PolicyRow, RequestInfo
from sacpolicy.policy.baselines import (
    Bandit,
    Confidence,
    Heuristic,
    SeedRule,
    Static,
)

__all__ = [
    "Autoregressive", "Bandit", "Confidence", "DecodeState", "Decision", "DraftToken", "Heuristic", "Policy",
    "PolicyRow", "RequestInfo", "SeedRule", "Static",
]
