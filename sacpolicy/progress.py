"""Progress of long loops, for a person at a terminal and for a log read later.

    for chunk in progress_iter(chunks, "teacher-forced traces", unit="chunk"):
        ...

On a terminal, a tqdm bar with its ETA. In every case (a terminal, a Hydra ``train.log``, a CI log), one log line a
minute with the count, the elapsed time and the ETA (from a heartbeat thread, so an item that takes minutes still gets
its lines), and one line when the loop finishes:

    teacher-forced traces: 12/40 chunks (30%), 3m12s elapsed, ETA 7m28s
    teacher-forced traces: 40 chunks in 10m40s

Lightning training loops get the same lines from ``sacpolicy.training.common.MinuteLog``.
"""

from __future__ import annotations

import logging
import threading
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


def plural(unit: str) -> str:
    """batch -> batches, policy -> policies, chunk -> chunks."""
    if unit.endswith(("s", "x", "ch", "sh")):
        return unit + "es"
    return unit[:-1] + "ies" if unit.endswith("y") and unit[-2:-1] not in "aeiou" else unit + "s"


def status_line(desc: str, done: int, total: int | None, elapsed: float, unit: str = "it") -> str:
    """``desc: done/total units (pct%), elapsed, ETA`` (the ETA at the mean rate so far); without a total, the count
    and the rate."""
    if total:
        eta_s = duration(elapsed / done * (total - done)) if done else "unknown"
        return (f"{desc}: {done}/{total} {plural(unit)} ({100 * done / total:.0f}%), {duration(elapsed)} elapsed, "
                f"ETA {eta_s}")
    return f"{desc}: {done} {plural(unit)}, {duration(elapsed)} elapsed ({done / max(elapsed, 1e-9):.2f} {unit}/s)"


def progress_iter(iterable: Iterable[T], desc: str, *, total: int | None = None, unit: str = "it", enabled: bool = True,
                  every_s: float = LOG_EVERY_S) -> Iterator[T]:
    """Yield from ``iterable``, with a bar on a terminal (tqdm, only where stderr is a terminal, so logs written to a
    file hold no carriage-return debris), a log line every ``every_s`` seconds from a heartbeat thread (so a slow item
    still gets its lines) and one at the end. ``enabled=False``: neither (tests)."""
    if total is None and hasattr(iterable, "__len__"):
        total = len(iterable)  # type: ignore[arg-type]
    if not enabled:
        yield from iterable
        return
    from tqdm.auto import tqdm

    bar = tqdm(iterable, desc=desc, total=total, unit=unit, disable=None)  # None: a bar only on a terminal
    start, done, stop = time.monotonic(), [0], threading.Event()

    def heartbeat() -> None:
        while not stop.wait(every_s):
            logger.info(status_line(desc, done[0], total, time.monotonic() - start, unit))

    beat = threading.Thread(target=heartbeat, name=f"progress: {desc}", daemon=True)
    beat.start()
    try:
        for item in bar:
            yield item
            done[0] += 1
    finally:
        stop.set()
        beat.join()
        bar.close()
    logger.info("%s: %d %s in %s", desc, done[0], plural(unit), duration(time.monotonic() - start))
