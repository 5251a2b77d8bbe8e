"""Speculation policies: which drafter, how many tokens, when to stop drafting."""

from sacpolicy.policy.base import Autoregressive, Decision, DecodeState, DraftToken, Policy, PolicyRow, RequestInfo
from sacpolicy.policy.baselines import (
    Bandit,
    Confidence,
    Heuristic,
    SeedRule,
    Static,
)
from sacpolicy.policy.peers import (
    AdaEDL,
    LlamaCppPMin,
    SglangAdaptive,
    TrtllmAdaptive,
    VllmAdaptiveVerification,
    VllmBatchSchedule,
)

__all__ = [
    "AdaEDL", "Autoregressive", "Bandit", "Confidence", "Decision", "DecodeState", "DraftToken", "Heuristic",
    "LlamaCppPMin", "Policy", "PolicyRow", "RequestInfo", "SeedRule", "SglangAdaptive", "Static", "TrtllmAdaptive",
    "VllmAdaptiveVerification", "VllmBatchSchedule",
]
