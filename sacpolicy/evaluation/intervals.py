"""Every ratio with its uncertainty: paired bootstrap intervals over prompts (against AR and the best static:
``add_intervals``; the learned policy against each peer: ``paired_ratios``), and the rows whose speedup the cost
model invented; for runs under load (``scripts/bench_serve.py``), a two-level paired bootstrap over repeated server
runs and their requests (``nested_ratio_interval``).

A row's throughput is summed tokens over summed seconds. Its ratio against a baseline row of the same mode (``ar``,
``best-static``) is resampled over prompts: draw prompts with replacement, and take the ratio of both rows' summed
tokens over summed seconds on the same draw, so prompt difficulty cancels between the two policies (paired). Rows are
paired prompt by prompt in the order their results were given; every row of a mode covers the same prompts in the
same order (``evaluate`` decodes and replays them so).
"""

from __future__ import annotations

import numpy as np

MIN_PROMPTS = 3  # fewer prompts than this in a category: no interval ("not enough prompts")
BASELINES = {"ar": "speedup_vs_ar", "best-static": "speedup_vs_best_static"}  # baseline row -> the ratio's key


def bootstrap_indices(n: int, *, resamples: int = 2000, seed: int = 0) -> np.ndarray:
    """[resamples, n] prompt indices drawn with replacement (seeded: the same draw for every pair of rows)."""
    return np.random.default_rng(seed).integers(0, n, size=(resamples, n))


def paired_ratio_interval(tokens_a, seconds_a, tokens_b, seconds_b, *, idx: np.ndarray,
                          level: float = 0.95) -> tuple[float, float]:
    """Percentile interval of (tokens/s of a) / (tokens/s of b) over resamples ``idx`` [R, n] of n paired prompts.

    tokens_*, seconds_*: [n] per prompt, prompt i of a paired with prompt i of b.
    """
    ta, sa, tb, sb = (np.asarray(v, dtype=float) for v in (tokens_a, seconds_a, tokens_b, seconds_b))
    if not ta.shape == sa.shape == tb.shape == sb.shape or ta.ndim != 1:
        raise ValueError(f"paired rows need one value per prompt each, got shapes {ta.shape}, {sa.shape}, "
                         f"{tb.shape}, {sb.shape}")
    ratio = (ta[idx].sum(1) / sa[idx].sum(1)) / (tb[idx].sum(1) / sb[idx].sum(1))
    lo, hi = np.percentile(ratio, [50 * (1 - level), 50 * (1 + level)])
    return float(lo), float(hi)


def nested_ratio_interval(mine, others: dict, stat, *, resamples: int = 2000, seed: int = 0,
                          level: float = 0.95) -> tuple[float, float]:
    """Percentile interval of ``stat`` of ``mine`` over the lowest ``stat`` of ``others`` (lower is better: a
    latency), under a two-level paired bootstrap: repeats drawn with replacement, then requests within each drawn
    repeat. The same draw serves every configuration, because repeat r of each ran the same requests at the same
    arrival times (a seeded load client). A configuration's figure is the mean over its drawn repeats of ``stat`` over
    the drawn requests, as a table averages per-repeat figures; a resample's best other is chosen afresh.

    mine, others[name]: [repeats, requests] per-request values (NaN: a failed request, left out of ``stat``).
    stat: maps [..., requests] to [...], NaN-aware (e.g. ``np.nanmean(v, axis=-1)``).
    """
    a = np.asarray(mine, dtype=float)
    rest = {n: np.asarray(v, dtype=float) for n, v in others.items()}
    if a.ndim != 2 or not rest or any(v.shape != a.shape for v in rest.values()):
        raise ValueError(f"every configuration needs the same [repeats, requests] values, got {a.shape} and "
                         f"{ {n: v.shape for n, v in rest.items()} }; pair runs of the same requests and repeats")
    rng = np.random.default_rng(seed)
    reps = rng.integers(0, a.shape[0], size=(resamples, a.shape[0]))[..., None]  # [R, repeats, 1]
    reqs = rng.integers(0, a.shape[1], size=(resamples, *a.shape))  # [R, repeats, requests]
    fig = lambda v: stat(v[reps, reqs]).mean(axis=1)  # [R]
    ratio = fig(a) / np.min([fig(v) for v in rest.values()], axis=0)
    lo, hi = np.nanpercentile(ratio, [50 * (1 - level), 50 * (1 + level)])
    return float(lo), float(hi)


