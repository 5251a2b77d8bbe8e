"""Evaluation rows as Markdown tables and as the files a run leaves behind: eval.json/md and report.json/md."""

from __future__ import annotations

import json
import os
from pathlib import Path

from sacpolicy.evaluation.intervals import MIN_PROMPTS
from sacpolicy.evaluation.metrics import ARTEFACT, dropped_text, gain_captured
from sacpolicy.io import write_json, write_text

MARK = "⚠"  # beside the name of a row that beats AR with nothing accepted (footnoted)
DROPPED = "†"  # beside the name of a row some of whose requests dropped a drafter (footnoted)
_COLUMNS = [  # (header, row key, format); a ratio column shows its 95% interval beside it
    ("name", "name", "{}"), ("mode", "mode", "{}"), ("tokens/s", "tokens_per_s", "{:.1f}"),
    ("speedup vs AR [95% CI]", "speedup_vs_ar", "ratio"), ("vs best static [95% CI]", "speedup_vs_best_static", "ratio"),
    ("tokens/target call", "tokens_per_call", "{:.2f}"), ("target calls/token", "target_calls_per_token", "{:.3f}"),
    ("draft calls/token", "draft_calls_per_token", "{:.2f}"),
    ("$/1k tokens", "cost_per_1k_tokens", "{:.4f}"), ("p50 ms", "latency_p50_ms", "{:.1f}"),
    ("p90 ms", "latency_p90_ms", "{:.1f}"), ("p99 ms", "latency_p99_ms", "{:.1f}"),
    ("policy %", "policy_fraction", "{:.1%}"),
]
CEILINGS = {
    "per-prompt-static": "the best static (drafter, k) of each prompt, chosen in hindsight on that prompt's traces",
    "in-sample": "the same predictor fitted, calibrated and tuned on the test traces themselves (a ceiling for it on "
                 "these features)",
    "oracle": "drafts exactly what the target will accept, step by step: a bound no policy reaches",
}


def markdown_table(rows: list[dict]) -> str:
    """One line per row: throughput, ratios against AR and best static with their intervals, calls per token, cost
    and per-token latency ('-' where missing); a row that beats AR with nothing accepted is marked."""
    body = [[_cell(r, key, fmt) for _, key, fmt in _COLUMNS] for r in rows]
    for line, r in zip(body, rows):
        marks = [MARK] * bool(r.get("beats_ar_nothing_accepted")) + [DROPPED] * bool(r.get("dropped_drafters"))
        line[0] = " ".join([r["name"], *marks])
    return _table([h for h, _, _ in _COLUMNS], body)


def dropped_note(rows: list[dict]) -> str | None:
    """The footnote of the rows some of whose requests dropped a drafter (it raised): which drafter, in how many of
    the row's requests; None when no row did."""
    parts = [f"{r['name']} ({r['mode']}): {dropped_text(r['dropped_drafters'], len(r['per_prompt']['tokens']))}"
             for r in rows if r.get("dropped_drafters")]
    return (f"{DROPPED} drafters dropped (they raised; those requests were decoded and timed without them, so the row "
            f"is not the policy as configured): {'; '.join(parts)}.") if parts else None


def category_table(rows: list[dict], key: str = "speedup_vs_ar") -> str:
    """``key`` (the ratio against AR or best static) of each row in each prompt category with its interval, so a
    policy that only wins on code shows it; too few prompts for an interval is said in the cell."""
    categories = sorted({c for r in rows for c in r["per_category"]})
    return _table(["name", "mode", *categories],
                  [[r["name"], r["mode"], *(_cell(r["per_category"].get(c, {}), key, "ratio") for c in categories)]
                   for r in rows])


def write_eval(out_dir, rows: list[dict], meta: dict) -> Path:
    """Write eval.json (``{"rows", "meta"}``) and eval.md (the tables) into ``out_dir``; return the JSON path."""
    out_dir = Path(out_dir)
    path = write_json(out_dir / "eval.json", {"rows": rows, "meta": meta})
    write_text(out_dir / "eval.md", "# Evaluation\n\n" + _eval_markdown({"rows": rows, "meta": meta}))
    return path


