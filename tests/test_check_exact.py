"""``scripts/check_exact.py`` on a tiny run: every drafter of the run, alone and batched, against transformers'
``generate``, and a difference reported as a failure naming the configuration."""

from __future__ import annotations

import json

from omegaconf import OmegaConf
from test_config import cfg_for
from toys import load_script


def tiny_run(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    cfg = cfg_for("target=tiny", "draft=[ngram,suffix]", "data=mt_bench", tmp_path=run)  # no first answers to make
    OmegaConf.save(cfg, run / "config.yaml")
    return run


def test_every_drafter_alone_and_batched_equals_generate(tmp_path, capsys):
    run, out = tiny_run(tmp_path), tmp_path / "exact.json"
    script = load_script("check_exact")
    rc = script.main(["--run", str(run), "--prompts", "3", "--max-new-tokens", "8", "--predictors", "none",
                      "--batch", "2", "--out", str(out)])
    rows = {r["config"]: r for r in json.loads(out.read_text())["rows"]}
    assert rc == 0 and set(rows) == {"ngram k=4", "ngram k=4 B=2", "suffix k=4", "suffix k=4 B=2"}
    assert all(r["identical"] == r["prompts"] == 3 for r in rows.values())
    assert "| ngram k=4 B=2 | 3/3 |" in capsys.readouterr().out


def test_a_configuration_that_differs_fails_naming_it(tmp_path, monkeypatch, capsys):
    run = tiny_run(tmp_path)
    script = load_script("check_exact")
    real = script.reference

    def off_by_one(model, prompts, n, stop):  # the reference's last token changed: every configuration differs
        return [r[:-1] + [(r[-1] + 1) % 100] for r in real(model, prompts, n, stop)]

    monkeypatch.setattr(script, "reference", off_by_one)
    rc = script.main(["--run", str(run), "--prompts", "2", "--max-new-tokens", "6", "--predictors", "none",
                      "--batch", "2", "--out", str(tmp_path / "x.json")])
    captured = capsys.readouterr()
    assert rc == 1 and "FAILED: ngram k=4, ngram k=4 B=2" in captured.err
    assert "prompt 0 token 5" in captured.out


def test_a_rule_whose_cost_model_cannot_price_a_batch_is_skipped_in_batches_with_the_reason():
    from types import SimpleNamespace

    from test_traces import cost_model

    script = load_script("check_exact")
    rule = SimpleNamespace(rule=SimpleNamespace(cost=cost_model(["ngram"])))  # profiled at batch size 1
    assert not rule.rule.cost.batch
    assert "batch size 1 only" in script.cannot_batch(rule, 4)
    assert script.cannot_batch(rule, None) is None and script.cannot_batch(SimpleNamespace(), 4) is None
