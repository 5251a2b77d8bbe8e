"""One table row per evaluated policy, from its generations: throughput, calls per token, latency, cost, histograms.

Live and simulated rows are built the same way: a simulated GenerationResult carries predicted seconds in
``prefill_s``, ``total_s`` and each step's ``draft_s``/``verify_s``, so nothing here knows which kind it reads. A
prompt of sampled traces is one result holding all its draws (``traces.draws.DrawnResult``): one prefill per draw.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # only for annotations: importing sacpolicy.decoding pulls in torch
    from sacpolicy.decoding.types import GenerationResult

MODES = ("live", "simulated")


def row_from_results(name: str, mode: str, results: list[tuple[str | None, GenerationResult]], *,
                     price_per_hour: float, policy_s: float = 0.0, extra: dict | None = None) -> dict:
    """Aggregate ``(category, result)`` pairs of one policy into a row; ``policy_s`` is time spent deciding.

    ``draft_calls_per_token`` counts one drafter forward per drafted token, which is exact for model and layer-skip
    drafters; an n-gram lookup costs no forward but is counted the same, since a step does not record the kind.
    ``cost_per_1k_tokens`` prices device time: seconds per token at ``price_per_hour``.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    tokens = sum(len(r.tokens) for _, r in results)
    seconds = sum(r.total_s for _, r in results)
    if tokens == 0 or seconds <= 0:
        raise ValueError(f"row {name!r} has {tokens} tokens in {seconds} s; evaluate at least one prompt with "
                         "max_new_tokens > 0 (simulated results must carry predicted seconds in total_s)")
    steps = [s for _, r in results for s in r.steps]
    drafting = [s for s in steps if s.drafted > 0]
    drafted = sum(s.drafted for s in drafting)
    target_calls = sum(r.target_calls for _, r in results)

    latency = []  # seconds per emitted token: a step's time is shared by the tokens it emitted
    for _, r in results:
        if r.tokens:  # the first token comes from the prefill pass (one per draw of a sampled replay's result)
            prefills = r.target_calls - len(r.steps)
            latency += [r.prefill_s / prefills] * prefills
        for s in r.steps:
            if s.emitted:
                latency += [(s.draft_s + s.verify_s) / s.emitted] * s.emitted
    p50, p90, p99 = (float(v) * 1000 for v in np.percentile(latency, [50, 90, 99]))

    per_category: dict[str, dict] = {}
    for category, r in results:
        c = per_category.setdefault(category or "other", {"tokens": 0, "seconds": 0.0})
        c["tokens"] += len(r.tokens)
        c["seconds"] += r.total_s
    for c in per_category.values():
        c["tokens_per_s"] = c["tokens"] / c["seconds"] if c["seconds"] > 0 else 0.0

    row = {
        "name": name, "mode": mode, "tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
        "tokens_per_call": tokens / target_calls,
        "target_calls_per_token": target_calls / tokens,
        "draft_calls_per_token": sum(s.drafted for s in steps if s.drafter is not None) / tokens,
        "acceptance_rate": sum(s.accepted for s in drafting) / drafted if drafted else 0.0,
        "cost_per_1k_tokens": seconds / tokens * 1000 * price_per_hour / 3600,
        "latency_p50_ms": p50, "latency_p90_ms": p90, "latency_p99_ms": p99,
        "policy_s": policy_s, "policy_fraction": policy_s / seconds,
        "k_hist": _hist(s.k if s.drafter is not None else 0 for s in steps),
        "accept_hist": _hist(s.accepted for s in drafting),
        "per_category": dict(sorted(per_category.items())),
        # {drafter: requests that dropped it}: it raised, and the decoder decoded the rest of the request without it,
        # so those requests' tokens and seconds are not the policy's as configured (a learned row without its head)
        "dropped_drafters": dropped_counts(r.dropped_drafters for _, r in results),
        # in the order given: what bootstrap intervals resample (``evaluation.intervals``)
        "per_prompt": {"category": [c or "other" for c, _ in results], "tokens": [len(r.tokens) for _, r in results],
                       "seconds": [r.total_s for _, r in results]},
    }
    clash = set(row) & set(extra or {})
    if clash:
        raise ValueError(f"extra keys {sorted(clash)} would overwrite metrics of row {name!r}; rename them")
    return row | (extra or {})