def write_report(out_dir, eval: dict, *, command: str, sections: dict[str, str] | None = None,
                 plots: list[Path] | None = None) -> tuple[Path, Path]:
    """Write report.md and report.json: how to reproduce, the tables, extra sections (heading -> Markdown), plots.

    Plots are linked relative to ``out_dir`` so the report renders wherever the folder is copied.
    """
    out_dir = Path(out_dir)
    sections, plots = sections or {}, [os.path.relpath(p, out_dir) for p in plots or []]
    parts = ["# Speculation policy evaluation", f"## Reproduce\n\n```bash\n{command}\n```", _eval_markdown(eval)]
    parts += [f"## {heading}\n\n{body.strip()}" for heading, body in sections.items()]
    if plots:
        parts.append("## Plots\n\n" + "\n\n".join(f"![{Path(p).stem}]({Path(p).as_posix()})" for p in plots))
    md = write_text(out_dir / "report.md", "\n\n".join(parts) + "\n")
    js = write_json(out_dir / "report.json", {"eval": eval, "command": command, "sections": sections, "plots": plots})
    return md, js


def load_table(rows: list[dict]) -> str:
    out = ["| load | policy | tokens/s | vs AR | vs best static | P50 s | P90 s | P99 s | tokens/call |",
           "|---|---|---|---|---|---|---|---|---|"]
    out += [f"| {r['load']} | {r['policy']} | {r['tokens_per_s']:.1f} | {r['vs_ar']:.2f}x | {r['vs_best_static']:.2f}x "
            f"| {r['p50_s']:.2f} | {r['p90_s']:.2f} | {r['p99_s']:.2f} | {r['tokens_per_call']:.2f} |" for r in rows]
    return "\n".join(out)


def _eval_markdown(eval: dict) -> str:
    meta, rows = eval.get("meta", {}), eval["rows"]
    setup = "\n".join(f"- {k}: {v}" for k, v in meta.items()
                      if k not in ("load", "simulated_vs_live", "peers", "learned_vs_peers"))
    notes = [meta["simulated_skipped"]] if meta.get("simulated_skipped") else []
    notes.append("Ratios compare tokens/s with the row of the same mode; [a, b]: 95% paired bootstrap interval over "
                 f"prompts ({meta.get('bootstrap_resamples', 2000)} resamples); no interval under {MIN_PROMPTS} "
                 "prompts.")
    if any(r.get("beats_ar_nothing_accepted") for r in rows):
        notes.append(f"{MARK} {ARTEFACT}.")
    if dropped_note(rows):
        notes.append(dropped_note(rows))
    parts = [f"## Setup\n\n{setup}"] if setup else []
    parts.append(f"## Results\n\n{markdown_table(rows)}\n\n" + "\n".join(f"- {n}" for n in notes))
    if meta.get("simulated_vs_live"):
        parts.append(f"## Simulated vs live\n\n{_sim_vs_live(meta['simulated_vs_live'], meta.get('machine_speed'))}")
    if meta.get("peers"):
        parts.append(f"## Peers (the engines' controllers, tuned on validation traces)\n\n{_peers(meta)}")
    ceilings = _ceilings(rows, meta.get("in_sample_skipped", {}))
    if ceilings:
        parts.append(f"## Ceilings (simulated on the test traces)\n\n{ceilings}")
    parts.append(f"## Speedup vs AR by category\n\n{category_table(rows)}")
    if meta.get("load"):
        parts.append("## Under load (simulated: the test traces replayed by the batched decoder, cost model at each "
                     f"batch size; Poisson rates are fractions of AR's throughput at the largest batch)\n\n"
                     f"{load_table(meta['load'])}")
    if any("speedup_vs_best_static" in r for r in rows):
        parts.append(f"## Speedup vs best static by category\n\n{category_table(rows, 'speedup_vs_best_static')}")
    return "\n\n".join(parts)


