"""Capacity at a latency target: the highest Poisson arrival rate at which a server keeps its P90 TPOT and P99 TTFT
within a target, found by a bounded search over rates, and what that rate buys (requests/s and output tokens/s with
intervals over repeats, cost per 1M output tokens at a price per hour). ``scripts/bench_serve.py --find-capacity``
runs it per configuration against vLLM servers; the search takes any ``measure(rate, repeat) -> row`` (a
``bench.serve.summarize`` row: ``p90_tpot_ms``, ``p99_ttft_ms``, ``request_throughput``, ``output_throughput``,
``failed``), so its logic is tested on deterministic latency curves with no server.

A fixed-rate benchmark cannot say how much traffic one machine carries: below saturation its throughput is the
arrival rate, whatever the configuration. The rate at which the latency target breaks can: a configuration that
decodes faster per request keeps its TPOT under the target at a higher arrival rate.

The search (``find_capacity``): a rate *passes* when, over its repeats, the mean P90 TPOT and the mean P99 TTFT are
within the target and no request failed (a dropped request meets no latency target).
  1. bracket: from ``start``, double while the rate passes, halve while it fails (down to ``min_rate``), until a
     passing rate lies below a failing one;
  2. bisect: probe the geometric midpoint of the highest passing and the lowest failing rate until they are within
     ``tol`` of each other (hi / lo <= 1 + tol).
At most ``max_probes`` rates are probed, each ``repeats`` times. Its outcome (``Capacity.status``):
  - ``converged``: the capacity is the highest passing rate, the lowest failing one within ``tol`` above it;
  - ``unmeetable``: the target failed at ``min_rate``: no rate this search may probe meets it;
  - ``bound``: ``max_probes`` ran out first; the capacity is the highest passing rate seen (a lower bound; None when
    none passed) and ``bracket`` says how far the search got;
  - ``error``: a measurement raised ``MeasureError`` (an unreachable or dead server): its message is kept with every
    probe measured before it, the unfinished probe's completed repeats included.
Every outcome keeps every probe; ``on_probe`` is called after each repeat, so a caller writes them as they come.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from sacpolicy.bench import cell, table

TARGET_KEYS = {"tpot": "p90_tpot_ms", "ttft": "p99_ttft_ms"}  # the percentile each target bounds
STATUSES = ("converged", "unmeetable", "bound", "error")


class MeasureError(RuntimeError):
    """A measurement that could not be made (the server is unreachable or died): the search stops and keeps what it
    has."""


@dataclass(frozen=True)
class Target:
    """The latency target a rate must keep: P90 TPOT and P99 TTFT bounds in ms (None: not bounded)."""

    tpot_p90_ms: float | None = None
    ttft_p99_ms: float | None = None

    def __post_init__(self) -> None:
        if self.tpot_p90_ms is None and self.ttft_p99_ms is None:
            raise ValueError("a latency target needs a P90 TPOT bound, a P99 TTFT bound or both (ms); got neither. "
                             "Fix: pass --tpot-target-ms, --tpot-target-x or --ttft-target-ms")
        for name, v in (("P90 TPOT", self.tpot_p90_ms), ("P99 TTFT", self.ttft_p99_ms)):
            if v is not None and not (v > 0 and math.isfinite(v)):
                raise ValueError(f"the {name} target must be a positive number of ms, got {v}")

    def misses(self, tpot_p90_ms: float | None, ttft_p99_ms: float | None, failed: int) -> list[str]:
        """Why figures of a rate miss this target (empty: they meet it). A bounded figure that is missing (no request
        completed with it) misses."""
        why = [f"{failed} failed requests"] if failed else []
        for name, bound, v in (("P90 TPOT", self.tpot_p90_ms, tpot_p90_ms), ("P99 TTFT", self.ttft_p99_ms,
                                                                              ttft_p99_ms)):
            if bound is not None and (v is None or v > bound):
                why.append(f"{name} {cell(v, '.1f')} ms > {bound:.1f} ms")
        return why

    def describe(self) -> str:
        parts = [f"{name} <= {v:.1f} ms" for name, v in (("P90 TPOT", self.tpot_p90_ms),
                                                         ("P99 TTFT", self.ttft_p99_ms)) if v is not None]
        return " and ".join(parts)


@dataclass(frozen=True)
class Search:
    """The bounds of one rate search: the first rate (requests/s), repeats per rate, the most rates probed, the
    relative width at which it stops, and the lowest rate it halves down to (default ``start / 64``)."""

    start: float
    repeats: int = 1
    max_probes: int = 8
    tol: float = 0.1
    min_rate: float | None = None

    def __post_init__(self) -> None:
        if not (self.start > 0 and math.isfinite(self.start)):
            raise ValueError(f"the search's first rate must be a positive finite number of requests/s, got "
                             f"{self.start}")
        if self.repeats < 1 or self.max_probes < 1:
            raise ValueError(f"repeats and max_probes must be >= 1, got {self.repeats} and {self.max_probes}")
        if not self.tol > 0:
            raise ValueError(f"tol (hi / lo <= 1 + tol ends the search) must be > 0, got {self.tol}")
        if self.min_rate is not None and not 0 < self.min_rate <= self.start:
            raise ValueError(f"min_rate must lie in (0, start = {self.start}], got {self.min_rate}")

    @property
    def floor(self) -> float:
        return self.min_rate if self.min_rate is not None else self.start / 64


@dataclass
class Probe:
    """One rate's repeats (``runs``: the measure's rows), their means and whether they meet the target (None while
    unfinished)."""

    rate: float
    runs: list[dict] = field(default_factory=list)
    passed: bool | None = None
    why: list[str] = field(default_factory=list)
    p90_tpot_ms: float | None = None
    p99_ttft_ms: float | None = None
    failed: int = 0

    def judge(self, target: Target) -> bool:
        self.p90_tpot_ms = _mean(self.runs, TARGET_KEYS["tpot"])
        self.p99_ttft_ms = _mean(self.runs, TARGET_KEYS["ttft"])
        self.failed = sum(int(r.get("failed") or 0) for r in self.runs)
        self.why = target.misses(self.p90_tpot_ms, self.p99_ttft_ms, self.failed)
        self.passed = not self.why
        return self.passed


@dataclass
class Capacity:
    """A search's outcome (module docstring): ``status``, a ``message`` saying it in words, the capacity ``rate``
    (the highest passing rate; None where none passed), ``bracket`` ([highest passing, lowest failing], either None
    where not found) and every probe in the order measured."""

    status: str
    message: str
    rate: float | None
    bracket: list
    probes: list[Probe]
    target: Target

    def at_capacity(self) -> Probe | None:
        return next((p for p in self.probes if p.passed and p.rate == self.rate), None)

    def figures(self, price_per_hour: float | None = None) -> dict:
        """At the capacity rate: requests/s and output tokens/s (mean over repeats and, from two repeats, a 95%
        t-interval), and the cost per 1M output tokens at ``price_per_hour`` (from the mean)."""
        p = self.at_capacity()
        if p is None:
            return {}
        out = {"rate": self.rate, "repeats": len(p.runs)}
        for key in ("request_throughput", "output_throughput"):
            out[key], out[f"{key}_ci"] = mean_interval([r.get(key) for r in p.runs])
        if price_per_hour is not None and out["output_throughput"]:
            out["usd_per_1m_output_tokens"] = cost_per_million(price_per_hour, out["output_throughput"])
        return out

    def to_dict(self, price_per_hour: float | None = None) -> dict:
        return {"status": self.status, "message": self.message, "rate": self.rate, "bracket": self.bracket,
                "target": asdict(self.target), "at_capacity": self.figures(price_per_hour),
                "probes": [asdict(p) for p in self.probes]}


def find_capacity(measure: Callable[[float, int], dict], target: Target, search: Search, *,
                  on_probe: Callable[[Capacity], None] | None = None) -> Capacity:
    """The highest rate whose repeats meet ``target``, by the bounded search of the module docstring. ``measure(rate,
    repeat)`` returns one run's row at ``rate`` requests/s or raises ``MeasureError``; ``on_probe`` gets the search
    so far after every repeat (status ``running``)."""
    probes: list[Probe] = []
    lo = hi = None  # highest passing, lowest failing rate
    rate = search.start

    def state(status: str, message: str) -> Capacity:
        return Capacity(status, message, lo, [lo, hi], probes, target)

    while len(probes) < search.max_probes:
        probe = Probe(rate)
        probes.append(probe)
        for rep in range(search.repeats):
            try:
                probe.runs.append(measure(rate, rep))
            except MeasureError as e:
                return state("error", f"the measurement at {rate:.4g} requests/s (repeat {rep}) failed: {e}; "
                                      f"what was measured before it is kept ({len(probes) - 1} rates)")
            if on_probe is not None:
                on_probe(state("running", f"probing {rate:.4g} requests/s"))
        if probe.judge(target):
            lo = rate if lo is None else max(lo, rate)
        else:
            hi = rate if hi is None else min(hi, rate)
        if hi is not None and hi <= search.floor:
            return state("unmeetable", f"the target ({target.describe()}) is missed even at {hi:.4g} requests/s, the "
                                       f"lowest rate this search probes ({'; '.join(probe.why)})")
        if lo is not None and hi is not None and hi / lo <= 1 + search.tol:
            return state("converged", f"capacity {lo:.4g} requests/s: the target holds there and breaks at "
                                      f"{hi:.4g} ({'; '.join(probes[-1].why) if not probes[-1].passed else 'met'})")
        if hi is None:
            rate = rate * 2
        elif lo is None:
            rate = max(rate / 2, search.floor)
        else:
            rate = math.sqrt(lo * hi)
    if lo is None:
        msg = (f"no rate met the target ({target.describe()}) within {search.max_probes} probes, down to "
               f"{hi:.4g} requests/s; raise --max-probes or start lower")
    elif hi is None:
        msg = (f"the target held at every rate probed, up to {lo:.4g} requests/s, within {search.max_probes} probes: "
               "the capacity is at least that (a lower bound); raise --max-probes or start higher")
    else:
        msg = (f"the search stopped at its bound of {search.max_probes} probes between {lo:.4g} (met) and {hi:.4g} "
               f"requests/s (missed), wider than tol {search.tol}: the capacity is at least {lo:.4g}")
    return state("bound", msg)


def cost_per_million(price_per_hour: float, output_tokens_per_s: float) -> float:
    """Dollars per 1M output tokens of a machine at ``price_per_hour`` producing ``output_tokens_per_s``."""
    return price_per_hour / 3600.0 / output_tokens_per_s * 1e6


def mean_interval(values: list, level: float = 0.95) -> tuple[float | None, list[float] | None]:
    """(mean, Student-t interval at ``level``) of the values that are not None; the interval from two values on."""
    vals = [float(v) for v in values if v is not None]
    if not vals:
        return None, None
    m = statistics.fmean(vals)
    if len(vals) < 2:
        return m, None
    from scipy.stats import t

    half = t.ppf(0.5 + level / 2, len(vals) - 1) * statistics.stdev(vals) / math.sqrt(len(vals))
    return m, [m - half, m + half]


def _mean(rows: list[dict], key: str) -> float | None:
    vals = [r[key] for r in rows if r.get(key) is not None]
    return statistics.fmean(vals) if vals else None


def _with_ci(value, ci, spec: str) -> str:
    return cell(value, spec) + (f" [{ci[0]:{spec}}, {ci[1]:{spec}}]" if ci else "")


def markdown(results: dict[str, dict], target: Target, price_per_hour: float | None = None) -> str:
    """One row per configuration (``results``: {config: ``Capacity.to_dict()``}): its outcome, capacity in requests/s
    and output tokens/s at it (95% intervals over repeats), the latencies there, cost per 1M output tokens and the
    capacity against no speculation's."""
    base = (results.get("none") or {}).get("at_capacity", {}).get("rate")
    rows = []
    for name, r in results.items():
        f = r.get("at_capacity") or {}
        p = next((x for x in r.get("probes", []) if x["passed"] and x["rate"] == r.get("rate")), {})
        rows.append([name, r["status"], _with_ci(f.get("request_throughput"), f.get("request_throughput_ci"), ".3f"),
                     _with_ci(f.get("output_throughput"), f.get("output_throughput_ci"), ".1f"),
                     cell(p.get("p90_tpot_ms"), ".1f"), cell(p.get("p99_ttft_ms"), ".0f"),
                     cell(f.get("usd_per_1m_output_tokens"), ".3f"),
                     cell(f["rate"] / base if base and f.get("rate") else None, ".2f"),
                     f"{len(r.get('probes', []))}", f"{cell(r['bracket'][0], '.3g')} / {cell(r['bracket'][1], '.3g')}"])
    price = f" at ${price_per_hour:g}/hour" if price_per_hour is not None else ""
    return (f"Capacity at {target.describe()} (Poisson arrivals; 95% intervals over repeats):\n\n"
            + table(["config", "status", "requests/s", "output tok/s", "P90 TPOT ms", "P99 TTFT ms",
                     f"$ per 1M output tokens{price}", "capacity vs none", "probes", "bracket: met / missed"], rows)
            + "".join(f"\n\n- {name}: {r['message']}" for name, r in results.items() if r["status"] != "converged"))
