"""Lossless speculative decoding: sampling/verification math, drafters and the decoder loop. Of sacpolicy it imports
only ``sacpolicy.runtime`` (numpy, the lowest layer): nothing from policy, training, traces, evaluation, export or
pipeline. This package's namespace is the decoder's public API: its data (``types``), its two protocols
(``protocols``), teacher forcing (``teacher``), token trees (``tree``) and the decoder."""

from sacpolicy.decoding import protocols, teacher, types
from sacpolicy.decoding.decoder import DecoderConfig, SpeculativeDecoder
from sacpolicy.decoding.drafters import LayerSkipDrafter, ModelDrafter, NgramDrafter
from sacpolicy.decoding.protocols import *  # noqa: F403 (the two protocols: protocols.__all__)
from sacpolicy.decoding.sampling import SamplingConfig
from sacpolicy.decoding.suffix import SuffixDrafter
from sacpolicy.decoding.teacher import *  # noqa: F403 (teacher forcing: teacher.__all__)
from sacpolicy.decoding.tree import TokenTree
from sacpolicy.decoding.types import *  # noqa: F403 (the decoder's data: types.__all__)

__all__ = ["DecoderConfig", "LayerSkipDrafter", "ModelDrafter", "NgramDrafter", "SamplingConfig", "SpeculativeDecoder",
           "SuffixDrafter", "TokenTree", *types.__all__, *protocols.__all__, *teacher.__all__]
