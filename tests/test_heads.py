"""The EAGLE-3 head that ships with sacpolicy (sacpolicy/heads) and warm starts from a head."""

import functools
import json
import shutil

import lightning as L
import pytest
import torch
from conftest import tiny_head_dir
from safetensors.torch import load_file
from test_eagle3 import sequences, tiny_target  # noqa: F401  (module fixtures)

from sacpolicy.heads import HERE, SHIPPED, ShippedHeadError, shipped_head, verify
from sacpolicy.models import EMBEDDED_TARGET
from sacpolicy.runtime.artifact import file_sha256
from sacpolicy.training.eagle3 import Eagle3Settings, train_eagle3

SHIPPED_DIR = HERE / SHIPPED[EMBEDDED_TARGET]


def test_shipped_head_matches_its_provenance():
    prov = verify(SHIPPED_DIR)
    assert prov["sha256"] == file_sha256(SHIPPED_DIR / "model.safetensors")
    assert (SHIPPED_DIR / "model.safetensors").stat().st_size <= 25 * 2**20
    config = json.loads((SHIPPED_DIR / "config.json").read_text())
    assert config["verifier"] == EMBEDDED_TARGET
    settings = prov["settings"]
    assert settings["draft_vocab_size"] in (None, config["draft_vocab_size"]) and settings["seed"] == prov["seed"]
    # every training leg's command: bench_eagle3's own loop, or the pipeline's head stage
    assert prov["commands"] and all("bench_eagle3.py train" in c or "stages=[head]" in c for c in prov["commands"])
    assert len(prov["legs"]) == len(prov["commands"])
    assert prov["data"] and prov["curve"]["rows"]  # the data recipe and the measured curve travel with it
    weights = load_file(str(SHIPPED_DIR / "model.safetensors"))
    assert weights["lm_head.weight"].shape == (config["draft_vocab_size"], config["hidden_size"])
    assert int(weights["t2d"].sum()) == config["draft_vocab_size"]


def test_a_changed_or_foreign_head_is_refused(tmp_path):
    bad = tmp_path / "head"
    shutil.copytree(SHIPPED_DIR, bad)
    with open(bad / "model.safetensors", "r+b") as f:
        f.seek(-1, 2)
        last = f.read(1)
        f.seek(-1, 2)
        f.write(bytes([last[0] ^ 1]))
    with pytest.raises(ShippedHeadError, match="SHA-256"):
        verify(bad)
    with pytest.raises(ShippedHeadError, match="no EAGLE-3 head ships for target 'tiny:llama-4l'"):
        shipped_head("tiny:llama-4l")


def test_shipped_head_drafts_for_the_embedded_target_losslessly(embedded):
    from sacpolicy.data import load_prompts
    from sacpolicy.decoding import SpeculativeDecoder
    from sacpolicy.decoding.feature import load_feature_drafter
    from sacpolicy.policy import Static

    drafter = load_feature_drafter(embedded, shipped_head(EMBEDDED_TARGET))
    ids = load_prompts("humaneval", tokenizer=embedded.tokenizer, limit=1)[0]["input_ids"]
    ar = SpeculativeDecoder(embedded.model, [], None, stop_token_ids=[]).generate(ids, 24)
    res = SpeculativeDecoder(embedded.model, [drafter], Static(3), stop_token_ids=[]).generate(ids, 24)
    assert res.tokens == ar.tokens
    accepted = sum(s.accepted for s in res.steps)
    assert accepted > 0.2 * sum(s.drafted for s in res.steps)  # a trained head, not a random one


def _trainer(tmp):
    return functools.partial(L.Trainer, accelerator="cpu", devices=1, enable_progress_bar=False, max_epochs=1000,
                             default_root_dir=str(tmp), enable_model_summary=False)


def test_warm_start_keeps_the_head_or_trains_on_from_it(tiny_target, sequences, tmp_path):  # noqa: F811
    init = tiny_head_dir(tiny_target, tmp_path / "init", vocab=64)
    init_w = load_file(str(init / "model.safetensors"))
    # budget 0: the warm-start head as it is, no data needed
    s0 = Eagle3Settings(init_from=str(init), budget_minutes=0, max_steps=None)
    assert train_eagle3(tiny_target, [], [], s0, _trainer(tmp_path), tmp_path / "as_is", progress=False)[
        "global_step"] == 0
    kept = load_file(str(tmp_path / "as_is" / "head" / "model.safetensors"))
    assert all(torch.equal(kept[k], v) for k, v in init_w.items())
    prov = json.loads((tmp_path / "as_is" / "head" / "provenance.json").read_text())
    assert prov["init_from"] == str(init) and prov["trained_here"] is False
    # a budget: training starts from the head's weights and keeps its vocabulary
    s1 = Eagle3Settings(init_from=str(init), budget_minutes=None, max_steps=3, warmup_steps=1, batch_size=8,
                        aux_layer_ids=[0, 1, 2])
    m = train_eagle3(tiny_target, sequences[:16], sequences[16:24], s1, _trainer(tmp_path), tmp_path / "tuned",
                     progress=False)
    tuned = load_file(str(tmp_path / "tuned" / "head" / "model.safetensors"))
    assert m["global_step"] == 3 and torch.equal(tuned["d2t"], init_w["d2t"])
    assert not torch.equal(tuned["fc.weight"], init_w["fc.weight"])
    # its shapes are the head's: other settings are refused before training
    with pytest.raises(ValueError, match="draft_vocab_size: settings 256, head 64"):
        train_eagle3(tiny_target, sequences[:16], sequences[16:24],
                     Eagle3Settings(init_from=str(init), max_steps=3, draft_vocab_size=256), _trainer(tmp_path),
                     tmp_path / "clash", progress=False)
    with pytest.raises(ValueError, match="budget"):
        Eagle3Settings(budget_minutes=0, max_steps=None)


def test_bench_head_times_rows_drafting_together(tmp_path):
    """scripts/bench_head.py: the shipped head's proposals for 1 and 3 rows drafting together, timed per call and per
    row, with each size's share of one row's time."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    res = subprocess.run([sys.executable, str(root / "scripts/bench_head.py"), "--rows", "1,3", "--steps", "2",
                          "--warmup", "0", "--context", "24", "--threads", "1", "--stop",
                          "--out", str(tmp_path / "h.json")],
                         capture_output=True, text=True, timeout=300, cwd=root,
                         env={**os.environ, "OMP_NUM_THREADS": "1"}, check=False)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads((tmp_path / "h.json").read_text())
    assert [r["rows"] for r in out["rows"]] == [1, 3]
    one, three = out["rows"]
    assert one["share"] == 1.0 and three["per_row_ms"] == pytest.approx(three["call_ms"] / 3)
    assert three["share"] == pytest.approx(three["per_row_ms"] / one["per_row_ms"])
    assert "| 3 |" in res.stdout and "with a stop callback" in res.stdout
