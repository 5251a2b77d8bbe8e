"""Lossless speculative decoding: sampling/verification math, drafters and the decoder loop. Of sacpolicy it imports
only ``sacpolicy.runtime`` (numpy, the lowest layer): nothing from policy, training, traces, evaluation, export or
pipeline."""

from sacpolicy.decoding import types
from sacpolicy.decoding.decoder import DecoderConfig, SpeculativeDecoder
from sacpolicy.decoding.drafters import LayerSkipDrafter, ModelDrafter, NgramDrafter
from sacpolicy.decoding.sampling import SamplingConfig
from sacpolicy.decoding.suffix import SuffixDrafter
from sacpolicy.decoding.types import *  # noqa: F403 (the decoder's vocabulary: types.__all__)

__all__ = ["DecoderConfig", "LayerSkipDrafter", "ModelDrafter", "NgramDrafter", "SamplingConfig", "SpeculativeDecoder",
           "SuffixDrafter", *types.__all__]
