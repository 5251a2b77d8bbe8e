"""Learning while serving: what every verify step teaches the learned rule, numpy and plain Python only (production
engines load it with the rule).

Every verify step gives exact labels for free: of a chain of n drafted tokens the target accepted the first a, so
positions 0..a-1 were accepted, position a (when a < n) rejected, and the positions after it were never at risk. Two
learners read them, both bounded in memory and O(1) per labelled token, both single-threaded (the host calls them
from its own step, in order; no locks):

- ``OnlineCalibration``: the fitted predictor's probability p of a token's acceptance, recalibrated per drafter and
  block position by an online logistic regression on (logit p, 1, a few features of the row) whose weights start at
  the identity (the fitted model exactly) and are pulled back toward it by an L2 term (``shrink``), so traffic the
  predictor was not fitted on moves its probabilities while a few steps cannot undo the fit. Weights stay in fixed
  bounds and non-finite inputs are skipped: no label stream makes them NaN or unbounded. A prequential gate decides
  where the calibration is used: per cell, running means (exponentially weighted over about ``gate_window`` labels)
  of the log-loss of the fitted p and of the calibrated p, each scored on a label before the update that label
  causes; the calibrated p replaces the fitted one only in cells where its mean loss is lower by more than
  ``gate_margin`` nats per label. On the traffic the predictor was fitted on (already calibrated there) the gate
  stays closed and the rule decides exactly as fitted; where traffic shifts, the calibration wins and is used.
- ``ShadowGuard``: the static blocks the same steps price without drafting them. A chain of n drafted tokens with a
  accepted gives every static block of k' <= n tokens with the same drafter min(a, k') accepted tokens, and
  autoregressive decoding (k' = 0) is priced on every step; the cost model times both. Over a window of steps, when
  the rule's realized tokens per unit of cost fall below the best shadow's by more than ``margin`` (each compared on
  the steps where that shadow is defined), the rule hands its decisions to that static block for ``hold`` steps
  (the step log says so: ``Decision.guard``), then tries again on a fresh window. A shadow defined on only some of
  the window's steps (the rule drafted that far with that drafter only where it expected acceptance) would be judged
  on the steps that favour it, and then run on all of them: a shadow must be defined on at least ``coverage`` of
  the window's steps to win.

The learners' state is the policy's: a replay of the same steps in the same order reproduces every decision.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

from sacpolicy.runtime.cost import CostModel
from sacpolicy.runtime.features import FEATURE_NAMES

_TOP1 = FEATURE_NAMES.index("top1")
_CONF_KNOWN = FEATURE_NAMES.index("conf_known")
_ACCEPT_EMA = FEATURE_NAMES.index("accept_ema")
_HAS_EMA = FEATURE_NAMES.index("has_accept_ema")
_POSITION = FEATURE_NAMES.index("position")
_DRAFTER = FEATURE_NAMES.index("drafter_index")
LOGIT_CAP = 8.0  # |logit p| at most this (p within [3e-4, 1 - 3e-4]) where calibration applies
P_SCORE = 1e-4  # the gate scores probabilities clipped to [P_SCORE, 1 - P_SCORE]: a label costs at most ~9.2 nats
GATE_WARM = 0.5  # a cell's gate opens only once its running means hold this share of their full weight
# bounds of the calibration weights (slope on logit p, bias, feature weights): never unbounded whatever the labels
SLOPE_BOUNDS = (0.2, 3.0)
WEIGHT_BOUND = 4.0


class OnlineError(ValueError):
    pass


@dataclass(frozen=True)
class OnlineSettings:
    """How the learned rule learns while it serves (module docstring). ``lr``: the calibration's step size; ``shrink``:
    its pull toward the fitted model per update; ``window``: steps the guard compares over; ``margin``: how far the
    rule's realized tokens per unit cost may fall below the best shadow static's before it falls back; ``hold``: steps
    a fallback lasts; ``min_steps``: steps a shadow needs in the window before it may win, and ``coverage`` the share
    of the window's steps; ``guard``: False learns without the guard. ``gate_margin``: nats per label by which the
    calibrated p's running log-loss must beat the fitted p's in a cell before the calibration is used there;
    ``gate_window``: labels the running losses average over (their exponential weights' horizon)."""

    lr: float = 0.05
    shrink: float = 0.02
    window: int = 64
    margin: float = 0.05
    hold: int = 64
    min_steps: int = 16
    coverage: float = 0.8
    guard: bool = True
    gate_margin: float = 0.01
    gate_window: int = 256

    def __post_init__(self) -> None:
        for name, lo, hi in (("lr", 0.0, 1.0), ("shrink", 0.0, 1.0), ("margin", 0.0, 1.0), ("coverage", 0.0, 1.0),
                             ("gate_margin", 0.0, 1.0)):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and lo <= v <= hi):
                raise OnlineError(f"online.{name} must be a number in [{lo}, {hi}], got {v!r}; e.g. "
                                  f"online.{name}={getattr(OnlineSettings, name)}")
        for name in ("window", "hold", "min_steps", "gate_window"):
            v = getattr(self, name)
            if not (isinstance(v, int) and not isinstance(v, bool) and v >= 1):
                raise OnlineError(f"online.{name} must be an integer >= 1, got {v!r}; e.g. "
                                  f"online.{name}={getattr(OnlineSettings, name)}")
        if self.min_steps > self.window:
            raise OnlineError(f"online.min_steps ({self.min_steps}) cannot exceed online.window ({self.window}): a "
                              "shadow could never win; lower min_steps or widen the window")

    @classmethod
    def of(cls, d) -> OnlineSettings | None:
        """Settings from an artifact's or a config's mapping (None, False: no online learning; True: defaults)."""
        if d is None or d is False:
            return None
        if d is True:
            return cls()
        if isinstance(d, OnlineSettings):
            return d
        unknown = sorted(set(d) - set(cls.__dataclass_fields__))
        if unknown:
            raise OnlineError(f"unknown online setting(s) {unknown}; settings are {sorted(cls.__dataclass_fields__)}")
        return cls(**dict(d))

    def to_dict(self) -> dict:
        return asdict(self)


