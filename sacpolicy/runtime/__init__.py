"""The numpy-only runtime: the feature function, the cost model, compiled predictors and the learned decision rule.

Production decoders import this package alone (no torch, scikit-learn or Lightning) to run an exported policy; the
framework's own policies call the same code, so decisions match exactly.
"""

from sacpolicy.runtime.artifact import (
    ArtifactError,
    PolicyArtifact,
    load_artifact,
    load_policy,
    save_policy,
)
from sacpolicy.runtime.cost import CostModel, PiecewiseLinear
from sacpolicy.runtime.features import (
    FEATURE_NAMES,
    FEATURE_VERSION,
    feature_spec,
    feature_vector,
)
from sacpolicy.runtime.predictors import Predictor, PredictorError
from sacpolicy.runtime.rule import Block, DecisionRule, RuleError

__all__ = [
    "ArtifactError", "Block", "CostModel", "DecisionRule", "FEATURE_NAMES", "FEATURE_VERSION", "PiecewiseLinear",
    "PolicyArtifact", "Predictor", "PredictorError", "RuleError", "feature_spec", "feature_vector", "load_artifact",
    "load_policy", "save_policy",
]
