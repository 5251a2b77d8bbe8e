"""Files: atomic writes, so a reader never sees half a file and an interrupted run never leaves one."""

from __future__ import annotations

import json
import os
from pathlib import Path


def write_bytes(path: str | Path, data: bytes) -> Path:
    """Write ``data`` to a temporary sibling, then rename it over ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def write_text(path: str | Path, text: str) -> Path:
    """Write ``text`` (UTF-8) atomically (``write_bytes``)."""
    return write_bytes(path, text.encode())


def write_json(path: str | Path, payload, **dump_kwargs) -> Path:
    """Write ``payload`` as JSON, atomically (``write_text``)."""
    return write_text(path, json.dumps(payload, indent=2, **({"default": str} | dump_kwargs)))


def write_dir(path: str | Path, fill) -> Path:
    """Build a directory with ``fill(tmp)`` in a temporary sibling, then put it in place of ``path`` (a reader sees
    the old directory or the new one; an interrupted write leaves at most the temporary sibling, removed by the next
    write)."""
    import shutil

    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        fill(tmp)
        if path.exists():
            shutil.rmtree(path)
        os.replace(tmp, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path