def _phi(p: np.ndarray, X: np.ndarray) -> np.ndarray:
    """[n, 4] calibration inputs: logit p (capped), 1, the drafter's recent acceptance (centred; 0 before its first
    block) and the token's own top-1 confidence (centred; 0 while unknown)."""
    p = np.clip(p, 1e-12, 1 - 1e-12)
    z = np.clip(np.log(p) - np.log1p(-p), -LOGIT_CAP, LOGIT_CAP)
    ema = np.where(X[:, _HAS_EMA] > 0, X[:, _ACCEPT_EMA] - 0.5, 0.0)
    top1 = np.where(X[:, _CONF_KNOWN] > 0, X[:, _TOP1] - 0.5, 0.0)
    out = np.nan_to_num(np.stack([z, np.ones_like(z), ema, top1], axis=1), nan=0.0, posinf=0.0, neginf=0.0)
    np.clip(out[:, 2:], -0.5, 0.5, out=out[:, 2:])  # rates and probabilities, centred: a broken signal stays in range
    return out


_PRIOR = np.array([1.0, 0.0, 0.0, 0.0])  # the identity: sigmoid(logit p) = p


class OnlineCalibration:
    """Per (drafter index, block position) logistic recalibration of the fitted predictor, used only where the gate
    finds it better (module docstring): weights [drafters, positions, 4] starting at the identity; per cell the
    running log-loss of the fitted and of the calibrated p and their total weight. A cell whose gate is closed
    (every cell, until its labels show the calibration better) leaves p exactly as fitted."""

    def __init__(self, settings: OnlineSettings, drafters: int, positions: int):
        self.settings = settings
        self.w = np.tile(_PRIOR, (max(drafters, 1), max(positions, 1), 1))
        cells = self.w.shape[:2]
        self.seen = np.zeros(cells, dtype=np.int64)
        self.loss = np.zeros((*cells, 2))  # running log-loss (exponentially weighted sums): fitted p, calibrated p
        self.mass = np.zeros(cells)  # the running sums' total weight (-> 1 as labels come): loss / mass is the mean
        self.open = np.zeros(cells, dtype=bool)  # the gate: cells where the calibrated p is used
        self.updates = 0
        self.skipped = 0  # labelled rows with non-finite inputs, never learned from

    def _cells(self, X: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        d = np.clip(np.nan_to_num(X[:, _DRAFTER], nan=0.0), 0, self.w.shape[0] - 1).astype(np.int64)
        j = np.clip(np.nan_to_num(X[:, _POSITION], nan=0.0), 0, self.w.shape[1] - 1).astype(np.int64)
        return d, j

    def _calibrated(self, phi: np.ndarray, w: np.ndarray) -> np.ndarray:
        return 0.5 * (1.0 + np.tanh(0.5 * np.einsum("ij,ij->i", phi, w)))

    def adjust(self, X: np.ndarray, p: np.ndarray) -> np.ndarray:
        """``p`` (the fitted predictor's probabilities of rows ``X``) recalibrated in the cells whose gate is open;
        rows of the other cells keep their ``p`` exactly."""
        if not self.open.any():
            return p
        d, j = self._cells(X)
        use = self.open[d, j]
        if not use.any():
            return p
        out = np.where(use, self._calibrated(_phi(p, X), self.w[d, j]), p)
        return np.clip(out, 0.0, 1.0)

    def learn(self, X: np.ndarray, p: np.ndarray, labels: np.ndarray) -> None:
        """One block's labelled rows (``p``: the fitted predictor's probability of each row, ``labels``: 1 accepted, 0
        rejected; rows with non-finite p or label are skipped, counted): for each row, first the gate scores the
        fitted and the calibrated p on its label, then one SGD step on the log-loss with the pull toward the identity.
        A block's rows are different positions, so different cells: all at once; rows sharing a cell (positions past
        the last cell) one after another, in order, as a stream."""
        ok = np.isfinite(p) & np.isfinite(labels)
        if not ok.all():
            self.skipped += int((~ok).sum())
            X, p, labels = X[ok], p[ok], labels[ok]
        if not len(p):
            return
        d, j = self._cells(X)
        if len(set((d * self.w.shape[1] + j).tolist())) == len(d):
            self._step(X, p, labels, d, j)
        else:
            for i in range(len(d)):
                self._step(X[i : i + 1], p[i : i + 1], labels[i : i + 1], d[i : i + 1], j[i : i + 1])
        self.updates += len(d)

    def _step(self, X: np.ndarray, p: np.ndarray, y: np.ndarray, d: np.ndarray, j: np.ndarray) -> None:
        """``learn`` for rows in distinct cells (``d``, ``j``). The gate's prequential score: each cell's running
        log-loss of the fitted (``p``) and calibrated (``q``) probability, before the update; each label weighs
        ``1 / gate_window`` and the cell's older ones decay by ``1 - 1 / gate_window``, so the running sums stay
        within one label's worst loss (probabilities clipped to ``P_SCORE``) times their weight, which stays <= 1."""
        s = self.settings
        phi = _phi(p, X)
        w = self.w[d, j]
        q = self._calibrated(phi, w)
        a = 1.0 / s.gate_window
        pq = np.clip(np.stack([p, q], axis=1), P_SCORE, 1.0 - P_SCORE)
        loss = -(y[:, None] * np.log(pq) + (1.0 - y[:, None]) * np.log1p(-pq))  # [n, 2]: fitted, calibrated
        mass = self.mass[d, j] * (1.0 - a) + a
        run = self.loss[d, j] * (1.0 - a) + a * loss
        self.mass[d, j], self.loss[d, j] = mass, run
        self.open[d, j] = (mass >= GATE_WARM) & (run[:, 0] - run[:, 1] > s.gate_margin * mass)
        w = w - s.lr * ((q - y)[:, None] * phi + s.shrink * (w - _PRIOR))
        np.clip(w[:, 0], *SLOPE_BOUNDS, out=w[:, 0])
        np.clip(w[:, 1:], -WEIGHT_BOUND, WEIGHT_BOUND, out=w[:, 1:])
        self.w[d, j] = w
        self.seen[d, j] += 1


def chain_labels(drafted: int, accepted: int) -> list[int]:
    """Each position's label of a chain of ``drafted`` tokens whose first ``accepted`` were accepted: 1 for those, 0
    for the rejected one after them (when the block ended on a rejection); positions after it were never at risk."""
    if not 0 <= accepted <= drafted:
        raise OnlineError(f"a block's labels need 0 <= accepted <= drafted, got accepted={accepted}, drafted={drafted}")
    return [1] * accepted + ([0] if accepted < drafted else [])


class ShadowGuard:
    """The rule against the static blocks its own steps price (module docstring). Arms: autoregressive (``(None,
    0)``) and (drafter, k') for each drafter and 1 <= k' <= k_max. Per step a ring of ``window`` entries holds the
    rule's realized (tokens, seconds) and each arm's shadow (tokens, seconds), NaN where the arm is not defined;
    running sums keep the comparison O(arms) per step."""

    def __init__(self, settings: OnlineSettings, cost: CostModel, drafters: tuple[str, ...], k_max: int):
        self.settings, self.cost = settings, cost
        self.arms: list[tuple[str | None, int]] = [(None, 0)] + [(d, k) for d in drafters for k in range(1, k_max + 1)]
        self._index = {a: i for i, a in enumerate(self.arms)}
        W, A = settings.window, len(self.arms)
        self._ring = np.full((W, A, 4), np.nan)  # per step, per arm: realized tokens, seconds; shadow tokens, seconds
        self._sums = np.zeros((A, 4))
        self._count = np.zeros(A, dtype=np.int64)
        self._at = 0
        self.steps = 0  # steps observed since the window last started
        self.held: tuple[str | None, int] | None = None  # the static block decisions fall back to, while held
        self.hold_left = 0
        self.fallbacks = 0  # times the guard fell back

    def observe(self, drafter: str | None, drafted: int, accepted: int, emitted: int, context_len: int,
                batch: int = 1) -> None:
        """One chain step of the rule (or of its fallback): ``drafted`` tokens by ``drafter`` (0: autoregressive),
        ``accepted`` of them, ``emitted`` tokens committed (fewer than accepted + 1 at the length limit)."""
        if not 0 <= accepted <= drafted or emitted < 0:
            return
        if drafted and drafter is None:
            return
        entry = np.full((len(self.arms), 4), np.nan)
        # a shadow block emits its accepted tokens and the target's own, cut where this step's were (EOS, the limit)
        real = (float(emitted), self.cost.step_time(drafter if drafted else None, drafted, context_len, batch))
        entry[0] = (*real, float(min(1, emitted)), self.cost.step_time(None, 0, context_len, batch))
        if drafter is not None:
            for k in range(1, drafted + 1):
                i = self._index.get((drafter, k))
                if i is not None:
                    entry[i] = (*real, float(min(min(accepted, k) + 1, emitted)),
                                self.cost.step_time(drafter, k, context_len, batch))
        old = self._ring[self._at]
        had = ~np.isnan(old[:, 0])
        self._sums[had] -= old[had]
        self._count[had] -= 1
        has = ~np.isnan(entry[:, 0])
        self._sums[has] += entry[has]
        self._count[has] += 1
        self._ring[self._at] = entry
        self._at = (self._at + 1) % self.settings.window
        self.steps += 1
        if self.hold_left > 0:
            self.hold_left -= 1
            if self.hold_left == 0:
                self.held = None
                self._clear()
        elif self.settings.guard:
            self._judge()

    def _judge(self) -> None:
        s = self.settings
        if self.steps < s.min_steps:
            return
        ok = (self._count >= s.min_steps) & (self._count >= s.coverage * min(self.steps, s.window))
        if not ok.any():
            return
        sums = self._sums
        with np.errstate(divide="ignore", invalid="ignore"):
            real = sums[:, 0] / sums[:, 1]
            shadow = sums[:, 2] / sums[:, 3]
            ratio = np.where(ok & np.isfinite(real) & np.isfinite(shadow) & (real > 0), shadow / real, 0.0)
        best = int(np.argmax(ratio))
        if ratio[best] > 1.0 + s.margin:
            self.held, self.hold_left = self.arms[best], s.hold
            self.fallbacks += 1
            self._clear()

    def _clear(self) -> None:
        self._ring[:] = np.nan
        self._sums[:] = 0.0
        self._count[:] = 0
        self.steps = 0

    def state(self) -> dict:
        """What the guard holds now, for logs and reports."""
        return {"held": None if self.held is None else {"drafter": self.held[0], "k": self.held[1]},
                "hold_left": self.hold_left, "fallbacks": self.fallbacks, "steps": self.steps}
