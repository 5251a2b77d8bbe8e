"""Lossless speculative decoding: sampling/verification math, drafters and the decoder loop."""

from sacpolicy.decoding.decoder import DecoderConfig, SpeculativeDecoder
from sacpolicy.decoding.drafters import DraftBlock, Drafter, LayerSkipDrafter, ModelDrafter, NgramDrafter
from sacpolicy.decoding.records import GenerationResult, StepRecord
from sacpolicy.decoding.sampling import SamplingConfig

__all__ = [
    "DecoderConfig", "DraftBlock", "Drafter", "GenerationResult", "LayerSkipDrafter", "ModelDrafter",
    "NgramDrafter", "SamplingConfig", "SpeculativeDecoder", "StepRecord",
]
