"""PNG plots of evaluation rows and of predictor calibration.

Figures are drawn on the Agg canvas directly (no pyplot): nothing needs a display, no global backend is switched
under the caller, and no figure outlives its function.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from sacpolicy.training.metrics import calibration_error, reliability_bins

KEY_PREFIXES = ("learned", "best-static", "oracle", "heuristic")  # rows whose histograms are worth comparing
_STATIC_K = re.compile(r"static-k(\d+)")


def make_plots(eval: dict, out_dir) -> list[Path]:
    """Write the comparison plots of ``eval["rows"]`` (after add_speedups) into ``out_dir``; skip those without data.

    speedup_by_policy, speedup_by_category (live rows, else simulated), acceptance_hist and k_distribution (key
    rows, see KEY_PREFIXES), cost_per_1k and speedup_vs_k (static-k<N> rows).
    """
    rows, out_dir = eval["rows"], Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    key = [r for r in rows if r["name"].startswith(KEY_PREFIXES)]
    made = [
        _speedup_by_policy(rows, out_dir / "speedup_by_policy.png"),
        _speedup_by_category(rows, out_dir / "speedup_by_category.png"),
        _hist_plot(key, "accept_hist", out_dir / "acceptance_hist.png", "tokens accepted per drafting step"),
        _hist_plot(key, "k_hist", out_dir / "k_distribution.png", "decided k (0 = autoregressive step)"),
        _bars(out_dir / "cost_per_1k.png", [_label(r) for r in rows],
              {"cost": [r["cost_per_1k_tokens"] for r in rows]}, "$ per 1k tokens (device time)"),
        speedup_vs_k_plot(rows, out_dir / "speedup_vs_k.png"),
    ]
    return [p for p in made if p is not None]


def calibration_plot(probs, labels, out_path, n_bins: int = 10, title: str = "Reliability diagram",
                     observed: str = "observed frequency") -> Path:
    """Mean label per probability bin (the observed frequency of 0/1 labels; the mean beta of soft ones, named by
    ``observed``) against the diagonal of perfect calibration; ECE in the title."""
    _, freq, count = reliability_bins(probs, labels, n_bins)
    fig, ax = _figure()
    edges = np.linspace(0.0, 1.0, n_bins + 1)
    ax.bar(edges[:-1], np.nan_to_num(freq), 1.0 / n_bins, align="edge", edgecolor="black", label="observed")
    ax.plot([0, 1], [0, 1], "--", color="gray", label="perfectly calibrated")
    ax.set(xlim=(0, 1), ylim=(0, 1), xlabel="predicted probability", ylabel=observed,
           title=f"{title} (ECE {calibration_error(probs, labels, n_bins):.3f}, n={int(count.sum())})")
    ax.legend(loc="upper left")
    return _save(fig, out_path)


def speedup_vs_k_plot(rows: list[dict], out_path) -> Path | None:
    """Speedup vs AR of the static-k<N> rows against N, one line per mode; None (nothing written) without them."""
    lines: dict[str, list[tuple[int, float]]] = {}
    for r in rows:
        m = _STATIC_K.fullmatch(r["name"])
        if m and r.get("speedup_vs_ar") is not None:
            lines.setdefault(r["mode"], []).append((int(m.group(1)), r["speedup_vs_ar"]))
    if not lines:
        return None
    fig, ax = _figure()
    for mode, points in sorted(lines.items()):
        ax.plot(*zip(*sorted(points)), marker="o", label=mode)
    ax.axhline(1.0, color="gray", ls="--", lw=1)
    ax.set(xlabel="k (tokens drafted per step)", ylabel="speedup vs AR", title="Static speculation length")
    ax.legend()
    return _save(fig, out_path)


def _speedup_by_policy(rows: list[dict], path: Path) -> Path | None:
    rows = [r for r in rows if r.get("speedup_vs_ar") is not None]
    names = list(dict.fromkeys(r["name"] for r in rows))
    by = {(r["name"], r["mode"]): r["speedup_vs_ar"] for r in rows}
    modes = sorted({r["mode"] for r in rows})
    return _bars(path, names, {m: [by.get((n, m)) for n in names] for m in modes}, "speedup vs AR", hline=1.0)


def _speedup_by_category(rows: list[dict], path: Path) -> Path | None:
    rows = [r for r in rows if r["mode"] == "live"] or [r for r in rows if r["mode"] == "simulated"]
    speedup = {r["name"]: {c: v.get("speedup_vs_ar") for c, v in r["per_category"].items()} for r in rows}
    categories = sorted({c for s in speedup.values() for c, v in s.items() if v is not None})
    series = {name: [s.get(c) for c in categories] for name, s in speedup.items()}
    mode = rows[0]["mode"] if rows else ""
    return _bars(path, categories, series, f"speedup vs AR ({mode})", hline=1.0)


def _hist_plot(rows: list[dict], key: str, path: Path, xlabel: str) -> Path | None:
    """Each row's histogram as fractions of its steps, so rows with different step counts compare."""
    rows = [r for r in rows if r[key]]
    bins = sorted({int(b) for r in rows for b in r[key]})
    series = {_label(r): [r[key].get(str(b), 0) / sum(r[key].values()) for b in bins] for r in rows}
    return _bars(path, [str(b) for b in bins], series, "fraction of steps", xlabel=xlabel)


def _bars(path: Path, groups: list[str], series: dict[str, list], ylabel: str, *, xlabel: str = "",
          hline: float | None = None) -> Path | None:
    """Grouped bars: one group per x label, one bar per series (None = no bar); None when there is nothing to draw."""
    if not groups or not series:
        return None
    fig, ax = _figure(width=max(6.0, 0.25 * len(groups) * len(series) + 2))
    x, width = np.arange(len(groups)), 0.8 / len(series)
    for i, (label, values) in enumerate(series.items()):
        ax.bar(x + (i - (len(series) - 1) / 2) * width, [np.nan if v is None else v for v in values], width,
               label=label)
    tilt = max(map(len, groups)) > 4
    ax.set_xticks(x, groups, rotation=30 if tilt else 0, ha="right" if tilt else "center")
    if hline is not None:
        ax.axhline(hline, color="gray", ls="--", lw=1)
    ax.set(xlabel=xlabel, ylabel=ylabel, title=path.stem.replace("_", " "))
    if len(series) > 1:
        ax.legend(fontsize="small")
    return _save(fig, path)


def line_plot(path, panels: list[dict]) -> Path:
    """Side-by-side line panels, one marker per point. Each panel: ``series`` ({label: [(x, y), ...]}, points drawn
    in x order), ``xlabel``, ``ylabel``, ``title``; ``log2_x``: a base-2 log x axis. Used by the load benchmarks."""
    fig = Figure(figsize=(5.0 * len(panels), 4.0))
    FigureCanvasAgg(fig)
    for i, panel in enumerate(panels):
        ax = fig.add_subplot(1, len(panels), i + 1)
        for label, pts in panel["series"].items():
            if pts:
                ax.plot(*zip(*sorted(pts)), marker="o", label=label)
        if panel.get("log2_x"):
            ax.set_xscale("log", base=2)
        ax.set(xlabel=panel.get("xlabel", ""), ylabel=panel.get("ylabel", ""), title=panel.get("title", ""))
    fig.axes[0].legend(fontsize="small")
    return _save(fig, path)


def _label(row: dict) -> str:
    return f"{row['name']} ({row['mode']})"


def _figure(width: float = 6.0):
    fig = Figure(figsize=(width, 4.0))
    FigureCanvasAgg(fig)
    return fig, fig.add_subplot()


def _save(fig: Figure, path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path