def _sim_vs_live(errors: dict, speed: dict | None) -> str:
    """Each live row's simulated and live tokens/s, and how far the machine's speed moved while they were measured."""
    body = [[name, f"{e['simulated']:.1f}", f"{e['live']:.1f}", f"{e['error']:+.0%}"] for name, e in errors.items()]
    table = _table(["row", "simulated tokens/s", "live tokens/s", "simulated vs live"], body)
    if not speed:
        return table + "\n\n- No probe of the machine's speed (eval.speed_probe_every = 0)."
    probes = sorted(speed["probes_s"])
    median = speed["ratio"] * speed["reference_s"]  # SpeedProbe.summary's: the probes' median over the reference
    return table + (f"\n\n- Machine speed while the live rows ran: the target's one-token pass at context "
                    f"{speed['context']} took {1e3 * probes[0]:.1f}-{1e3 * probes[-1]:.1f} ms over {len(probes)} "
                    f"probes (median {1e3 * median:.1f} ms, {speed['ratio']:.2f}x the "
                    + ("profile's own probe" if speed["reference"] == "probe"
                       else "pass the cost model priced: an older profile has no probe")
                    + f", {1e3 * speed['reference_s']:.1f} ms). The simulated rows are priced at the profile's "
                    "speed; a spread or ratio far from 1 says how much of their error the machine alone can make.")


def _peers(meta: dict) -> str:
    """Each peer's setting chosen on validation traces (the row ``peer-<name>``; the fastest is also ``best-peer``),
    then the learned policy against each peer row with its paired interval (``learned / best-peer`` first)."""
    best = meta.get("best_peer")
    body = [[f"peer-{n}" + (" (best-peer)" if n == best else ""), f"{p['val_tokens_per_s']:.1f}",
             f"`{json.dumps(p['settings'], separators=(',', ':'))}`"] for n, p in meta["peers"].items()]
    lines = [_table(["row", "val tokens/s (simulated)", "tuned setting"], body)]
    pairs = sorted(meta.get("learned_vs_peers", []), key=lambda p: (p["ref"] != "best-peer", p["mode"] != "live"))
    if pairs:
        lines.append("")
    for p in pairs:
        detail = f"{p['row']} vs peer-{best}" if p["ref"] == "best-peer" else p["row"]
        lines.append(f"- learned / {p['ref']} ({p['mode']}, {detail}, {p['n_prompts']} prompts): {p['ratio']:.2f}x "
                     f"[{p['ci'][0]:.2f}, {p['ci'][1]:.2f}]")
    return "\n".join(lines)


def _ceilings(rows: list[dict], skipped: dict) -> str:
    """What each ceiling row is, and the share of each ceiling's gain over best static the learned rows capture."""
    names = [r["name"] for r in rows if r["mode"] == "simulated"]
    lines = [f"- {n}: {CEILINGS[n]}" for n in ("per-prompt-static", "oracle") if n in names]
    lines += [f"- learned-{p}-in-sample: none, {why}" for p, why in skipped.items()]
    for n in names:
        if n.startswith("learned-") and f"{n}-in-sample" in names:
            lines.append(f"- {n}-in-sample: {CEILINGS['in-sample']}")
            for ceiling in (f"{n}-in-sample", "oracle"):
                share = gain_captured(rows, n, ceiling)
                lines.append(f"- {n} captures {'-' if share is None else f'{share:.0%}'} of {ceiling}'s gain over "
                             "best-static" + (" (target: >= 75%)" if ceiling != "oracle" else ""))
    return "\n".join(lines)


def _table(header: list[str], body: list[list[str]]) -> str:
    lines = [header, ["---"] * len(header), *body]
    return "\n".join("| " + " | ".join(map(str, line)) + " |" for line in lines)


def _cell(d: dict, key: str, fmt: str) -> str:
    value = d.get(key)
    if value is None:
        return "-"
    if fmt != "ratio":
        return fmt.format(value)
    ci = d.get(f"{key}_ci")
    if ci is not None:
        return f"{value:.2f}x [{ci[0]:.2f}, {ci[1]:.2f}]"
    if d.get("n_prompts", MIN_PROMPTS) < MIN_PROMPTS:
        return f"{value:.2f}x (not enough prompts: {d['n_prompts']})"
    return f"{value:.2f}x"
