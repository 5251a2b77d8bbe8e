"""The decoder's serving loop: continuous batching over arriving requests.

``schedule`` admits the requests that have arrived while rows are free (those admitted together prefill in joint
passes, ``prefill_groups``), steps the batch, and retires finished rows at once, so the next waiting request takes
the free row. What a step does is the decoder's (``SpeculativeDecoder.step``); when requests arrive, how they are
grouped and what the clock says is this module's. A replay drives the same loop on a virtual clock.
"""

from __future__ import annotations

from typing import Protocol

from sacpolicy.decoding.ragged import RaggedCache
from sacpolicy.decoding.rows import Clock, Row

__all__ = ["Engine", "prefill_groups", "schedule"]


class Engine(Protocol):
    """What the loop drives (the ``SpeculativeDecoder``): its clock, a joint prefill of joining rows (-> their
    cache), one step of the batch over its cache, and a finished row's result."""

    clock: Clock

    def now(self) -> float: ...

    def prefill(self, rows: list[Row]) -> RaggedCache: ...

    def step(self, batch: list[Row], cache: RaggedCache) -> list: ...

    def finish(self, row: Row) -> None: ...


def schedule(engine: Engine, rows: list[Row], max_batch: int, pad_slack: float) -> None:
    """Decode ``rows`` (each with its ``arrival``, seconds after the call) up to ``max_batch`` at a time: admit
    arrived requests while rows are free (those admitted together prefill in passes of at most ``pad_slack``
    padding, ``prefill_groups``), step the batch, retire finished rows."""
    waiting = sorted(rows, key=lambda r: r.arrival)[::-1]  # pop() takes the earliest
    batch: list[Row] = []
    cache: RaggedCache | None = None
    t0 = engine.now()
    while waiting or batch:
        # again after each prefill: requests that arrived during it join before the next step
        while joining := _admit(engine, waiting, max_batch - len(batch), t0):
            cache = _join(engine, prefill_groups(joining, pad_slack), batch, cache)
        if not batch:
            if waiting:
                engine.clock.sleep(max(0.0, waiting[-1].arrival - (engine.now() - t0)))
            continue
        engine.step(batch, cache)
        live = [i for i, row in enumerate(batch) if row.active]
        for row in batch:
            if not row.active:
                engine.finish(row)
        if len(live) < len(batch):
            batch = [batch[i] for i in live]
            if batch:
                cache.select(live)
            else:
                cache = None


def _admit(engine: Engine, waiting: list[Row], room: int, t0: float) -> list[Row]:
    """The waiting requests that have arrived, earliest first, as many as there are free rows (taken out of
    ``waiting``; each one's ``queued_s`` set)."""
    joining: list[Row] = []
    while waiting and len(joining) < room and waiting[-1].arrival <= engine.now() - t0:
        row = waiting.pop()
        row.queued_s = engine.now() - t0 - row.arrival
        joining.append(row)
    return joining


def prefill_groups(joining: list[Row], pad_slack: float) -> list[list[Row]]:
    """The joining requests in order, cut into groups that prefill in one pass: a request joins the current group
    while the group's padded tokens stay within ``pad_slack`` of its real ones (a pass over pads costs like real
    tokens)."""
    groups: list[list[Row]] = []
    for row in joining:
        group = groups[-1] if groups else None
        if group is not None:
            lengths = [r.n for r in group] + [row.n]
            if max(lengths) * len(lengths) <= (1 + pad_slack) * sum(lengths):
                group.append(row)
                continue
        groups.append([row])
    return groups


def _join(engine: Engine, groups: list[list[Row]], batch: list[Row], cache: RaggedCache | None) -> RaggedCache | None:
    """Prefill each group of joining requests in one pass; those still decoding join ``batch`` (in place, in order)
    and their rows the batch's cache, all groups in one copy; the others finish at once. -> the batch's cache."""
    caches = []
    for group in groups:
        new = engine.prefill(group)
        live = [i for i, row in enumerate(group) if row.active]
        for row in group:
            if not row.active:
                engine.finish(row)
        if live:
            new.select(live)
            batch.extend(group[i] for i in live)
            caches.append(new)
    if not caches:
        return cache
    if cache is None:
        cache, caches = caches[0], caches[1:]
    cache.join(*caches)
    return cache
