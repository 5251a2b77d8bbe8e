"""Evaluation rows as Markdown tables and as the files a run leaves behind: eval.json/md and report.json/md."""

from __future__ import annotations

import os
from pathlib import Path

from sacpolicy.io import write_json, write_text

_COLUMNS = [  # (header, row key, format)
    ("name", "name", "{}"), ("mode", "mode", "{}"), ("tokens/s", "tokens_per_s", "{:.1f}"),
    ("speedup vs AR", "speedup_vs_ar", "{:.2f}x"), ("tokens/target call", "tokens_per_call", "{:.2f}"),
    ("target calls/token", "target_calls_per_token", "{:.3f}"),
    ("draft calls/token", "draft_calls_per_token", "{:.2f}"),
    ("$/1k tokens", "cost_per_1k_tokens", "{:.4f}"), ("p50 ms", "latency_p50_ms", "{:.1f}"),
    ("p90 ms", "latency_p90_ms", "{:.1f}"), ("p99 ms", "latency_p99_ms", "{:.1f}"),
    ("policy %", "policy_fraction", "{:.1%}"),
]


def markdown_table(rows: list[dict]) -> str:
    """One line per row: throughput, speedup, calls per token, cost and per-token latency ('-' where missing)."""
    return _table([h for h, _, _ in _COLUMNS], [[_fmt(fmt, r.get(key)) for _, key, fmt in _COLUMNS] for r in rows])


def category_table(rows: list[dict]) -> str:
    """Speedup vs AR of each row in each prompt category, so a policy that only wins on code shows it."""
    categories = sorted({c for r in rows for c in r["per_category"]})
    return _table(["name", "mode", *categories],
                  [[r["name"], r["mode"], *(_fmt("{:.2f}x", r["per_category"].get(c, {}).get("speedup_vs_ar"))
                                            for c in categories)] for r in rows])


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


def _eval_markdown(eval: dict) -> str:
    setup = "\n".join(f"- {k}: {v}" for k, v in eval.get("meta", {}).items())
    rows = eval["rows"]
    return (f"## Setup\n\n{setup}\n\n" if setup else "") + (
        f"## Results\n\n{markdown_table(rows)}\n\n## Speedup vs AR by category\n\n{category_table(rows)}")


def _table(header: list[str], body: list[list[str]]) -> str:
    lines = [header, ["---"] * len(header), *body]
    return "\n".join("| " + " | ".join(map(str, line)) + " |" for line in lines)


def _fmt(fmt: str, value) -> str:
    return "-" if value is None else fmt.format(value)