def dropped_counts(dropped) -> dict[str, int]:
    """{drafter: requests that dropped it}, from each request's dropped drafters (``GenerationResult.dropped_drafters``,
    or the union over a request's repeats), drafters in name order: how evaluation rows, refit's live arms and the
    benchmarks count the requests decoded without a drafter they were configured with."""
    return dict(sorted(Counter(d for names in dropped for d in set(names)).items()))


def dropped_text(counts: dict[str, int], requests: int) -> str:
    """``dropped_counts``' {drafter: requests} as the reports write it: "feature in 2 of 48 requests, ..."."""
    return ", ".join(f"{d} in {n} of {requests} requests" for d, n in counts.items())


def add_speedups(rows: list[dict], baseline: str = "ar") -> None:
    """Set ``speedup_vs_ar`` on each row and each of its categories, against the baseline row of the same mode.

    Live and simulated rows are never compared with each other: predicted seconds are not measured seconds.
    """
    base = {r["mode"]: r for r in rows if r["name"] == baseline}
    for row in rows:
        ref = base.get(row["mode"])
        if ref is None:
            raise ValueError(f"no {baseline!r} row in mode {row['mode']!r} to compute speedups against; evaluate "
                             f"{baseline!r} in {row['mode']} mode too, or pass baseline= a row evaluated in it")
        row["speedup_vs_ar"] = row["tokens_per_s"] / ref["tokens_per_s"]
        for category, c in row["per_category"].items():
            ref_tps = ref["per_category"].get(category, {}).get("tokens_per_s", 0.0)
            c["speedup_vs_ar"] = c["tokens_per_s"] / ref_tps if ref_tps > 0 else None


ARTEFACT = "beats AR with nothing accepted: cost-model artefact"


def flag_artefacts(rows: list[dict]) -> None:
    """Set ``beats_ar_nothing_accepted`` on every row: faster than AR (``speedup_vs_ar`` > 1) while no drafted token
    was ever accepted (tokens per target call <= 1), which only a cost model that prices drafting below its true
    cost can produce. Call after ``add_speedups``."""
    for row in rows:
        row["beats_ar_nothing_accepted"] = bool(
            row.get("speedup_vs_ar") is not None and row["speedup_vs_ar"] > 1.0 and row["tokens_per_call"] <= 1.0)


def gain_captured(rows: list[dict], name: str, ceiling: str, baseline: str = "best-static",
                  mode: str = "simulated") -> float | None:
    """(row - baseline) / (ceiling - baseline) in tokens/s of ``mode`` rows; None when a row is missing or the
    ceiling does not beat the baseline (no gain to share)."""
    by = {r["name"]: r["tokens_per_s"] for r in rows if r["mode"] == mode}
    if not {name, ceiling, baseline} <= set(by) or by[ceiling] <= by[baseline]:
        return None
    return (by[name] - by[baseline]) / (by[ceiling] - by[baseline])


def _hist(values) -> dict[str, int]:
    return {str(v): n for v, n in sorted(Counter(values).items())}


def simulated_vs_live(rows: list[dict]) -> dict:
    """{row name: {"simulated", "live" (tokens/s), "error" (simulated / live - 1)}} for every row with both modes."""
    by = {(r["name"], r["mode"]): r["tokens_per_s"] for r in rows}
    return {name: {"simulated": by[name, "simulated"], "live": by[name, "live"],
                   "error": by[name, "simulated"] / by[name, "live"] - 1.0}
            for name in dict.fromkeys(r["name"] for r in rows if r["mode"] == "live") if (name, "simulated") in by}
