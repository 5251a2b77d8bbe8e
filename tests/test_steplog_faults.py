"""The step log under faults (issue 64): a record the writer cannot build or store is left out and counted while later
steps are written, and ``close`` never waits on a writer that is gone.

Fast: the fake engine of test_production drives the real proposer; bad records are queued beside its steps exactly
as the engine thread queues a step.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import pytest
from test_production import logged_requests, proposer, workload

from sacpolicy.export import steplog
from sacpolicy.runtime.features import RowContext


def bad_row(log, why: str) -> tuple:
    """A queued row (as ``StepLogger._step`` queues one) that cannot become a record (``why="build"``: the feature
    row cannot be built) or does not fit ``STEP_SCHEMA`` (``why="schema"``: a policy id that is no string)."""
    ctx, policy = (None, "p") if why == "build" else (RowContext(4, 0), 123)
    return (f"{log.run_id}-bad", 0, 3, np.arange(4), None, -1, -1, 0, 2, 2, ctx, 4, policy, None, None)


@pytest.mark.parametrize("why", ["build", "schema"])
def test_a_bad_record_is_counted_and_the_writer_keeps_writing_the_steps_around_it(tmp_path, monkeypatch, caplog, why):
    """One drain holds the bad record and every good step (the writer wakes only at close): the good ones are all in
    the shards, the bad one is counted in the logger's cost and the shards' metadata and logged once."""
    monkeypatch.setattr(steplog, "DRAIN_S", 3600.0)
    prop = proposer(tmp_path, monkeypatch)
    log = prop.steplog
    engine = workload(n=6, seed=4)
    engine.run(prop, on_step=lambda t: t == 3 and log.queue.put_nowait((time.time(), 0.01, 1, [bad_row(log, why)])))
    log.close()
    reqs, incomplete, meta = logged_requests(tmp_path)
    assert incomplete == 0 and len(reqs) == len(engine.prompts)
    assert sorted(r["tokens"] for r in reqs.values()) == sorted(engine.seqs.values())
    assert log.cost()["bad_records"] == 1 and meta["bad_records"] == 1 and log.cost()["write_failures"] == 0
    assert log.cost()["written"] == sum(len(r["steps"]) for r in reqs.values())
    told = [r for r in caplog.records if "bad_records" in r.getMessage()]
    assert len(told) == 1 and told[0].levelno == logging.ERROR and told[0].exc_info


def test_bad_records_in_every_drain_are_logged_once_and_later_steps_are_still_written(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(steplog, "DRAIN_S", 0.001)  # a drain per engine step or so: bad records in many of them
    prop = proposer(tmp_path, monkeypatch)
    log = prop.steplog
    engine, queued = workload(n=6, seed=7), []

    def on_step(t):  # a bad record after each of the first 30 engine steps (then the engine idles to step 10000)
        if t <= 30:
            log.queue.put_nowait((time.time(), 0.01, 1, [bad_row(log, "build")]))
            queued.append(t)
            time.sleep(0.002)  # the writer takes some of them in drains of their own

    engine.run(prop, on_step=on_step)
    log.close()
    reqs, incomplete, meta = logged_requests(tmp_path)
    assert incomplete == 0 and len(reqs) == len(engine.prompts)
    assert log.bad_records == meta["bad_records"] == len(queued) > 10
    assert sum("bad_records" in r.getMessage() for r in caplog.records) == 1


def test_an_engine_step_the_log_cannot_read_never_reaches_the_engine(tmp_path, monkeypatch):
    """A row the engine thread's bookkeeping cannot read (here: no state for the feature row) loses that step's
    records, counted; ``step`` returns and the next steps are logged."""
    prop = proposer(tmp_path, monkeypatch)
    log = prop.steplog
    log.step([(np.arange(5), 1, object(), 2, [1, 2], "p", None, "ngram")], 1, 0.01, "ngram")  # raises inside
    assert log.bad_records == 1
    engine = workload(n=4, seed=2)
    engine.run(prop)
    log.close()
    reqs, incomplete, _ = logged_requests(tmp_path)
    assert incomplete == 0 and len(reqs) == len(engine.prompts)


def test_close_returns_at_once_when_the_writer_is_gone_or_idle(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(steplog.StepLogger, "_run", lambda self: None)  # a writer that ended ...
    gone = steplog.StepLogger(tmp_path / "gone", {}, bytes, queue_size=2)
    gone.thread.join(5)
    for _ in range(2):  # ... and left a full queue: a put would wait its whole timeout
        gone.queue.put_nowait((time.time(), 0.0, 1, []))
    t0 = time.perf_counter()
    gone.close()
    assert time.perf_counter() - t0 < 0.5
    assert "writer thread is not running; the 2 engine steps queued" in caplog.text
    monkeypatch.undo()
    idle = steplog.StepLogger(tmp_path / "idle", {}, bytes, flush_s=3600.0)
    t0 = time.perf_counter()
    idle.close()
    assert time.perf_counter() - t0 < 0.5 and not idle.thread.is_alive()


def test_a_shard_that_cannot_be_written_is_counted_and_later_shards_are_written(tmp_path, monkeypatch):
    import sacpolicy.io

    real, calls = sacpolicy.io.write_bytes, []

    def first_fails(path, data):  # a full disk, once
        calls.append(path)
        if len(calls) == 1:
            raise OSError(28, "No space left on device")
        return real(path, data)

    monkeypatch.setattr(sacpolicy.io, "write_bytes", first_fails)
    monkeypatch.setattr(steplog, "DRAIN_S", 0.001)
    monkeypatch.setenv(steplog.FLUSH_ENV, "0.001")  # a shard per drain
    prop = proposer(tmp_path, monkeypatch)
    workload(n=6, seed=3).run(prop, on_step=lambda t: t < 40 and time.sleep(0.003))
    prop.steplog.close()
    _, _, meta = logged_requests(tmp_path)
    cost = prop.steplog.cost()
    assert cost["write_failures"] == 1 and cost["shards"] == len(calls) - 1 >= 2
    assert meta["write_failures"] == 1 and meta["shards"] == cost["shards"]
