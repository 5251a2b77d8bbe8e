"""The check of a weights file a user handed us (a downloaded model, a head, a draft's vocabulary map): safetensors'
own error for a truncated or damaged file ("incomplete metadata, file not fully covered") names neither the file nor
the fix, so readers call ``read_safetensors`` (or ``safetensors_damage`` after a loader failed), which read the
header alone, as safetensors lays it out, and say which file is truncated or corrupt and how to mend it. Standard
library only: every layer above may use it.
"""

from __future__ import annotations

import json
from pathlib import Path

SAFETENSORS_FIX = ("Fix: download or copy it again from where it came (its hub repository, the directory it was copied "
                   "from) and check that its size matches the source's")
_MAX_HEADER = 100_000_000  # safetensors refuses longer headers: a larger length field is no header's


def safetensors_damage(path: str | Path) -> str | None:
    """Why the safetensors file at ``path`` cannot be read, as a sentence naming the file, the damage (truncated or
    corrupt) and the fix; None when its header is whole and its tensors fill the rest of the file exactly (what
    safetensors checks before it reads a tensor)."""
    problem = _safetensors_problem(Path(path))
    return None if problem is None else f"{path} {problem}. {SAFETENSORS_FIX}"


def _safetensors_problem(path: Path) -> str | None:
    """The header alone, read as safetensors lays it out: 8 bytes of length, then that much JSON whose tensors'
    ``data_offsets`` end where the file does."""
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            n = int.from_bytes(f.read(8), "little")
            raw = f.read(n) if size >= 8 and n <= min(size - 8, _MAX_HEADER) else b""
    except OSError as e:
        return f"cannot be read ({e})"
    if size < 8:
        return f"is truncated: it holds {size} bytes, fewer than a safetensors header's 8-byte length"
    if n > _MAX_HEADER:
        return (f"is corrupt: its first 8 bytes give a header of {n} bytes, which no safetensors file has (is it a "
                "safetensors file, or a Git LFS pointer?)")
    if n > size - 8:
        return f"is truncated: its header is {n} bytes long, but the file holds {size - 8} after the length"
    try:
        header = json.loads(raw)
        ends = [int(t["data_offsets"][1]) for name, t in header.items() if name != "__metadata__"]
    except (ValueError, TypeError, KeyError, IndexError, AttributeError) as e:
        return f"is corrupt: its header is not safetensors' JSON ({type(e).__name__}: {e})"
    need, have = max(ends, default=0), size - 8 - n
    if have < need:
        return (f"is truncated: its tensors take {need} bytes after the header, but the file holds {have} "
                f"({have / need:.0%}): the download or copy was cut short")
    if have > need:
        return f"is corrupt: it holds {have - need} bytes past its last tensor"
    return None


def read_safetensors(path: str | Path, load, error: type[Exception] = ValueError):
    """``load(str(path))`` (safetensors' ``load_file`` of any framework) for a file a user handed us; when it fails on
    a truncated or corrupt file, ``error`` with ``safetensors_damage``'s sentence (the file, the damage, the fix)
    instead of safetensors' own "incomplete metadata, file not fully covered"."""
    try:
        return load(str(path))
    except Exception as e:
        damage = safetensors_damage(path)
        if damage is None:
            raise
        raise error(damage) from e
