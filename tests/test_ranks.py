"""Distributed runs without a GPU: ranks and devices from a mocked launcher environment, one run directory for every
torchrun rank, rank-0 side effects in the pipeline, and the head's distributed length buckets."""

import json
import threading
import time
from datetime import timedelta

import pytest
import torch
from test_config import cfg_for

from sacpolicy import pipeline, ranks
from sacpolicy.models.loading import resolve_device, resolve_dtype

LAUNCH = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "NODE_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
          "MASTER_PORT")


@pytest.fixture
def launched(monkeypatch):
    """Set a launcher's environment (torchrun's or Lightning's) for one test."""
    for k in LAUNCH:
        monkeypatch.delenv(k, raising=False)

    def set_env(**env):
        for k, v in env.items():
            monkeypatch.setenv(k, str(v))

    return set_env


def test_ranks_from_torchrun_and_lightning_environments():
    assert ranks.current({}) == ranks.Rank(0, 0, 1) and not ranks.current({}).distributed
    torchrun = ranks.current({"RANK": "5", "LOCAL_RANK": "1", "WORLD_SIZE": "8"})
    assert (torchrun.rank, torchrun.local_rank, torchrun.world_size, torchrun.zero) == (5, 1, 8, False)
    # Lightning's launcher sets no RANK: rank 0 is local rank 0 of node 0
    child = ranks.current({"LOCAL_RANK": "1", "WORLD_SIZE": "2", "NODE_RANK": "0"})
    assert child.rank == 1 and not child.zero and child.distributed
    assert ranks.current({"LOCAL_RANK": "0", "WORLD_SIZE": "4", "NODE_RANK": "1", "LOCAL_WORLD_SIZE": "2"}).rank == 2
    assert ranks.current({"LOCAL_RANK": "0", "WORLD_SIZE": "2", "NODE_RANK": "0"}).zero


