"""Progress of long loops, for a person at a terminal and for a log read later.

    for chunk in progress_iter(chunks, "teacher-forced traces", unit="chunk"):
        ...

On a terminal, a tqdm bar with its ETA. In every case (a terminal, a Hydra ``train.log``, a CI log), one log line per
minute with the count, the elapsed time and the ETA, and one line when the loop finishes:

    teacher-forced traces: 12/40 chunks (30%), 3m12s elapsed, ETA 7m28s
    teacher-forced traces: 40 chunks in 10m40s

Lightning training loops get the same lines from ``sacpolicy.training.common.MinuteLog``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Iterator
from typing import TypeVar

__all__ = ["LOG_EVERY_S", "duration", "progress_iter", "status_line"]

logger = logging.getLogger("sacpolicy.progress")
LOG_EVERY_S = 60.0
T = TypeVar("T")


def duration(seconds: float) -> str:
    """1h02m, 3m12s, 45s."""
    s = round(max(seconds, 0.0))
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


def status_line(desc: str, done: int, total: int | None, elapsed: float, unit: str = "it") -> str:
    """``desc: done/total units (pct%), elapsed, ETA`` (the ETA at the mean rate so far); without a total, the count
    and the rate."""
    if total:
        eta = elapsed / done * (total - done) if done else float("nan")
        eta_s = duration(eta) if done else "unknown"
        return (f"{desc}: {done}/{total} {unit}s ({100 * done / total:.0f}%), {duration(elapsed)} elapsed, "
                f"ETA {eta_s}")
    return f"{desc}: {done} {unit}s, {duration(elapsed)} elapsed ({done / max(elapsed, 1e-9):.2f} {unit}/s)"


def progress_iter(iterable: Iterable[T], desc: str, *, total: int | None = None, unit: str = "it", enabled: bool = True,
             every_s: float = LOG_EVERY_S) -> Iterator[T]:
    """Yield from ``iterable``, with a bar on a terminal (tqdm, only where stderr is a terminal, so logs written to a
    file hold no carriage-return debris) and a log line every ``every_s`` seconds and at the end. ``enabled=False``:
    neither (tests)."""
    if total is None and hasattr(iterable, "__len__"):
        total = len(iterable)  # type: ignore[arg-type]
    if not enabled:
        yield from iterable
        return
    from tqdm.auto import tqdm

    bar = tqdm(iterable, desc=desc, total=total, unit=unit, disable=None)  # None: a bar only on a terminal
    start = last = time.monotonic()
    done = 0
    try:
        for item in bar:
            yield item
            done += 1
            now = time.monotonic()
            if now - last >= every_s:
                last = now
                logger.info(status_line(desc, done, total, now - start, unit))
    finally:
        bar.close()
    logger.info("%s: %d %ss in %s", desc, done, unit, duration(time.monotonic() - start))