def add_intervals(rows: list[dict], *, resamples: int = 2000, seed: int = 0, level: float = 0.95) -> None:
    """Set each row's ratio against ``ar`` and ``best-static`` of its mode with a paired bootstrap interval, overall
    (``speedup_vs_ar_ci``, ``speedup_vs_best_static`` and ``_ci``) and per category with at least ``MIN_PROMPTS``
    prompts (else the interval is None; ``n_prompts`` says why). Rows without per-prompt data or baseline are left
    as they are. Call after ``add_speedups``."""
    for mode in {r["mode"] for r in rows}:
        base = {r["name"]: r for r in rows if r["mode"] == mode and r["name"] in BASELINES}
        for row in (r for r in rows if r["mode"] == mode and "per_prompt" in r):
            cats = np.array(row["per_prompt"]["category"])
            for c, cell in row["per_category"].items():
                cell["n_prompts"] = int((cats == c).sum())
            for name, key in BASELINES.items():
                ref = base.get(name)
                if ref is None or "per_prompt" not in ref:
                    continue
                row[key], row[f"{key}_ci"] = _paired(row, ref, resamples=resamples, seed=seed, level=level)
                a, b = row["per_prompt"], ref["per_prompt"]
                for c, cell in row["per_category"].items():
                    ref_cell = ref["per_category"].get(c, {})
                    cell[key] = (cell["tokens_per_s"] / ref_cell["tokens_per_s"]
                                 if ref_cell.get("tokens_per_s") else None)
                    cell[f"{key}_ci"] = None
                    if cell[key] is not None and cell["n_prompts"] >= MIN_PROMPTS:
                        m = cats == c
                        cell[f"{key}_ci"] = list(paired_ratio_interval(
                            *(np.asarray(v)[m] for v in (a["tokens"], a["seconds"], b["tokens"], b["seconds"])),
                            idx=bootstrap_indices(int(m.sum()), resamples=resamples, seed=seed), level=level))


def paired_ratios(rows: list[dict], names: list[str], refs: list[str], *, resamples: int = 2000, seed: int = 0,
                  level: float = 0.95) -> list[dict]:
    """Each row of ``names`` against each row of ``refs`` of the same mode (the learned policy against the peers):
    ``{"row", "ref", "mode", "ratio", "ci", "n_prompts"}``, the ratio of tokens/s with its paired bootstrap interval
    over prompts (as ``add_intervals``'). Pairs where either row is missing or has no per-prompt data are left out."""
    by = {(r["name"], r["mode"]): r for r in rows if "per_prompt" in r}
    out = []
    for mode in dict.fromkeys(r["mode"] for r in rows):
        for name in names:
            for ref in refs:
                if (name, mode) in by and (ref, mode) in by:
                    ratio, ci = _paired(by[name, mode], by[ref, mode], resamples=resamples, seed=seed, level=level)
                    out.append({"row": name, "ref": ref, "mode": mode, "ratio": ratio, "ci": ci,
                                "n_prompts": len(by[name, mode]["per_prompt"]["tokens"])})
    return out


def _paired(row: dict, ref: dict, *, resamples: int, seed: int, level: float) -> tuple[float, list[float]]:
    """(tokens/s of ``row`` over ``ref``'s, its paired bootstrap interval over the rows' prompts)."""
    _check_paired(row, ref)
    a, b = row["per_prompt"], ref["per_prompt"]
    ci = paired_ratio_interval(a["tokens"], a["seconds"], b["tokens"], b["seconds"], level=level,
                               idx=bootstrap_indices(len(a["tokens"]), resamples=resamples, seed=seed))
    return row["tokens_per_s"] / ref["tokens_per_s"], list(ci)


def _check_paired(row: dict, ref: dict) -> None:
    if row["per_prompt"]["category"] != ref["per_prompt"]["category"]:
        raise ValueError(f"rows {row['name']!r} and {ref['name']!r} ({row['mode']}) do not cover the same prompts in "
                         "the same order, so they cannot be paired; build every row of a mode from the same prompts")
