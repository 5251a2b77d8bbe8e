"""The step log under faults (issue 64): a record the writer cannot build or store is left out and counted while later
steps are written, and ``close`` never waits on a writer that is gone; a damaged shard (unreadable, or its metadata
not JSON or lacking what a reader needs) is refused with the file and the fix, or skipped and counted on request; a
tensor-parallel engine's log holds each request once (only its first proposer worker writes).

Fast: the fake engine of test_production drives the real proposer; bad records are queued beside its steps exactly
as the engine thread queues a step, and shards are damaged on disk after the log is written.
"""

from __future__ import annotations

import json
import logging
import time
from types import SimpleNamespace

import numpy as np
import pyarrow.parquet as pq
import pytest
from test_production import TARGET, logged_requests, proposer, vllm_config, workload

from sacpolicy.export import steplog, steplog_writer, vllm_adapter
from sacpolicy.runtime.features import RowContext
from sacpolicy.traces.logformat import META_KEY, StepLogError
from sacpolicy.traces.production import build_production_traces
from sacpolicy.traces.steplog_read import read_step_log


def bad_row(log, why: str) -> tuple:
    """A queued row (as ``StepLogger._step`` queues one) that cannot become a record (``why="build"``: the feature
    row cannot be built) or does not fit ``STEP_SCHEMA`` (``why="schema"``: a policy id that is no string)."""
    ctx, policy = (None, "p") if why == "build" else (RowContext(4, 0), 123)
    return (f"{log.run_id}-bad", 0, 3, np.arange(4), None, -1, -1, 0, 2, 2, ctx, 4, policy, None, None)


@pytest.mark.parametrize("why", ["build", "schema"])
def test_a_bad_record_is_counted_and_the_writer_keeps_writing_the_steps_around_it(tmp_path, monkeypatch, caplog, why):
    """One drain holds the bad record and every good step (the writer wakes only at close): the good ones are all in
    the shards, the bad one is counted in the logger's cost and the shards' metadata and logged once."""
    monkeypatch.setattr(steplog_writer, "DRAIN_S", 3600.0)
    prop = proposer(tmp_path, monkeypatch)
    log = prop.steplog
    engine = workload(n=6, seed=4)
    engine.run(prop, on_step=lambda t: t == 3 and log.writer.put((time.time(), 0.01, 1, [bad_row(log, why)])))
    log.close()
    reqs, incomplete, meta = logged_requests(tmp_path)
    assert incomplete == 0 and len(reqs) == len(engine.prompts)
    assert sorted(r["tokens"] for r in reqs.values()) == sorted(engine.seqs.values())
    assert log.cost()["bad_records"] == 1 and meta["bad_records"] == 1 and log.cost()["write_failures"] == 0
    assert log.cost()["written"] == sum(len(r["steps"]) for r in reqs.values())
    told = [r for r in caplog.records if "bad_records" in r.getMessage()]
    assert len(told) == 1 and told[0].levelno == logging.ERROR and told[0].exc_info


