"""Fitting a ``CostModel`` to a profile's timings (``sacpolicy.profiling`` measures them): knots fitted to the cells'
medians, each knot's 95% interval by bootstrapping the repeats, and the verify cost made non-decreasing in tokens fed
(see ``sacpolicy.profiling``'s docstring)."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace

import numpy as np

from sacpolicy.runtime.cost import CostModel
from sacpolicy.runtime.curve import PiecewiseLinear, _hinge_basis

__all__ = ["MIN_REPEATS", "N_BOOT", "fit_cost_model", "fit_step_overhead", "monotone_knots", "pool_adjacent_violators"]

logger = logging.getLogger("sacpolicy.profiling")

MIN_REPEATS = 5  # fewer timings per cell give no usable interval: every decrease in the verify cost counts as noise
N_BOOT = 200  # bootstrap resamples behind each knot's interval


def pool_adjacent_violators(y, w=None) -> np.ndarray:
    """The non-decreasing sequence closest to ``y`` in (``w``-weighted) least squares: isotonic regression by pooling
    adjacent violators into their weighted mean."""
    y = np.asarray(y, dtype=float)
    w = np.ones_like(y) if w is None else np.asarray(w, dtype=float)
    blocks: list[list[float]] = []  # [mean, weight, count]
    for yi, wi in zip(y, w):
        blocks.append([yi, wi, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m2, w2, n2), (m1, w1, n1) = blocks.pop(), blocks.pop()
            blocks.append([(m1 * w1 + m2 * w2) / (w1 + w2), w1 + w2, n1 + n2])
    return np.concatenate([np.full(n, m) for m, _, n in blocks]) if blocks else y


def monotone_knots(ys, lo, hi, trust_intervals: bool = True) -> tuple[np.ndarray, list[int]]:
    """``ys`` made non-decreasing, except where knot i + 1 lies below knot i beyond noise (its interval ends below
    the start of knot i's) and ``trust_intervals``: there the curve may fall. -> (ys, [i: kept decreases i -> i+1]).
    Pooling is done within the runs between kept decreases, which only widens each kept decrease."""
    ys, lo, hi = (np.asarray(v, dtype=float) for v in (ys, lo, hi))
    kept = [i for i in range(len(ys) - 1) if trust_intervals and ys[i + 1] < ys[i] and hi[i + 1] < lo[i]]
    bounds = [0] + [i + 1 for i in kept] + [len(ys)]
    return np.concatenate([pool_adjacent_violators(ys[a:b]) for a, b in itertools.pairwise(bounds)]), kept


def _bootstrap(cells: Sequence[np.ndarray], fit: Callable[[np.ndarray], np.ndarray], n_boot: int,
               rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """cells: per measured cell, its [repeats] seconds; fit: cell medians [cells, B] -> fitted values [m, B].
    -> (fit of the medians, 2.5th and 97.5th percentile over ``n_boot`` fits of resampled medians), each [m]."""
    medians = np.array([[np.median(c)] for c in cells])
    boot = np.stack([np.median(c[rng.integers(len(c), size=(n_boot, len(c)))], axis=1) for c in map(np.asarray, cells)])
    lo, hi = np.percentile(fit(boot), [2.5, 97.5], axis=1)
    return fit(medians)[:, 0], lo, hi


def _knot_fit(x, knots: Sequence[float], extra: np.ndarray | None = None) -> Callable[[np.ndarray], np.ndarray]:
    """Least squares of a piecewise-linear curve at ``knots`` (plus one coefficient per ``extra`` column, appended
    after the knot values): targets [cells, B] -> [len(knots) (+ extras), B]."""
    basis, at_knots = _hinge_basis(x, knots), _hinge_basis(knots, knots)
    X = basis if extra is None else np.column_stack([basis, extra])

    def fit(T: np.ndarray) -> np.ndarray:
        coef = np.linalg.lstsq(X, T, rcond=None)[0]
        return np.vstack([at_knots @ coef[: basis.shape[1]], coef[basis.shape[1]:]])

    return fit


def _fit_verify(cells: list[tuple[int, int, np.ndarray]], repeats: int, n_boot: int, rng,
                per_token_slope: bool = False) -> dict:
    """cells (tokens fed, context, seconds) -> t = a(tokens) + b * context, non-decreasing in tokens within noise.
    ``per_token_slope`` (batches, whose every query reads a cache as wide as the longest row): b(tokens) too, one line
    over the profiled contexts per knot; the monotone check runs on the curve at the middle profiled context."""
    n, c = (np.array(v, dtype=float) for v in list(zip(*cells))[:2])
    knots = sorted(set(n.tolist()))
    contexts = sorted(set(c.tolist()))
    # one context length cannot separate b from a: fold it into a
    split = len(contexts) > 1
    if split and per_token_slope:
        ref = contexts[len(contexts) // 2]
        basis, at_knots, K = _hinge_basis(n, knots), _hinge_basis(knots, knots), len(knots)
        X = np.column_stack([basis, basis * c[:, None]])

        def fit(T: np.ndarray) -> np.ndarray:  # -> [the curve at context ref; the slope curve] at the knots
            coef = np.linalg.lstsq(X, T, rcond=None)[0]
            a, b = at_knots @ coef[:K], at_knots @ coef[K:]
            return np.vstack([a + b * ref, b])

        ys, lo, hi = _bootstrap([t for *_, t in cells], fit, n_boot, rng)
        slope = ys[K:]
        ys, lo, hi = ys[:K], lo[:K], hi[:K]
    else:
        fit = _knot_fit(n, knots, c[:, None] if split else None)
        ys, lo, hi = _bootstrap([t for *_, t in cells], fit, n_boot, rng)
        slope = float(ys[-1]) if split else 0.0
        ys, lo, hi = ys[: len(knots)], lo[: len(knots)], hi[: len(knots)]
    mono, kept = monotone_knots(ys, lo, hi, trust_intervals=repeats >= MIN_REPEATS)
    for i in range(len(knots) - 1):
        x0, x1 = int(knots[i]), int(knots[i + 1])
        if i in kept:
            logger.warning("verify cost falls from %d to %d tokens fed beyond noise (%.3g s, 95%% [%.3g, %.3g] -> "
                           "%.3g s, [%.3g, %.3g]); kept", x0, x1, ys[i], lo[i], hi[i], ys[i + 1], lo[i + 1], hi[i + 1])
        elif ys[i + 1] < ys[i]:
            why = "within noise" if repeats >= MIN_REPEATS else f"with repeats={repeats} < {MIN_REPEATS} to tell"
            logger.info("verify cost measured lower at %d than at %d tokens fed (%.3g < %.3g s) %s; pooled", x1, x0,
                        ys[i + 1], ys[i], why)
    if isinstance(slope, float):
        return {"tokens": PiecewiseLinear(knots, mono.tolist(), lo.tolist(), hi.tolist()), "per_context": slope}
    at_zero = slope * ref  # the curve at context 0 (its intervals: those at ref, the slope held)
    return {"tokens": PiecewiseLinear(knots, (mono - at_zero).tolist(), (lo - at_zero).tolist(),
                                      (hi - at_zero).tolist()),
            "per_context": PiecewiseLinear(knots, slope.tolist())}


def _fit_draft(name: str, cells: list[tuple[int, np.ndarray]], per_token: bool, n_boot: int, rng) -> PiecewiseLinear:
    if not cells:
        raise ValueError(f"drafter {name!r} could not be timed at any of the context lengths; "
                         "pass context_lens that fit its max_position_embeddings")
    x = np.array([c for c, _ in cells], dtype=float)
    if per_token:  # one forward per token: a line in context length (attention reads the whole cache)
        knots = sorted({x.min(), x.max()})
        fit = _knot_fit(x, knots)
    else:  # model-free lookup: one constant per proposal, the median over contexts
        knots, fit = [0.0], lambda T: np.median(T, axis=0, keepdims=True)
    ys, lo, hi = _bootstrap([t for _, t in cells], fit, n_boot, rng)
    return PiecewiseLinear(knots, ys.tolist(), lo.tolist(), hi.tolist())


def fit_cost_model(device: str, verify_cells: list[tuple[int, int, np.ndarray]],
                   draft_cells: Mapping[str, list[tuple[int, np.ndarray]]], per_token: Mapping[str, bool],
                   meta: Mapping | None = None, *, batch_cells: Mapping[int, list] | None = None,
                   fixed_cells: Mapping[str, list] | None = None, prefill_cells: list | None = None,
                   share_cells: Mapping[str, Mapping[int, np.ndarray]] | None = None,
                   n_boot: int = N_BOOT, seed: int = 0) -> CostModel:
    """A CostModel from timings: ``verify_cells`` (tokens fed, context, [repeats] seconds of one target forward),
    ``draft_cells`` {drafter: [(context, [repeats] seconds of one draft step or proposal)]}, ``batch_cells`` {batch
    size > 1: verify cells of a pass over that many rows}, ``fixed_cells`` {per-token drafter: [(context, [repeats]
    seconds it spends once per proposal)]}, ``prefill_cells`` [(prompt tokens, [repeats] seconds of its prefill)],
    ``share_cells`` {drafter: {rows > 1: [repeats] per-row share of that many rows drafting together}} (the median
    share per size, its 95% bootstrap interval as the knot's; share 1 at one row)."""
    rng = np.random.default_rng(seed)
    repeats = min(len(t) for *_, t in verify_cells)
    draft = {name: _fit_draft(name, cells, per_token[name], n_boot, rng) for name, cells in draft_cells.items()}
    batch = {b: _fit_verify(cells, min(len(t) for *_, t in cells), n_boot, rng, per_token_slope=True)
             for b, cells in sorted((batch_cells or {}).items())}
    meta = {**(meta or {}), "knot_interval": f"95% bootstrap over repeats ({n_boot} resamples)"}
    fixed = {name: _fit_draft(name, cells, True, n_boot, rng) for name, cells in (fixed_cells or {}).items()}
    prefill = _fit_draft("prefill", prefill_cells, True, n_boot, rng) if prefill_cells else None
    shares = {name: _fit_shares(cells, n_boot, rng) for name, cells in (share_cells or {}).items() if cells}
    return CostModel(device, _fit_verify(verify_cells, repeats, n_boot, rng), draft, dict(per_token), meta,
                     batch=batch, draft_fixed=fixed, prefill=prefill, draft_batch=shares)


def _fit_shares(cells: Mapping[int, np.ndarray], n_boot: int, rng) -> PiecewiseLinear:
    """g(r) with knots at 1 (share 1) and each profiled r (the median of its repeats, bootstrap interval)."""
    sizes = sorted(cells)
    ys, lo, hi = _bootstrap([np.asarray(cells[r], dtype=float) for r in sizes], lambda T: T, n_boot, rng)
    return PiecewiseLinear([1, *sizes], [1.0, *ys.tolist()], [1.0, *lo.tolist()], [1.0, *hi.tolist()])


# an autoregressive step's own work below minus this share of its pass: the passes were timed on a busier machine
# than the decoder then ran on (a profile taken beside another heavy job), and every price in the model is off
CONTENDED_SHARE = 0.2


def fit_step_overhead(cost: CostModel, base: Sequence[float], drafted: Mapping[str, Sequence[tuple[int, float]]],
                      sampling: Mapping, context_len: float = 0.0) -> CostModel:
    """``cost`` with the decoder's own work per step (``CostModel.step_base``, ``step_draft``) from the real
    decoder's steps timed against it: ``base`` [seconds beyond the passes of each autoregressive step], ``drafted``
    {drafter: [(tokens drafted, seconds beyond the passes)]}. Medians, robust to a step the machine interrupted:
    ``step_base`` the autoregressive steps' median; a drafter's curve the median per number of tokens drafted, less
    ``step_base``, as a line over them (a constant when one number was drafted); a drafter that never drafted gets
    none. ``sampling``: the settings they were timed at, recorded in ``meta["overhead_sampling"]``. Warns of a profile
    whose autoregressive steps ran well below their pass as timed alone (at ``context_len``): the machine was busier
    while the passes were timed, and a model so priced misleads every decision."""
    if not len(base):
        raise ValueError("fit_step_overhead needs the seconds of at least one autoregressive step")
    step_base = float(np.median(base))
    one = cost.verify_time(0, context_len)
    contended = step_base < -CONTENDED_SHARE * one
    if contended:  # a warning, not an error: a tiny model's passes (a few ms) cross it on a busy CI machine
        logger.warning("the decoder's autoregressive steps took %.1f ms, but their pass alone was timed at %.1f ms: "
                       "the machine was busier while the passes were timed (another heavy job running?), so every "
                       "cost in this profile is off. Fix: profile again with nothing else running",
                       1e3 * (one + step_base), 1e3 * one)
    step_draft = {}
    for name, pairs in drafted.items():
        by_k: dict[int, list[float]] = {}
        for k, seconds in pairs:
            by_k.setdefault(int(k), []).append(float(seconds))
        if not by_k:
            continue
        ks = sorted(by_k)
        ys = [float(np.median(by_k[k])) - step_base for k in ks]
        step_draft[name] = (PiecewiseLinear([ks[0]], [ys[0]]) if len(ks) == 1
                            else PiecewiseLinear.fit(ks, ys, [ks[0], ks[-1]]))
    meta = {**cost.meta, "overhead_sampling": dict(sampling), "overhead_contended": contended,
            "overhead_steps": {"autoregressive": len(base), **{n: len(p) for n, p in drafted.items()}}}
    return replace(cost, step_base=step_base, step_draft=step_draft, meta=meta)
