"""Piecewise-linear curves: what every profiled cost of ``sacpolicy.runtime.cost`` is (numpy only)."""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["PiecewiseLinear"]


def _hinge_basis(x, knots: Sequence[float]) -> np.ndarray:
    """[len(x), len(knots)] columns 1, x, max(0, x - knot) per interior knot: any continuous function that is linear
    between the knots (and beyond the outer ones) is one combination of them."""
    x = np.asarray(x, dtype=float)
    cols = [np.ones_like(x)]
    if len(knots) > 1:
        cols += [x] + [np.maximum(0.0, x - kn) for kn in knots[1:-1]]
    return np.stack(cols, axis=1)


@dataclass
class PiecewiseLinear:
    """y(x): linear interpolation between the knots (xs, ys), linear extrapolation beyond; one knot = constant.
    ``lo``/``hi``: each knot's 95% interval as measured (profiled curves), None when not measured."""

    xs: list[float]
    ys: list[float]
    lo: list[float] | None = None
    hi: list[float] | None = None

    def __post_init__(self) -> None:
        self.xs, self.ys = [float(v) for v in self.xs], [float(v) for v in self.ys]
        if not self.xs or len(self.xs) != len(self.ys):
            raise ValueError(f"a piecewise-linear curve needs as many ys as xs (>= 1), "
                             f"got {len(self.xs)} and {len(self.ys)}")
        if any(b <= a for a, b in zip(self.xs, self.xs[1:])):
            raise ValueError(f"piecewise-linear knots must be strictly increasing, got {self.xs}; "
                             "sort and deduplicate them")
        if (self.lo is None) != (self.hi is None):
            raise ValueError("a knot interval needs both lo and hi (or neither)")
        if self.lo is not None:
            self.lo, self.hi = [float(v) for v in self.lo], [float(v) for v in self.hi]
            if not len(self.lo) == len(self.hi) == len(self.xs):
                raise ValueError(f"a knot interval needs one lo and one hi per knot ({len(self.xs)}), "
                                 f"got {len(self.lo)} and {len(self.hi)}")

    def to_dict(self) -> dict:
        d = {"xs": self.xs, "ys": self.ys}
        return d if self.lo is None else {**d, "lo": self.lo, "hi": self.hi}

    def __call__(self, x: float) -> float:
        xs, ys = self.xs, self.ys
        if len(xs) == 1:
            return ys[0]
        i = min(max(bisect.bisect_right(xs, x) - 1, 0), len(xs) - 2)  # outer segments extend beyond the ends
        return ys[i] + (ys[i + 1] - ys[i]) / (xs[i + 1] - xs[i]) * (x - xs[i])

    @classmethod
    def fit(cls, x, y, knots: Sequence[float]) -> PiecewiseLinear:
        """Least-squares values at `knots` of the piecewise-linear curve closest to the points (x, y)."""
        x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
        if x.size == 0 or x.shape != y.shape:
            raise ValueError(f"fit needs matching, non-empty x and y; got shapes {x.shape} and {y.shape}")
        knots = sorted(float(k) for k in knots)
        coef, *_ = np.linalg.lstsq(_hinge_basis(x, knots), y, rcond=None)
        return cls(knots, (_hinge_basis(knots, knots) @ coef).tolist())
