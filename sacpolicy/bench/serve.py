"""The tables of ``scripts/bench_serve.py``: vLLM's load-client results read per request, the learned rule's ratios
to the other configurations with paired intervals over repeats and requests, a Markdown table per rate and a plot.

A run's ``results`` are ``{config: {str(rate_x): [row per repeat]}}``, a row holding ``summarize``'s figures of one
``vllm bench serve`` result and its ``per_request`` latencies (runs recorded before those were kept have none: their
ratios come without intervals).
"""

from __future__ import annotations

import statistics
from pathlib import Path

import numpy as np

from sacpolicy.bench import cell, table
from sacpolicy.evaluation.intervals import nested_ratio_interval

METRICS = ("tpot", "e2el", "ttft")


def summarize(res: dict) -> dict:
    """The figures of one ``vllm bench serve`` result that the table reads."""
    row = {k: res.get(k) for k in ("duration", "completed", "failed", "request_throughput", "output_throughput",
                                   "total_output_tokens")}
    if not row["completed"]:  # every request failed (the server died): no figures, only the failures
        return {**row, "output_throughput": None, "request_throughput": None}
    for m in METRICS:
        for stat in ("mean", "median", "p50", "p90", "p99"):
            if f"{stat}_{m}_ms" in res:
                row[f"{stat}_{m}_ms"] = res[f"{stat}_{m}_ms"]
    row["p50_tpot_ms"] = row.get("p50_tpot_ms", row.get("median_tpot_ms"))
    row["p50_e2el_ms"] = row.get("p50_e2el_ms", row.get("median_e2el_ms"))
    for k in ("spec_decode_acceptance_length", "spec_decode_acceptance_rate", "spec_decode_num_drafts",
              "spec_decode_draft_tokens", "spec_decode_accepted_tokens", "spec_decode_per_position_acceptance_rates"):
        if k in res:
            row[k] = res[k]
    return row


def per_request(res: dict) -> dict:
    """Each request's end-to-end latency and TPOT in ms (vLLM's TPOT: the time after the first token over the tokens
    after it), None where the request failed (or made one token: no TPOT), in the order the requests were sent."""
    out: dict = {"e2el_ms": [], "tpot_ms": []}
    for lat, ttft, n, err in zip(*(res.get(k, []) for k in ("latencies", "ttfts", "output_lens", "errors"))):
        out["e2el_ms"].append(None if err else lat * 1e3)
        out["tpot_ms"].append(None if err or n < 2 else (lat - ttft) / (n - 1) * 1e3)
    return out


def same_as(texts: list, errors: list, ref: list) -> tuple[int, int]:
    """(identical, compared): completions equal to the reference's for the same request, over requests that both
    completed."""
    pairs = [(t, r) for t, e, r in zip(texts, errors, ref) if not e and r is not None]
    return sum(t == r for t, r in pairs), len(pairs)


def _mean(rows: list[dict], key: str) -> float | None:
    vals = [r[key] for r in rows if r.get(key) is not None]
    return statistics.fmean(vals) if vals else None