def test_bad_records_in_every_drain_are_logged_once_and_later_steps_are_still_written(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(steplog_writer, "DRAIN_S", 0.001)  # a drain per engine step or so: bad records in many of them
    prop = proposer(tmp_path, monkeypatch)
    log = prop.steplog
    engine, queued = workload(n=6, seed=7), []

    def on_step(t):  # a bad record after each of the first 30 engine steps (then the engine idles to step 10000)
        if t <= 30:
            log.writer.put((time.time(), 0.01, 1, [bad_row(log, "build")]))
            queued.append(t)
            time.sleep(0.002)  # the writer takes some of them in drains of their own

    engine.run(prop, on_step=on_step)
    log.close()
    reqs, incomplete, meta = logged_requests(tmp_path)
    assert incomplete == 0 and len(reqs) == len(engine.prompts)
    assert log.cost()["bad_records"] == meta["bad_records"] == len(queued) > 10
    assert sum("bad_records" in r.getMessage() for r in caplog.records) == 1


def test_an_engine_step_the_log_cannot_read_never_reaches_the_engine(tmp_path, monkeypatch):
    """A row the engine thread's bookkeeping cannot read (here: no state for the feature row) loses that step's
    records, counted; ``step`` returns and the next steps are logged."""
    prop = proposer(tmp_path, monkeypatch)
    log = prop.steplog
    memo = SimpleNamespace(log=None)  # a request's memory, where the log keeps its entry
    log.step([(np.arange(5), 1, object(), 2, [1, 2], "p", None, "ngram", memo, False)], 1, 0.01, "ngram")  # raises inside
    engine = workload(n=4, seed=2)
    engine.run(prop)
    log.close()
    reqs, incomplete, meta = logged_requests(tmp_path)
    assert incomplete == 0 and len(reqs) == len(engine.prompts)
    assert log.cost()["bad_records"] == meta["bad_records"] == 1  # counted by the writer, in the shards too


def test_close_returns_at_once_when_the_writer_is_gone_or_idle(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(steplog_writer.ShardWriter, "_run", lambda self: None)  # a writer that ended ...
    gone = steplog.StepLogger(tmp_path / "gone", {}, queue_size=2)
    gone.writer.thread.join(5)
    for _ in range(2):  # ... and left a full queue: a put would wait its whole timeout
        gone.writer.put((time.time(), 0.0, 1, []))
    t0 = time.perf_counter()
    gone.close()
    assert time.perf_counter() - t0 < 0.5
    assert "writer thread is not running; the 2 engine steps queued" in caplog.text
    monkeypatch.undo()
    idle = steplog.StepLogger(tmp_path / "idle", {}, flush_s=3600.0)
    t0 = time.perf_counter()
    idle.close()
    assert time.perf_counter() - t0 < 0.5 and not idle.writer.thread.is_alive()


def test_a_shard_that_cannot_be_written_is_counted_and_later_shards_are_written(tmp_path, monkeypatch):
    import sacpolicy.io

    real, calls = sacpolicy.io.write_bytes, []

    def first_fails(path, data):  # a full disk, once
        calls.append(path)
        if len(calls) == 1:
            raise OSError(28, "No space left on device")
        return real(path, data)

    monkeypatch.setattr(sacpolicy.io, "write_bytes", first_fails)
    monkeypatch.setattr(steplog_writer, "DRAIN_S", 0.001)
    monkeypatch.setenv(steplog.FLUSH_ENV, "0.001")  # a shard per drain
    prop = proposer(tmp_path, monkeypatch)
    workload(n=6, seed=3).run(prop, on_step=lambda t: t < 40 and time.sleep(0.003))
    prop.steplog.close()
    _, _, meta = logged_requests(tmp_path)
    cost = prop.steplog.cost()
    assert cost["write_failures"] == 1 and cost["shards"] == len(calls) - 1 >= 2
    assert meta["write_failures"] == 1 and meta["shards"] == cost["shards"]


# ---------------------------------------------------------------------- damaged shards
def two_runs(tmp_path, monkeypatch) -> tuple[list, dict]:
    """A log of two server runs (a shard each, 4 requests each): (its shards in name order, {shard: its requests' log
    ids})."""
    for seed in (1, 2):
        prop = proposer(tmp_path, monkeypatch)
        workload(n=4, seed=seed).run(prop)
        prop.steplog.close()
    shards = sorted((tmp_path / "log").glob("steps-*.parquet"))
    assert len(shards) == 2
    return shards, {s: set(pq.read_table(s, columns=["request"])["request"].to_pylist()) for s in shards}


def with_meta(shard, meta: bytes | None) -> None:
    """Rewrite ``shard`` with ``meta`` as its step-log metadata (None: none)."""
    table = pq.read_table(shard)
    pq.write_table(table.replace_schema_metadata(None if meta is None else {META_KEY: meta}), shard)


def edited(shard, **change) -> bytes:
    """The shard's metadata with ``change`` (a value None: the key removed)."""
    meta = json.loads(pq.read_schema(shard).metadata[META_KEY.encode()])
    meta.update(change)
    return json.dumps({k: v for k, v in meta.items() if v is not None}).encode()


@pytest.mark.parametrize("damage, message", [
    ("json", r"metadata \(sacpolicy.steplog\) is not valid JSON"),
    ("target", r"metadata \(sacpolicy.steplog\) lacks \['target'\]"),
    ("run_id", r"metadata \(sacpolicy.steplog\) lacks \['run_id'\]"),
    ("drafter", r"metadata \(sacpolicy.steplog\) lacks \['drafter'\]"),
    ("target_type", r"holds a target or drafter that is not a JSON object"),
    ("columns", r"lacks the step log's columns \['context'\]"),
], ids=["json", "target", "run_id", "drafter", "target_type", "columns"])
def test_damaged_shard_metadata_is_refused_naming_the_file_and_the_fix(tmp_path, monkeypatch, damage, message):
    shards, _ = two_runs(tmp_path, monkeypatch)
    bad = shards[1]
    if damage == "json":
        with_meta(bad, b'{"format": 1, "run_id": ')  # cut short
    elif damage == "target_type":
        with_meta(bad, edited(bad, target="toy:greedy-target"))
    elif damage == "columns":
        table = pq.read_table(bad)
        pq.write_table(table.drop_columns(["context"]), bad)
    else:
        with_meta(bad, edited(bad, **{damage: None}))
    with pytest.raises(StepLogError, match=f"{bad}.*{message}.*damaged.*Delete it or copy it again.*skip_corrupt"):
        read_step_log(tmp_path / "log")


def test_skip_corrupt_leaves_out_damaged_shards_with_a_warning_and_counts_them(tmp_path, monkeypatch, caplog):
    shards, ids = two_runs(tmp_path, monkeypatch)
    first, second = shards
    with_meta(first, b"not json")  # the first shard: the log's provenance comes from the next one
    records, meta = read_step_log(tmp_path / "log", target=TARGET, skip_corrupt=True)
    assert meta["corrupt_shards"] == 1 and meta["shards"] == 1
    assert {r["request"] for r in records} == ids[second]
    assert f"skipped a damaged step-log shard (skip_corrupt): {first}'s step-log metadata" in caplog.text
    # a shard cut short (unreadable) is skipped as well; then none is left: refused, naming the count
    second.write_bytes(second.read_bytes()[: second.stat().st_size // 2])
    with pytest.raises(StepLogError, match="none of its 2 step-log shards can be read"):
        read_step_log(tmp_path / "log", skip_corrupt=True)
    assert f"corrupt step-log shard {second}" in caplog.text


def test_skip_corrupt_is_threaded_through_building_traces_and_skips_damage_only(tmp_path, monkeypatch):
    shards, ids = two_runs(tmp_path, monkeypatch)
    first, second = shards
    second.write_bytes(second.read_bytes()[: second.stat().st_size // 2])
    with pytest.raises(StepLogError, match=f"corrupt step-log shard {second}.*skip_corrupt=True"):
        build_production_traces(tmp_path / "log", tmp_path / "t")
    meta = build_production_traces(tmp_path / "log", tmp_path / "t", skip_corrupt=True)
    assert meta["log"]["corrupt_shards"] == 1 and meta["log"]["shards"] == 1
    assert set(meta["log"]["prompts"]) == ids[first] and meta["log"]["requests"] == 4
    # a shard of another log format is not damage: refused even when skipping damaged shards
    pq.write_table(pq.read_table(first), second)
    with_meta(second, edited(first, format=2))
    with pytest.raises(StepLogError, match=f"{second} is not a step-log shard of format 1 \\(its format: 2"):
        read_step_log(tmp_path / "log", skip_corrupt=True)
    # shards of another target are refused, not skipped
    with_meta(second, edited(first, target={"target": "hf:other/model"}))
    with pytest.raises(StepLogError, match="one target's logs"):
        read_step_log(tmp_path / "log", skip_corrupt=True)


# ---------------------------------------------------------------------- tensor parallelism
def tp_config(rank: int, tp: int = 2, pcp: int = 1):
    """test_production's vLLM config as a worker of a tensor-parallel engine sees it (vLLM sets ``rank``)."""
    cfg = vllm_config()
    cfg.parallel_config = SimpleNamespace(rank=rank, tensor_parallel_size=tp, prefill_context_parallel_size=pcp)
    return cfg


class TensorParallel:
    """The proposer hook of a tensor-parallel engine: every rank's proposer is called with the same rows and drafts
    the same blocks (the engine uses one)."""

    def __init__(self, ranks):
        self.ranks = ranks

    def propose(self, *args):
        blocks = [p.propose(*args) for p in self.ranks]
        assert all(b == blocks[0] for b in blocks)
        return blocks[0]


def test_a_tensor_parallel_engine_logs_each_request_once_from_its_first_rank(tmp_path, monkeypatch):
    from toys import ngram_rule

    from sacpolicy.export.vllm import LOG_ENV, PolicyProposer
    from sacpolicy.runtime import save_policy

    monkeypatch.setenv(LOG_ENV, str(tmp_path / "log"))
    policy = save_policy(tmp_path / "policy", ngram_rule("stop"), drafters={"ngram": {"kind": "ngram",
                         "max_ngram": 3}}, provenance={"target": TARGET}, metrics={})
    ranks = [PolicyProposer(tp_config(r), str(policy)) for r in (0, 1)]
    assert ranks[0].steplog is not None and ranks[1].steplog is None  # rank 1 holds no log: one `if` per step
    engine = workload(n=6, seed=3)
    engine.run(TensorParallel(ranks))
    ranks[0].steplog.close()
    reqs, incomplete, meta = logged_requests(tmp_path)
    assert incomplete == 0 and len(reqs) == len(engine.prompts) and meta["shards"] == 1  # once each, not twice
    assert sorted(r["tokens"] for r in reqs.values()) == sorted(engine.seqs.values())
    assert meta["proposer_workers"] == 2


@pytest.mark.parametrize("rank, tp, pcp, place", [(0, 1, 1, 0), (3, 2, 1, 1), (5, 2, 1, 1), (4, 2, 1, 0),
                                                   (6, 2, 2, 2), (8, 2, 2, 0)])
def test_the_writer_is_the_first_proposer_worker_of_each_engine(rank, tp, pcp, place):
    """vLLM's ranks: tensor-parallel innermost, then prefill-context-parallel, then pipeline stages (the proposer runs
    on the last); external data-parallel engines stack whole engines on top."""
    assert vllm_adapter.engine_rank(tp_config(rank, tp, pcp)) == (place, tp * pcp)
    assert vllm_adapter.engine_rank(vllm_config()) == (0, 1)  # not in vLLM, no process group: the one writer


@pytest.mark.slow
def test_vllms_parallel_config_holds_what_the_writer_reads():
    config = pytest.importorskip("vllm.config")
    pc = config.ParallelConfig(tensor_parallel_size=2, pipeline_parallel_size=2)
    pc.rank = 3  # what vLLM's worker sets: the last stage's second tensor-parallel rank
    assert vllm_adapter.engine_rank(SimpleNamespace(parallel_config=pc)) == (1, 2)
