"""Acceptance traces on disk: versioned Parquet shards plus a sidecar ``meta.json``, loadable with ``datasets``.

Two kinds:
- ``live``: one row per decoder step (a ``StepRecord`` plus the prompt it belongs to);
- ``teacher_forced``: one row per (prompt, drafter, generated position): what the drafter predicts at that position
  given the target's own prefix, and ``run_len``, the number of consecutive tokens it would get accepted from there.
  For greedy decoding these rows determine exactly what any drafting decision would have produced.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from sacpolicy.io import write_json

logger = logging.getLogger(__name__)

# 5: teacher-forced rows carry each proposed token's confidence (``proposal_confidence``); 4: live rows carry the
# step's batch_size; 3: live rows say "cooldown" (was "fallback"); 2: teacher-forced rows say whether the drafter's
# block is one proposal (``proposal``)
SCHEMA_VERSION = 5
META_FILE = "meta.json"
KINDS = ("live", "teacher_forced")

_floats = pa.list_(pa.float32())
SCHEMAS = {
    "live": pa.schema([
        ("prompt_id", pa.string()), ("category", pa.string()), ("prompt_len", pa.int32()), ("policy", pa.string()),
        ("step", pa.int32()), ("drafter", pa.string()), ("k", pa.int32()), ("drafted", pa.int32()),
        ("accepted", pa.int32()), ("emitted", pa.int32()), ("context_len", pa.int32()), ("draft_s", pa.float64()),
        ("verify_s", pa.float64()), ("cooldown", pa.bool_()), ("top1", _floats), ("entropy", _floats),
        ("margin", _floats), ("q", _floats), ("p", _floats), ("beta", _floats),
        ("batch_size", pa.int32()),  # rows in the step's target pass (verify_s is that whole pass)
    ]),
    "teacher_forced": pa.schema([
        ("prompt_id", pa.string()), ("category", pa.string()), ("prompt_len", pa.int32()), ("drafter", pa.string()),
        ("position", pa.int32()),  # index of the generated token predicted here (0 = the prefill's token)
        ("target_token", pa.int32()), ("draft_token", pa.int32()),  # -1: the drafter proposes nothing here
        ("match", pa.bool_()), ("top1", pa.float32()), ("entropy", pa.float32()), ("margin", pa.float32()),
        ("p_target", pa.float32()), ("q_target", pa.float32()), ("beta", pa.float32()),
        ("run_len", pa.int32()),  # consecutive accepted tokens when drafting from here (capped at k_max)
        ("proposal_len", pa.int32()),  # tokens the drafter can propose from here (n-gram: the copied span)
        # True: a block from here is one proposal (n-gram), whose tokens all carry this row's confidence; False: each
        # drafted token has its own (model drafters: this row's confidence is the token predicted here)
        ("proposal", pa.bool_()),
        # a one proposal whose tokens have confidences of their own (the suffix drafter's frequency estimates): each
        # proposed token's (top-1, entropy, margin), up to proposal_len; null: every token carries this row's
        ("proposal_confidence", pa.list_(pa.list_(pa.float32()))),
    ]),
}


class TraceError(ValueError):
    pass


def write_shard(rows: list[dict], kind: str, out_dir: str | Path, name: str) -> Path:
    """Write one shard atomically (temporary file, then rename): a shard on disk is always complete."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.parquet"
    tmp = out_dir / f".{name}.parquet.tmp{os.getpid()}"
    table = pa.Table.from_pylist(rows, schema=SCHEMAS[kind])
    pq.write_table(table, tmp)
    os.replace(tmp, path)
    return path


def write_meta(out_dir: str | Path, meta: dict) -> None:
    write_json(Path(out_dir) / META_FILE, {"schema_version": SCHEMA_VERSION, **meta})


def read_meta(trace_dir: str | Path) -> dict:
    path = Path(trace_dir) / META_FILE
    if not path.is_file():
        raise TraceError(f"{trace_dir} has no {META_FILE}: not a trace directory (collect traces into it first)")
    meta = json.loads(path.read_text())
    if meta.get("schema_version") != SCHEMA_VERSION:
        raise TraceError(
            f"{trace_dir} holds traces of schema version {meta.get('schema_version')}, this sacpolicy reads version "
            f"{SCHEMA_VERSION}; collect the traces again with this version"
        )
    return meta


def trace_temperature(meta: dict) -> float:
    """The sampling temperature the traces' target tokens were decoded with (0: greedy), from ``meta["sampling"]``.

    Every collection of this schema records ``sampling``. A teacher-forced meta without it (written by hand or by other
    tools) counts as greedy: ``collect_teacher_forced`` decodes greedily unless given a sampling config. A live meta
    without it cannot be told apart (live decoding samples whenever its decoder does) and raises ``TraceError``."""
    if "sampling" in meta:
        return float(meta["sampling"].get("temperature", 0.0))
    if meta.get("kind") == "teacher_forced":
        return 0.0
    raise TraceError(f"trace meta of kind {meta.get('kind')!r} does not record its sampling settings; collect the "
                     "traces again with this sacpolicy version")


def trace_sampling(meta: dict) -> dict:
    """{"temperature", "top_p"} the traces' target tokens were decoded with (``trace_temperature``; top_p 1: off)."""
    return {"temperature": trace_temperature(meta), "top_p": float(meta.get("sampling", {}).get("top_p", 1.0))}


def load_traces(trace_dir: str | Path, *, kind: str | None = None, target: str | None = None,
                skip_corrupt: bool = False):
    """All shards of a trace directory as a ``datasets.Dataset`` (via ``load_dataset("parquet", ...)``).

    Checks the schema version and, when ``target`` is given, that the traces come from that target. A truncated or
    corrupt shard raises with its path, or is skipped with a warning when ``skip_corrupt``.
    """
    import datasets

    meta = read_meta(trace_dir)
    kind = kind or meta.get("kind")
    if kind not in KINDS or meta.get("kind") != kind:
        raise TraceError(f"{trace_dir} holds {meta.get('kind')!r} traces, not {kind!r}")
    if target is not None and meta.get("target") != target:
        raise TraceError(
            f"{trace_dir} was collected with target {meta.get('target')!r}, but the configured target is {target!r}; "
            "collect traces for this target or point to the matching directory"
        )
    files = []
    for path in sorted(Path(trace_dir).glob("*.parquet")):
        try:
            _ = pq.ParquetFile(path).schema_arrow  # reads the footer: fails on a truncated file
            files.append(str(path))
        except Exception as exc:  # pyarrow raises several types for damaged files
            if not skip_corrupt:
                raise TraceError(f"corrupt trace shard {path}: {exc}; delete it and resume the collection, or load "
                                 "with skip_corrupt=True") from exc
            logger.warning("skipping corrupt trace shard %s: %s", path, exc)
    if not files:
        raise TraceError(f"{trace_dir} holds no trace shards; run the collection first")
    return datasets.load_dataset("parquet", data_files=files, split="train",
                                 features=datasets.Features.from_arrow_schema(SCHEMAS[kind]))