def markdown(results: dict, rates: list[float], capacity: float, v: list[dict] | None = None) -> str:
    """A table per rate: each configuration's means over repeats; then the learned rule's ratios, ``v`` (``verdict``'s
    rows, computed here when not given: pass them where the caller keeps them too, the intervals take seconds)."""
    out = []
    for r in rates:
        lines = []
        for name, by_rate in results.items():
            rows = by_rate[str(r)]
            if not rows:
                continue
            g = lambda k, rows=rows: _mean(rows, k)
            acc = g("spec_decode_acceptance_length")
            lines.append([name, cell(g("output_throughput"), ".1f"), cell(g("mean_tpot_ms"), ".1f"),
                          "/".join(cell(g(f"p{p}_tpot_ms"), ".0f") for p in (50, 90, 99)),
                          cell(g("mean_e2el_ms") and g("mean_e2el_ms") / 1e3, ".2f"),
                          "/".join(cell(g(f"p{p}_e2el_ms") and g(f"p{p}_e2el_ms") / 1e3, ".1f")
                                   for p in (50, 90, 99)),
                          cell(acc, ".2f"), f"{sum(x['identical'] for x in rows)}/{sum(x['compared'] for x in rows)}",
                          sum(x["failed"] or 0 for x in rows)])
        out.append(f"Rate {r}x capacity ({r * capacity:.3f} requests/s):\n\n" + table(
            ["config", "output tok/s", "mean TPOT ms", "TPOT P50/P90/P99 ms", "mean e2e s", "e2e P50/P90/P99 s",
             "tokens/step", "identical", "failed"], lines))
    v = verdict(results, rates) if v is None else v
    if v:
        keys = ("tpot_vs_none", "tpot_vs_ngram", "throughput_vs_best", "p99_e2el_vs_best", "tpot_vs_none_sync",
                "p99_e2el_vs_none_sync", "tpot_vs_spec_idle", "tpot_vs_learned", "tpot_vs_learned_ngram",
                "tpot_vs_learned_fitted")
        out.append("Learned rule vs the others (95% intervals: paired bootstrap over repeats and requests):\n\n"
                   + table(["config", "rate", "mean TPOT vs none", "mean TPOT vs vLLM n-gram",
                            "throughput vs best other", "P99 e2e vs best other", "mean TPOT vs none-sync",
                            "P99 e2e vs none-sync", "mean TPOT vs spec-idle", "mean TPOT vs learned",
                            "mean TPOT vs learned-ngram", "mean TPOT vs learned-fitted", "best other (throughput)"],
                           [[x["policy"], f"{x['rate_x']}x", *(_with_ci(x, k) for k in keys),
                             x.get("best_other", "-")] for x in v]))
    cost = log_cost(results, rates)
    if cost:
        out.append("The step log's own cost (learned-logged; the proposer's stats over each server's runs): engine "
                   f"thread {cost['engine_share']:.2%} of the served time, writer thread CPU "
                   f"{cost['writer_share']:.2%} of it ({cost['steps']} engine steps, {cost['written']} records "
                   f"written, {cost['dropped']} dropped)" + (
                       f"; the process's garbage collections {cost['gc_share']:.2%} of it, {cost['gc_share_off']:.2%} "
                       "with the log off (learned)" if "gc_share" in cost and "gc_share_off" in cost else ""))
    return "\n\n".join(out)


def log_cost(results: dict, rates: list[float]) -> dict | None:
    """What the step log cost the ``learned-logged`` servers, from their proposers' stats (``steplog``: engine-thread
    seconds in the log, the writer thread's CPU seconds) against the time the server served requests (each repeat's
    runs' durations, all rates): the shares over all repeats, and the steps, records written and dropped. None when
    no such server reported."""
    stats = [x for x in results.get("learned-logged", {}).get("proposer", []) if x.get("steplog")]
    served = {rep: sum(r.get("duration") or 0.0 for rate in rates
                       for r in results["learned-logged"].get(str(rate), []) if r["repeat"] == rep)
              for rep in {x["repeat"] for x in stats}}
    seconds = sum(served.values())
    if not stats or not seconds:
        return None
    total = {k: sum(x["steplog"][k] for x in stats) for k in ("engine_s", "writer_cpu_s", "steps", "written",
                                                               "dropped")}
    out = {"engine_share": total["engine_s"] / seconds, "writer_share": total["writer_cpu_s"] / seconds,
           "served_s": seconds, **total}
    for name, key in (("learned-logged", "gc_share"), ("learned", "gc_share_off")):  # collections, log on and off
        gcs = [x for x in results.get(name, {}).get("proposer", []) if x.get("gc")]
        spent = sum(r.get("duration") or 0.0 for rate in rates for r in results.get(name, {}).get(str(rate), [])
                    if r.get("repeat") in {x["repeat"] for x in gcs})
        if gcs and spent:
            out[key] = sum(sum(x["gc"]["seconds"]) for x in gcs) / spent
    return out


def _with_ci(x: dict, key: str) -> str:
    ci = x.get(f"{key}_ci")
    return cell(x.get(key), ".2f") + (f" [{ci[0]:.2f}, {ci[1]:.2f}]" if ci else "")


STATS = {"tpot_ms": lambda v: np.nanmean(v, axis=-1), "e2el_ms": lambda v: np.nanpercentile(v, 99, axis=-1)}


def _interval(mine: list[dict], others: dict, key: str) -> list[float] | None:
    """The ratio's interval (``nested_ratio_interval``: mean TPOT for tpot_ms, P99 for e2el_ms) where every run
    kept its per-request latencies (runs before they were kept: none)."""
    vals = {n: [r.get("per_request", {}).get(key) for r in rows] for n, rows in {"": mine, **others}.items()}
    if any(not v or not all(v) for v in vals.values()) or len({len(x) for v in vals.values() for x in v}) != 1:
        return None
    k = min(len(v) for v in vals.values())  # repeats of every configuration
    arr = {n: np.array([[np.nan if y is None else y for y in x] for x in v[:k]]) for n, v in vals.items()}
    return list(nested_ratio_interval(arr.pop(""), arr, STATS[key]))


