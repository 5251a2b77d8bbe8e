"""The step log's writer (``sacpolicy.export.steplog``): a daemon thread that turns one server run's queued engine
steps into Parquet shards of ``traces.logformat.STEP_SCHEMA``, so the engine thread only ever queues.

The engine thread hands each step's rows to a bounded ``queue.Queue`` (``put``, ``put_nowait``): when the queue is
full the step's records are dropped and counted (``dropped``), never waited for. The thread wakes every ``DRAIN_S`` to
take what is queued, not at every step (a wake per engine step would put a thread on the CPU between every two
steps), builds the records there (feature rows included, off the engine) and writes a shard atomically (a temporary
file, then a rename) every ``flush_s`` seconds, every ``shard_rows`` rows, and on ``close``. Nothing a record or a
shard does stops it: a record that cannot be built or does not fit the schema is left out and counted
(``bad_records``), a shard that cannot be written too (``write_failures``), each kind logged once with its traceback;
later steps are written. The counts are in every shard's metadata, and ``close`` never waits on a thread that is gone.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import NamedTuple

from sacpolicy.runtime.features import feature_row
from sacpolicy.traces.logformat import META_KEY, SHARD_PREFIX, STEP_SCHEMA

logger = logging.getLogger(__name__)

SHARD_ROWS, FLUSH_S = 50_000, 30.0  # rows per shard at most; seconds between shards while records arrive
DRAIN_S = 0.5  # the writer takes the queued steps this often (a wake per engine step would cost the engine more)
_STOP = object()


class _Lost(NamedTuple):
    """Records the engine thread could not queue (its bookkeeping failed on a step): the writer counts them."""

    n: int
    what: str
    exc: BaseException


class ShardWriter:
    """The writer of one server run's shards in ``out_dir`` (see the module docstring); ``meta``: every shard's
    metadata (its ``run_id`` names the shards), to which the writer adds its counts."""

    def __init__(self, out_dir: Path, meta: dict, *, queue_size: int, shard_rows: int = SHARD_ROWS,
                 flush_s: float = FLUSH_S):
        self.out_dir, self.meta, self.shard_rows, self.flush_s = Path(out_dir), meta, shard_rows, flush_s
        self.queue: queue.Queue = queue.Queue(maxsize=queue_size)
        self.dropped = self.written = self.shards = self.write_failures = 0
        self.bad_records = 0  # records that could not be built or did not fit STEP_SCHEMA: left out, counted
        self.cpu_s = 0.0  # the writer thread's CPU seconds (records, Parquet, files)
        self._told: set[str] = set()  # the failures already logged (each kind once)
        self._closed = False
        self.drain_s = min(DRAIN_S, flush_s)
        self._wake = threading.Event()  # set by close: drain now
        self.thread = threading.Thread(target=self._run, name="sacpolicy-steplog", daemon=True)
        self.thread.start()

    # ------------------------------------------------------------------ the engine thread
    def put(self, step) -> None:
        """Queue one engine step ``(unix_s, seconds, batch size, rows)``; never blocks (a full queue drops its rows,
        counted in ``dropped``)."""
        try:
            self.queue.put_nowait(step)
        except queue.Full:
            self.dropped += len(step[3])

    def lost(self, n: int, what: str, exc: BaseException) -> None:
        """``n`` records the engine thread could not build (``exc``): counted in ``bad_records`` by the writer thread,
        which alone counts them."""
        try:
            self.queue.put_nowait(_Lost(n, what, exc))
        except queue.Full:
            self.dropped += n

    def counts(self) -> dict:
        """Records written, dropped (a full queue) and bad, and shards written and failed (their rows lost)."""
        return {"written": self.written, "dropped": self.dropped, "bad_records": self.bad_records,
                "shards": self.shards, "write_failures": self.write_failures}

    # ------------------------------------------------------------------ the writer thread
    def _run(self) -> None:
        """Every ``drain_s`` (or at once on ``close``): take every queued step and turn its records into one Arrow
        batch at once (Python objects kept for a shard's whole interval would grow the heap the garbage collector
        walks), write a shard when one is due. Waking per engine step instead would put a thread on the CPU between
        every two steps. Nothing a record or a shard does stops it: a bad record is left out and counted
        (``bad_records``), a shard that cannot be written too (``write_failures``), and later steps are written."""
        batches, rows, last, stop = [], 0, time.monotonic(), False
        while not stop:
            self._wake.wait(self.drain_s)
            self._wake.clear()  # close sets it after queueing _STOP, so this drain or the next one sees it
            cpu = time.thread_time()
            try:
                stop, batch = self._drain()
                if batch is not None:
                    batches.append(batch)
                    rows += batch.num_rows
                if batches and (stop or rows >= self.shard_rows or time.monotonic() - last >= self.flush_s):
                    self._write(batches, rows)
                    batches, rows, last = [], 0, time.monotonic()
                elif not batches:
                    last = time.monotonic()
            except Exception as exc:  # a bug of ours: what this round held is lost, the writer goes on
                self._failed("a round of the writer", exc)
                batches, rows, stop = [], 0, stop or self._closed  # it may have taken _STOP with it
            self.cpu_s += time.thread_time() - cpu

    def _drain(self) -> tuple[bool, object]:
        """(whether ``close`` asked to stop, the records of every queued step as one Arrow batch or None)."""
        drained, stop = [], False
        while True:
            try:
                item = self.queue.get_nowait()
            except queue.Empty:
                break
            if item is _STOP:
                stop = True
                break
            if isinstance(item, _Lost):
                self._bad(item.n, item.what, item.exc)
                continue
            records, errors = _records(item)
            drained += records
            if errors:
                self._bad(len(errors), "records", errors[0])
        return stop, self._arrow(drained) if drained else None

    def _arrow(self, records: list[dict]):
        """The records as one Arrow batch of ``STEP_SCHEMA``; a record that does not fit it is left out (counted in
        ``bad_records``), the others kept. None when none fits."""
        import pyarrow as pa

        try:
            return pa.RecordBatch.from_pylist(records, schema=STEP_SCHEMA)
        except Exception as exc:  # find the bad ones: one at a time, only on this rare path
            good = [r for r in records if _fits(r)]
            self._bad(len(records) - len(good), "records that do not fit the step log's schema", exc)
            return pa.RecordBatch.from_pylist(good, schema=STEP_SCHEMA) if good else None

    def _write(self, batches: list, rows: int) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        from sacpolicy.io import write_bytes

        stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S")
        path = self.out_dir / f"{SHARD_PREFIX}{stamp}-{self.meta['run_id']}-{self.shards:05d}.parquet"
        try:
            meta = {**self.meta, "dropped": self.dropped, "write_failures": self.write_failures,
                    "bad_records": self.bad_records}
            table = pa.Table.from_batches(batches, schema=STEP_SCHEMA).replace_schema_metadata(
                {META_KEY: json.dumps(meta)})
            sink = pa.BufferOutputStream()
            pq.write_table(table, sink)
            write_bytes(path, sink.getvalue().to_pybytes())
            self.shards, self.written = self.shards + 1, self.written + rows
        except Exception as exc:  # a full disk must not stop the writer; the rows are lost and counted
            self._failed(str(path), exc)

    def _failed(self, what: str, exc: BaseException) -> None:
        self._tell("write", exc, "the proposer's step log could not write %s; its rows are dropped (counted as "
                   "write_failures in its shards and stats)", what)
        self.write_failures += 1

    def _bad(self, n: int, what: str, exc: BaseException) -> None:
        """``n`` records that could not be built or stored: left out, counted (``bad_records``), logged once."""
        self._tell("bad", exc, "the proposer's step log left out %d %s it could not build or store (counted as "
                   "bad_records in its shards and stats; their requests are incomplete); later steps are logged",
                   n, what)
        self.bad_records += n

    def _tell(self, kind: str, exc: BaseException, msg: str, *args) -> None:
        """Log a failure with ``exc``'s traceback the first time one of its ``kind`` happens (a bad record tends to
        repeat every step: one message, the counts say the rest)."""
        if kind not in self._told:
            self._told.add(kind)
            logger.error(msg, *args, exc_info=exc)

    def close(self, timeout: float = 30.0) -> None:
        """Write what is queued and stop the writer (idempotent; also run at interpreter exit). Waits at most
        ``timeout`` seconds for a busy writer, and not at all for one that is not running."""
        if self._closed:
            return
        self._closed = True
        deadline = time.monotonic() + timeout
        while True:
            if not self.thread.is_alive():
                logger.error("the step log's writer thread is not running; the %d engine steps queued for %s are "
                             "lost", self.queue.qsize(), self.out_dir)
                return
            try:
                self.queue.put(_STOP, timeout=0.05)
                break
            except queue.Full:  # the writer drains it: hurry it on
                self._wake.set()
                if time.monotonic() >= deadline:
                    logger.warning("the step log's writer did not drain its queue in %.0f s; %s is left incomplete",
                                   timeout, self.out_dir)
                    return
        self._wake.set()
        self.thread.join(max(0.0, deadline - time.monotonic()))
        if self.thread.is_alive():
            logger.warning("the step log's writer did not finish its last shard in %.0f s; %s may lack it", timeout,
                           self.out_dir)
        if self.dropped:
            logger.warning("the step log dropped %d records (its queue was full); their requests are incomplete",
                           self.dropped)


def _records(item) -> tuple[list[dict], list[Exception]]:
    """One engine step's queued rows as ``STEP_SCHEMA`` records (the feature rows are built here, off the engine), and
    what failed for each row that could not be built (left out)."""
    unix_s, seconds, batch, rows = item
    out, errors = [], []
    for row in rows:
        try:
            out.append(_record(row, unix_s, seconds, batch))
        except Exception as exc:  # a bad row loses itself, not its step
            errors.append(exc)
    return out, errors


def _record(row, unix_s: float, seconds: float, batch: int) -> dict:
    """One queued row (``StepLogger._step``'s tuple) as a ``STEP_SCHEMA`` record."""
    rid, step, prompt_len, ctx, new, prev_drafted, prev_accepted, unseen, k, drafted, rowctx, n, policy, sampling, \
        drafter, guard = row
    return {"request": rid, "step": step, "unix_s": unix_s, "policy": policy, "prompt_len": prompt_len,
            "context_len": n, "context": None if ctx is None else ctx.tolist(),
            "committed": None if new is None else new.tolist(), "prev_drafted": prev_drafted,
            "prev_accepted": prev_accepted, "unseen": unseen, "k": k, "drafted": drafted,
            "features": feature_row(rowctx, 0), "batch_size": batch, "proposer_s": seconds, **_sampling(sampling),
            "drafter": drafter, "guard": guard}


def _fits(record: dict) -> bool:
    import pyarrow as pa

    try:
        pa.RecordBatch.from_pylist([record], schema=STEP_SCHEMA)
        return True
    except Exception:  # pyarrow raises several types for a value of the wrong type or range
        return False


def _sampling(sampling) -> dict:
    """A first step's sampling columns ((temperature, top_p, top_k) or None: unknown, or not a first step)."""
    if sampling is None:
        return {"temperature": None, "top_p": None, "top_k": None}
    temperature, top_p, top_k = sampling
    return {"temperature": round(float(temperature), 6), "top_p": round(float(top_p), 6), "top_k": int(top_k)}
