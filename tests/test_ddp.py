"""The training stages under Lightning DDP, as users launch them: ``scripts/train.py trainer=ddp_cpu`` (2 CPU
processes, gloo; Lightning starts rank 1 as a second run of the same command at rank 0's first ``fit``). Side effects
happen once, each rank trains on its own share of the batches and collects its shard of the traces, rank 0 merges
the shards into exactly the rows of a 1-process run (one cost.json) and runs the later stages once, and the
exports are those of a 1-process run."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
STAGES = "stages=[distill,head,collect,fit]"
# both training stages short; the later stages small: what matters is where and how often they run
SMALL = ["distill.max_steps=2", "head.max_steps=2", "collect.num_prompts={train: 2, val: 1, test: 1}",
         "collect.max_new_tokens=8", "collect.profile.repeats=1", "collect.profile.ks=[0,1]",
         "collect.profile.context_lens=[32]", "draft=[ngram]", "predictor=[logreg,mlp]"]


def _train(tmp_path, name, *overrides):
    from sacpolicy.models import cache_root

    cache = tmp_path / "cache"  # its own distillation data, the converted models shared
    if not cache.exists():
        (cache_root() / "models").mkdir(parents=True, exist_ok=True)
        cache.mkdir()
        (cache / "models").symlink_to(cache_root() / "models")
    env = {**os.environ, "SACPOLICY_CACHE": str(cache), "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, str(ROOT / "scripts/train.py"), "experiment=smoke", STAGES, *SMALL,
                          *overrides, f"hydra.run.dir={tmp_path / name}"],
                         capture_output=True, text=True, timeout=900, cwd=ROOT, env=env)
    assert out.returncode == 0, out.stderr[-4000:]
    return tmp_path / name, out.stdout + out.stderr


def _files(d: Path) -> dict:
    return {p.name: p.stat().st_size > 0 for p in sorted(d.iterdir())}


@pytest.mark.slow  # three processes in all, two of them in DDP
def test_training_stages_under_ddp_on_two_cpu_processes(tmp_path):
    ddp, log = _train(tmp_path, "ddp", "trainer=ddp_cpu")
    one, _ = _train(tmp_path, "one")  # the same run in one process (the cached data reused)
    assert "distributed_backend=gloo" in log or "gloo" in log
    # every rank trains and collects; the stage after them runs once, on rank 0; each summary written once
    for stage, ranks in (("distill", 2), ("head", 2), ("collect", 2), ("fit", 1)):
        assert log.count(f"stage {stage} done in") == ranks, (stage, log[-3000:])
    assert log.count("profiling the cost model") == 1 and (ddp / "cost.json").is_file()
    metrics = [json.loads(line) for line in (ddp / "metrics.jsonl").read_text().splitlines()]
    for stage in ("distill", "head", "collect", "fit"):
        assert sum(f"{stage}/seconds" in m for m in metrics) == 1, stage
    assert [p.name for p in ddp.glob("*.failed")] == [] and (ddp / "config.yaml").is_file()
    merged, alone = (json.loads((r / "traces" / "tf" / "manifest.json").read_text()) for r in (ddp, one))
    assert (merged["shards"], alone["shards"]) == (2, 1)
    assert (merged["rows"], merged["prompts"]) == (alone["rows"], alone["prompts"])
    assert json.loads((ddp / "collect.json").read_text())["merged"] == merged
    for stage in ("distill", "head"):
        d, o = (json.loads((r / f"{stage}.json").read_text()) for r in (ddp, one))
        assert d["world_size"] == 2 and o["world_size"] == 1
        # each rank its half of the batches (distill: Lightning's DistributedSampler; head: LengthBuckets' share)
        assert d["train_batches_per_rank"] < o["train_batches_per_rank"], (stage, d, o)
        assert d["train_batches_per_rank"] >= o["train_batches_per_rank"] // 2, (stage, d, o)
    # rank 0 exported what a 1-process run exports, in the same format
    for rel in ("distill/draft", "head/head"):
        assert _files(ddp / rel) == _files(one / rel), rel
        cfg_d, cfg_o = (json.loads((r / rel / "config.json").read_text()) for r in (ddp, one))
        assert cfg_d == cfg_o, rel
    from safetensors import safe_open

    for rel in ("distill/draft/model.safetensors", "head/head/model.safetensors"):
        with safe_open(str(ddp / rel), "pt") as a, safe_open(str(one / rel), "pt") as b:
            assert sorted(a.keys()) == sorted(b.keys())
            assert all(a.get_slice(k).get_dtype() == b.get_slice(k).get_dtype() for k in a.keys())


@pytest.mark.slow  # torchrun and two ranks
def test_torchrun_ranks_share_one_run_directory_and_collect_a_shard_each(tmp_path):
    """``torchrun --nproc-per-node 2 scripts/train.py ...`` without ``hydra.run.dir``: rank 0 picks the run directory
    (``${now}``) and rank 1 reads it from torchrun's store; both train, each collects its shard, rank 0 merges."""
    torchrun = Path(sys.executable).with_name("torchrun")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    out = subprocess.run([str(torchrun), "--nproc-per-node", "2", str(ROOT / "scripts/train.py"), "experiment=smoke",
                          "stages=[distill,collect]", "trainer=ddp_cpu", *SMALL[:1], *SMALL[2:]],
                         capture_output=True, text=True, timeout=900, cwd=tmp_path, env=env)
    assert out.returncode == 0, out.stderr[-4000:]
    runs = list((tmp_path / "outputs").glob("*/*"))
    assert len(runs) == 1, runs  # one run directory for both ranks
    run, log = runs[0], out.stdout + out.stderr
    assert log.count("stage distill done in") == 2 and log.count("stage collect done in") == 2
    assert log.count("profiling the cost model") == 1 and (run / "cost.json").is_file()
    assert json.loads((run / "collect.json").read_text())["merged"]["shards"] == 2
    assert (run / "distill" / "draft" / "model.safetensors").is_file()