# the learned rule; with its step log on; with its n-gram drafter alone; with the EAGLE-3 head; another export's rule
# (a refit's candidate, set against learned)
LEARNED = ("learned", "learned-fitted", "learned-logged", "learned-ngram", "learned-head", "candidate")


def verdict(results: dict, rates: list[float]) -> list[dict]:
    """Per learned configuration (``LEARNED``) and rate, its ratios: mean TPOT to none's and vLLM n-gram's; output
    throughput and P99 end-to-end latency to the best of {none, vLLM n-gram, static} at that rate (throughput: the
    highest; P99: the lowest); mean TPOT to the diagnostic baselines' where they ran: none-sync (no speculation,
    synchronous scheduling, as vLLM runs n-gram and ``custom_class`` speculation) and spec-idle (speculation on,
    nothing ever drafted); ``learned-logged``'s mean TPOT to ``learned``'s (``tpot_vs_learned``: the step log's
    overhead; ``candidate``'s: another export's rule against the one it would replace); ``learned``'s to
    ``learned-ngram``'s (``tpot_vs_learned_ngram``: what its suffix drafter adds) and to ``learned-fitted``'s
    (``tpot_vs_learned_fitted``: what learning while serving costs or gains). Each
    TPOT and P99 ratio ``key`` comes with ``key_ci``, its 95% interval (paired over repeats and requests:
    ``nested_ratio_interval``), None for runs that kept no per-request latencies."""
    return [x for name in LEARNED if name in results for x in _verdict(results, rates, name)]


def _verdict(results: dict, rates: list[float], name: str) -> list[dict]:
    out = []
    for r in rates:
        mine = results[name][str(r)]
        others = {n: results[n][str(r)] for n in ("none", "vllm-ngram", "static") if n in results and results[n][str(r)]}
        if not others or _mean(mine, "output_throughput") is None:  # no learned run, or every request failed
            continue
        x = {"policy": name, "rate_x": r}
        for n, key in (("none", "tpot_vs_none"), ("vllm-ngram", "tpot_vs_ngram"), ("none-sync", "tpot_vs_none_sync"),
                       ("spec-idle", "tpot_vs_spec_idle"), ("learned", "tpot_vs_learned"),
                       ("learned-ngram", "tpot_vs_learned_ngram"), ("learned-fitted", "tpot_vs_learned_fitted")):
            if n == name:
                continue
            rows = results.get(n, {}).get(str(r))
            if rows and _mean(rows, "mean_tpot_ms"):
                x[key] = _mean(mine, "mean_tpot_ms") / _mean(rows, "mean_tpot_ms")
                x[f"{key}_ci"] = _interval(mine, {n: rows}, "tpot_ms")
        sync = results.get("none-sync", {}).get(str(r))
        if sync and _mean(sync, "p99_e2el_ms") and _mean(mine, "p99_e2el_ms"):
            x["p99_e2el_vs_none_sync"] = _mean(mine, "p99_e2el_ms") / _mean(sync, "p99_e2el_ms")
            x["p99_e2el_vs_none_sync_ci"] = _interval(mine, {"none-sync": sync}, "e2el_ms")
        tp = {n: _mean(rows, "output_throughput") for n, rows in others.items()}
        best = max(tp, key=lambda n: tp[n] or 0)
        x["best_other"] = best
        x["throughput_vs_best"] = (_mean(mine, "output_throughput") or 0) / tp[best] if tp[best] else None
        p99 = {n: _mean(rows, "p99_e2el_ms") for n, rows in others.items() if _mean(rows, "p99_e2el_ms")}
        if p99 and _mean(mine, "p99_e2el_ms"):
            x["p99_e2el_vs_best"] = _mean(mine, "p99_e2el_ms") / min(p99.values())
            x["p99_e2el_vs_best_ci"] = _interval(mine, {n: others[n] for n in p99}, "e2el_ms")
        out.append(x)
    return out


def draw(results: dict, rates: list[float], capacity: float, path: Path) -> None:
    from sacpolicy.evaluation.plots import line_plot

    def series(key: str, scale: float) -> dict:
        return {n: [(r * capacity, (_mean(by_rate[str(r)], key) or float("nan")) * scale) for r in rates
                    if by_rate[str(r)]] for n, by_rate in results.items()}

    line_plot(path, [{"series": series("mean_tpot_ms", 1.0), "xlabel": "requests/s (Poisson)",
                      "ylabel": "mean TPOT (ms)", "title": "time per output token"},
                     {"series": series("p99_e2el_ms", 1e-3), "xlabel": "requests/s (Poisson)",
                      "ylabel": "P99 end-to-end latency (s)", "title": "tail latency"}])
