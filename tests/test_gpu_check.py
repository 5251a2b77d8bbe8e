"""scripts/gpu_check.sh, the first-GPU check: its CPU dry run (the same steps on the tiny models and vLLM's CPU
engine) runs green and writes the summary a GPU run writes."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))


def test_summary_records_every_step_and_fails_on_one(tmp_path):
    from gpu_check import summary

    (tmp_path / "steps.tsv").write_text("env\t0\t1.2\ndecoder\t1\t30.04\n")
    (tmp_path / "decoder.log").write_text("F.\n1 failed, 1 passed\n")
    (tmp_path / "env.json").write_text(json.dumps({"cuda": True}))
    (tmp_path / "meta.json").write_text(json.dumps({"mode": "gpu"}))
    got = summary(tmp_path, tmp_path / "out" / "s.json")
    assert json.loads((tmp_path / "out" / "s.json").read_text()) == got
    assert got["mode"] == "gpu" and not got["ok"] and got["total_s"] == 31.2
    assert got["steps"]["env"] == {"ok": True, "exit_code": 0, "seconds": 1.2, "log_tail": [],
                                   "result": {"cuda": True}}
    assert got["steps"]["decoder"]["log_tail"][-1] == "1 failed, 1 passed" and not got["steps"]["decoder"]["ok"]


@pytest.mark.vllm
@pytest.mark.slow  # a pipeline and a vLLM engine: minutes on 2 cores
def test_dry_run_runs_every_step_on_cpu(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable, "GPU_CHECK_WORK": str(tmp_path / "work"),
           "GPU_CHECK_DECODER_K": "greedy_equals_target"}
    env.pop("OUT", None)
    out = subprocess.run(["bash", str(ROOT / "scripts/gpu_check.sh"), "--dry-run", "--out", str(tmp_path / "s.json"),
                          "--", "stages=[distill,head,collect,fit,export]", "distill.max_steps=2", "head.max_steps=2"],
                         capture_output=True, text=True, timeout=900, cwd=ROOT, env=env)
    summary = json.loads((tmp_path / "s.json").read_text())
    failed = {k: s["log_tail"] for k, s in summary["steps"].items() if not s["ok"]}
    assert out.returncode == 0 and summary["ok"], failed
    assert list(summary["steps"]) == ["env", "decoder", "pipeline", "vllm"]
    assert (summary["mode"], summary["device"], summary["dtype"]) == ("dry-run", "cpu", "float32")
    assert "passed" in summary["steps"]["decoder"]["log_tail"][-1]
    engine = summary["steps"]["vllm"]["result"]
    assert (engine["dtype"], engine["enforce_eager"], engine["cuda"]) == ("float32", True, False)
    assert engine["tokens"] > 0 and engine["proposer"]["calls"] > 0  # the export's proposer ran in the engine