def test_a_cuda_device_is_this_ranks_gpu(launched, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_device("auto") == torch.device("cuda") and resolve_device("cuda") == torch.device("cuda")
    launched(LOCAL_RANK=3, RANK=3, WORLD_SIZE=4)
    assert resolve_device("auto") == torch.device("cuda", 3)
    assert resolve_device("cuda") == torch.device("cuda", 3)
    assert resolve_device("cuda:1") == torch.device("cuda", 1)  # an explicit index is the user's
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_dtype("auto", "cuda") == torch.bfloat16


class _Store:  # torchrun's agent store, as ranks.share_run_dir uses it
    def __init__(self):
        self.data, self.ready = {}, threading.Event()

    def set(self, key, value):
        self.data[key] = value.encode()
        self.ready.set()

    def get(self, key):
        assert self.ready.wait(10)
        return self.data[key]


def test_torchrun_ranks_share_rank_zeros_run_directory():
    store = _Store()
    env = {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    got = {}

    def rank(r):
        got[r] = ranks.share_run_dir(["train.py", "experiment=smoke"], {**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                                     store)

    one = threading.Thread(target=rank, args=(1,))
    one.start()  # rank 1 asks first: it waits for rank 0's answer
    time.sleep(0.2)
    rank(0)
    one.join(10)
    run_dir = got[0][-1]
    assert run_dir.startswith("hydra.run.dir=outputs/")
    assert got[1] == ["train.py", "experiment=smoke", run_dir, "hydra.output_subdir=null"]
    # nothing to share: one process, or a directory given
    assert ranks.share_run_dir(["train.py"], {}, store) == ["train.py"]
    given = ["train.py", "hydra.run.dir=/x"]
    assert ranks.share_run_dir(given, {**env, "RANK": "1"}, store) == given


def test_share_run_dir_through_a_real_store():
    from torch.distributed import TCPStore

    master = TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=20), wait_for_workers=False)
    env = {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(master.port)}
    zero = ranks.share_run_dir(["t.py"], {**env, "RANK": "0", "LOCAL_RANK": "0"})
    one = ranks.share_run_dir(["t.py"], {**env, "RANK": "1", "LOCAL_RANK": "1"})
    assert zero[1] == one[1] and one[2] == "hydra.output_subdir=null"


def _record_stages(monkeypatch, ran):
    import importlib

    for stage in ("fit", "head", "evaluate"):
        mod = importlib.import_module(f"sacpolicy.pipeline.{stage}")
        monkeypatch.setattr(mod, "run", lambda ctx, stage=stage: ran.append(stage) or {"stage": stage})


def test_other_ranks_train_wait_for_rank_zeros_files_and_write_none(launched, monkeypatch, tmp_path):
    ran = []
    _record_stages(monkeypatch, ran)
    cfg = cfg_for("experiment=smoke", "stages=[fit,head,evaluate]", tmp_path=tmp_path)
    out = tmp_path  # cfg_for's run directory
    launched(RANK=1, LOCAL_RANK=1, WORLD_SIZE=2)
    writer = threading.Timer(0.5, lambda: (out / "fit.json").write_text(json.dumps({"by": "rank 0"})))
    writer.start()
    outputs = pipeline.run(cfg)
    writer.join()
    # fit is rank 0's (rank 1 read its summary), head trains on every rank, evaluate comes after the last stage of
    # every rank: rank 0's alone
    assert ran == ["head"] and outputs["fit"] == {"by": "rank 0"} and "evaluate" not in outputs
    assert sorted(p.name for p in out.iterdir()) == ["fit.json"]  # no config.yaml, head.json, metrics

    ran.clear()
    launched(RANK=0, LOCAL_RANK=0)
    monkeypatch.setattr(pipeline, "metric_of", lambda outputs: 0.0)
    monkeypatch.setattr("sacpolicy.pipeline.report.write_run_report", lambda *a: out / "report.md")
    outputs = pipeline.run(cfg)
    assert ran == ["head", "evaluate"]  # fit.json was there: skipped
    assert {"config.yaml", "head.json", "evaluate.json", "metrics.jsonl"} <= {p.name for p in out.iterdir()}


def test_a_waiting_rank_raises_rank_zeros_failure(launched, monkeypatch, tmp_path):
    ran = []
    _record_stages(monkeypatch, ran)
    cfg = cfg_for("experiment=smoke", "stages=[fit,head]", tmp_path=tmp_path)
    out = tmp_path
    (out / "fit.failed").write_text("stale: from an earlier run")
    time.sleep(0.05)
    launched(RANK=1, LOCAL_RANK=1, WORLD_SIZE=2)
    threading.Timer(0.5, lambda: (out / "fit.failed").write_text("OutOfMemoryError: boom")).start()
    with pytest.raises(RuntimeError, match="boom"):
        pipeline.run(cfg)
    assert ran == []


def test_rank_zero_failure_leaves_the_failed_file(launched, monkeypatch, tmp_path):
    from sacpolicy.pipeline import fit

    monkeypatch.setattr(fit, "run", lambda ctx: 1 / 0)
    cfg = cfg_for("experiment=smoke", "stages=[fit]", tmp_path=tmp_path)
    with pytest.raises(ZeroDivisionError):
        pipeline.run(cfg)
    assert "ZeroDivisionError" in (tmp_path / "fit.failed").read_text()


def test_length_buckets_share_the_batches_out_over_ranks():
    from sacpolicy.training.eagle3_data import LengthBuckets, Strided

    lengths = [(i * 37) % 50 + 1 for i in range(45)]
    one = LengthBuckets(lengths, batch_size=4, seed=3, pool=2)
    shares = [LengthBuckets(lengths, batch_size=4, seed=3, pool=2, num_replicas=3, rank=r) for r in range(3)]
    for epoch in (0, 1):
        for s in [one, *shares]:
            s.set_epoch(epoch)
        batches = list(one)
        got = [list(s) for s in shares]
        assert all(len(g) == len(shares[0]) == 4 for g in got)  # 12 batches: 4 each, every rank steps as often
        flat = [tuple(b) for g in got for b in g]
        assert sorted(flat) == sorted(tuple(b) for b in batches)  # disjoint shares of the same buckets
    # 11 batches over 2 ranks: rank 1 repeats the epoch's first batch, so both step 6 times
    uneven = [LengthBuckets(lengths[:44], 4, seed=3, num_replicas=2, rank=r) for r in range(2)]
    a, b = list(uneven[0]), list(uneven[1])
    assert len(a) == len(b) == 6 and b[-1] == a[0]
    assert sorted(i for r in range(3) for i in Strided(10, 3, r)) == list(range(10))
    with pytest.raises(ValueError, match="rank 2"):
        LengthBuckets(lengths, 4, num_replicas=2, rank=2)


def test_separately_launched_shards_merge_when_the_last_is_done(tmp_path):
    """``collect.shard=i/n`` in n launches into one run directory: a shard alone leaves no collect.json and the run
    stops there; fit names a missing shard; the last shard merges and the run goes on."""
    small = ["collect.num_prompts={train: 2, val: 1, test: 1}", "collect.max_new_tokens=6", "draft=[ngram]",
             "collect.profile.repeats=1", "collect.profile.ks=[0,1]", "collect.profile.context_lens=[32]"]
    outputs = pipeline.run(cfg_for("experiment=smoke", "stages=[collect,fit]", "collect.shard=1/2", *small,
                                   tmp_path=tmp_path))
    assert outputs["collect"]["partial"] and outputs["collect"]["missing"] == [0] and "fit" not in outputs
    assert not (tmp_path / "collect.json").exists() and not (tmp_path / "cost.json").exists()  # shard 0 profiles
    with pytest.raises(pipeline.PipelineError, match=r"misses shard\(s\) 0/2"):
        pipeline.run(cfg_for("experiment=smoke", "stages=[fit]", *small, tmp_path=tmp_path))
    outputs = pipeline.run(cfg_for("experiment=smoke", "stages=[collect]", "collect.shard=0/2", *small,
                                   tmp_path=tmp_path))
    assert outputs["collect"]["merged"]["shards"] == 2 and (tmp_path / "collect.json").is_file()
    assert (tmp_path / "cost.json").is_file()
