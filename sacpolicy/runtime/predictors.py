"""Acceptance predictors as plain numpy arrays: gradient-boosted trees, a logistic model or an MLP, each followed by
an isotonic calibration map. Training (scikit-learn, Lightning) compiles its model into a ``Predictor``; the learned
policy and the exported runtime evaluate that same object, so they cannot disagree, and nothing is ever pickled:
the arrays go to safetensors and the rest to JSON.

``predict(X)`` takes rows of ``sacpolicy.runtime.features.feature_vector`` and returns calibrated probabilities that
the drafted token is accepted given that every earlier token of its block was.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from sacpolicy.runtime.features import FEATURE_NAMES

DRAFTER_INDEX = FEATURE_NAMES.index("drafter_index")

KINDS = ("trees", "linear", "mlp")
# arrays each kind needs (mlp: plus w0, b0, w1, b1, ... one pair per layer)
_REQUIRED = {
    "trees": ("feature", "threshold", "left", "right", "missing_left", "leaf", "value", "roots", "baseline"),
    "linear": ("mean", "scale", "coef", "intercept"),
    "mlp": ("mean", "scale"),
}


class PredictorError(ValueError):
    pass


def _sigmoid(z: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.tanh(0.5 * z))  # = 1 / (1 + exp(-z)) without overflow warnings


@dataclass
class Predictor:
    kind: str
    arrays: dict[str, np.ndarray]
    meta: dict = field(default_factory=dict)  # feature spec, training provenance, held-out metrics

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise PredictorError(f"unknown predictor kind {self.kind!r}; kinds are {list(KINDS)}")
        missing = [a for a in _REQUIRED[self.kind] if a not in self.arrays]
        if self.kind == "mlp" and "w0" not in self.arrays:
            missing.append("w0")
        if missing:
            raise PredictorError(f"{self.kind} predictor lacks arrays {missing}; re-export it from training")
        if ("calib_x" in self.arrays) != ("calib_y" in self.arrays):
            raise PredictorError("a calibration map needs both calib_x and calib_y")
        self.arrays = {k: np.asarray(v) for k, v in self.arrays.items()}
        if self.kind == "trees":
            self._depth = self._max_depth()
        if self.kind == "mlp":
            self._layers = sum(1 for k in self.arrays if k.startswith("w"))

    # ------------------------------------------------------------------ evaluation
    def raw(self, X) -> np.ndarray:
        """Uncalibrated probabilities, [n]."""
        X = np.asarray(X, dtype=np.float64)
        if X.ndim != 2:
            raise PredictorError(f"predict needs a 2-d array of feature rows, got shape {X.shape}")
        return getattr(self, f"_{self.kind}")(X)

    def predict(self, X) -> np.ndarray:
        """Calibrated probabilities: each row through its drafter's isotonic map (``calib_x_d<i>``/``calib_y_d<i>``,
        drafter index i) when it has one, else through the shared map (``calib_x``/``calib_y``)."""
        X = np.asarray(X, dtype=np.float64)
        raw = self.raw(X)
        p = raw
        if "calib_x" in self.arrays:
            p = np.interp(raw, self.arrays["calib_x"], self.arrays["calib_y"])
            drafter = X[:, DRAFTER_INDEX]
            for i in np.unique(drafter):
                key = f"_d{int(i)}"
                if f"calib_x{key}" in self.arrays:
                    rows = drafter == i
                    p[rows] = np.interp(raw[rows], self.arrays[f"calib_x{key}"], self.arrays[f"calib_y{key}"])
        return np.clip(p, 0.0, 1.0)

    def _trees(self, X: np.ndarray) -> np.ndarray:
        a = self.arrays
        node = np.broadcast_to(a["roots"], (X.shape[0], a["roots"].size)).copy()  # [rows, trees]
        rows = np.arange(X.shape[0])[:, None]
        for _ in range(self._depth):
            x = X[rows, a["feature"][node]]
            left = np.where(np.isnan(x), a["missing_left"][node], x <= a["threshold"][node])
            node = np.where(a["leaf"][node], node, np.where(left, a["left"][node], a["right"][node]))
        return _sigmoid(a["baseline"][0] + a["value"][node].sum(axis=1))

    def _standardize(self, X: np.ndarray) -> np.ndarray:
        z = (X - self.arrays["mean"]) / self.arrays["scale"]
        return np.nan_to_num(z, nan=0.0, posinf=0.0, neginf=0.0)  # unknown (NaN) features sit at the mean

    def _linear(self, X: np.ndarray) -> np.ndarray:
        return _sigmoid(self._standardize(X) @ self.arrays["coef"] + self.arrays["intercept"][0])

    def _mlp(self, X: np.ndarray) -> np.ndarray:
        h = self._standardize(X)
        for i in range(self._layers):
            h = h @ self.arrays[f"w{i}"].T.astype(np.float64) + self.arrays[f"b{i}"]
            if i < self._layers - 1:
                h = np.maximum(h, 0.0)
        return _sigmoid(h[:, 0])

    def _max_depth(self) -> int:
        """Longest root-to-leaf path: how many steps the vectorised walk needs."""
        a, best = self.arrays, 0
        stack = [(int(r), 0) for r in a["roots"]]
        while stack:
            n, d = stack.pop()
            if d > len(a["feature"]):
                raise PredictorError("tree arrays contain a cycle; re-export the predictor")
            if a["leaf"][n]:
                best = max(best, d)
            else:
                stack += [(int(a["left"][n]), d + 1), (int(a["right"][n]), d + 1)]
        return best

