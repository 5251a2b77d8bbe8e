"""Sharded collection's bookkeeping: each shard's manifest and the merge that checks every shard is there.

A shard ``i/n`` (``collect_teacher_forced(shard=...)``: one process, rank or machine of n) that has written all its
chunks leaves ``shards/s<i>of<n>.json``: which shard, its prompt ids, and per chunk file its row count and SHA-256.
``merge_shards`` reads the n manifests and writes ``manifest.json`` (the traces are complete) only when every shard
is there, its files have the rows and bytes its manifest says, and no prompt is in two shards; a missing shard is
refused by name, with the command that collects it.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from sacpolicy.io import write_json
from sacpolicy.traces.schema import TraceError

SHARDS_DIR = "shards"
MANIFEST = "manifest.json"


def shard_manifest_path(out_dir, i: int, n: int) -> Path:
    return Path(out_dir) / SHARDS_DIR / f"s{i:03d}of{n:03d}.json"


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _rows(path: Path) -> int:
    import pyarrow.parquet as pq

    return pq.ParquetFile(path).metadata.num_rows


def write_shard_manifest(out_dir, i: int, n: int, prompt_ids: list[str], chunks: list[str]) -> Path:
    """The manifest of shard ``i/n``, whose chunk files (``<name>.parquet``) are all written."""
    out_dir = Path(out_dir)
    files = {name: {"rows": _rows(out_dir / f"{name}.parquet"), "sha256": file_sha256(out_dir / f"{name}.parquet")}
             for name in chunks}
    return write_json(shard_manifest_path(out_dir, i, n), {
        "shard": f"{i}/{n}", "index": i, "count": n, "prompt_ids": list(prompt_ids),
        "rows": sum(f["rows"] for f in files.values()), "chunks": files})


def missing_shards(out_dir, n: int) -> list[int]:
    return [i for i in range(n) if not shard_manifest_path(out_dir, i, n).is_file()]


def merge_shards(out_dir, n: int | None = None) -> dict:
    """Check the shards of ``out_dir`` and write its ``manifest.json``; returns it. ``n``: the shard count (default:
    the manifests' own). Raises ``TraceError`` naming a missing shard, a chunk whose rows or checksum differ from its
    manifest, or a prompt collected by two shards."""
    out_dir = Path(out_dir)
    found = sorted((out_dir / SHARDS_DIR).glob("s*of*.json"))
    if not found:
        raise TraceError(f"{out_dir} has no shard manifests ({SHARDS_DIR}/s<i>of<n>.json): collect its traces first")
    manifests = [json.loads(p.read_text()) for p in found]
    counts = {m["count"] for m in manifests} if n is None else {n}
    if len(counts) > 1:
        raise TraceError(f"{out_dir} holds manifests of collections split {sorted(counts)} ways; keep one split "
                         "(delete the other shards' chunks and manifests) or collect into a new directory")
    n = counts.pop()
    missing = missing_shards(out_dir, n)
    if missing:
        names = ", ".join(f"{i}/{n} ({shard_manifest_path(out_dir, i, n).name})" for i in missing)
        raise TraceError(f"{out_dir} misses shard(s) {names} of {n}: collect each (stage collect with "
                         f"collect.shard=<i>/{n} in the same run directory), then merge again")
    by_id: dict[str, str] = {}
    total, digest = 0, hashlib.sha256()
    for i in range(n):
        m = json.loads(shard_manifest_path(out_dir, i, n).read_text())
        for name, want in sorted(m["chunks"].items()):
            path = out_dir / f"{name}.parquet"
            if not path.is_file():
                raise TraceError(f"shard {i}/{n} lists {path.name}, which is missing; delete {SHARDS_DIR}/"
                                 f"{shard_manifest_path(out_dir, i, n).name} and collect shard {i}/{n} again")
            sha = file_sha256(path)
            if sha != want["sha256"] or _rows(path) != want["rows"]:
                raise TraceError(f"{path.name} of shard {i}/{n} is not the file its manifest describes (rows or "
                                 "SHA-256 differ); delete it and its shard manifest and collect that shard again")
            digest.update(sha.encode())
            total += want["rows"]
        for pid in m["prompt_ids"]:
            if pid in by_id:
                raise TraceError(f"prompt {pid!r} was collected by shard {by_id[pid]} and shard {i}/{n}; the shards "
                                 "were split over different prompt lists: collect into a new directory")
            by_id[pid] = f"{i}/{n}"
    merged = {"shards": n, "rows": total, "prompts": len(by_id), "sha256": digest.hexdigest()}
    write_json(out_dir / MANIFEST, merged)
    return merged
