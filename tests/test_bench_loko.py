"""``scripts/bench_loko.py``: leave-one-kind-out over a run's request kinds, on a minimal run directory (its config,
a cost model and synthetic teacher-forced traces of four kinds and a rare fifth), called in-process. What each piece
was handed is recorded on the way: the held-out kind never reaches the fit, its val prompts alone choose the statics
and the peers, its test prompts alone are replayed."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf
from test_config import cfg_for
from test_traces import cost_model
from toys import load_script, synthetic_traces

from sacpolicy.data import assign_split
from sacpolicy.runtime.online import OnlineSettings
from sacpolicy.traces.schema import write_meta, write_shard

KINDS = ("writing", "coding", "math", "code")
PEERS = ("vllm_schedule", "llamacpp")
HELD = ("writing", "math", "code")  # coding: fitted on, never held out (--kinds)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A run whose collect stage is done: greedy traces of two drafters, kinds dealt in turn within each split of 94
    prompts up to 8 train, 3 val and 3 test prompts of each of the four kinds (the rest left out), and one val prompt
    of kind ``rare`` (too few to hold out)."""
    run = tmp_path_factory.mktemp("loko") / "run"
    cfg = cfg_for("predictor=[hgb]", "fit.k_max=4", "fit.k=4", tmp_path=run)
    run.mkdir()
    OmegaConf.save(cfg, run / "config.yaml")
    cost_model(["draft", "ngram"]).to_json(run / "cost.json")
    rows, kind = synthetic_traces(94, length=12), {}
    quota, dealt = {"train": 8, "val": 3, "test": 3}, {"train": 0, "val": 0, "test": 0}
    for pid in dict.fromkeys(r["prompt_id"] for r in rows):
        split = assign_split(pid)
        j, dealt[split] = dealt[split], dealt[split] + 1
        if j < quota[split] * len(KINDS):
            kind[pid] = KINDS[j % len(KINDS)]
        elif split == "val" and j == quota[split] * len(KINDS):
            kind[pid] = "rare"
    rows = [{**r, "category": kind[r["prompt_id"]]} for r in rows if r["prompt_id"] in kind]
    write_shard(rows, "teacher_forced", run / "traces" / "tf", "shard0")
    write_meta(run / "traces" / "tf", {"kind": "teacher_forced", "target": cfg.target.spec, "vocab_size": 1000})
    return run, rows


def ids_of(rows, kind=None, split=None, exclude=None) -> set:
    return {r["prompt_id"] for r in rows if (kind is None or r["category"] == kind) and r["category"] != exclude
            and (split is None or assign_split(r["prompt_id"]) == split)}


def test_each_kind_is_held_out_from_the_fit_and_its_baselines_tuned_on_its_own_val(run_dir, tmp_path, monkeypatch,
                                                                                   capsys):
    from sacpolicy.training import predictor as predictor_module

    run, rows = run_dir
    for kind in KINDS:  # the fixture's premise: every kind can be held out
        assert [len(ids_of(rows, kind, s)) for s in ("train", "val", "test")] == [8, 3, 3], kind
    script = load_script("bench_loko")
    seen = {"fit": [], "tune_rule": [], "best_static": [], "tune_peer": []}

    def record(what, fn, ids):
        def wrapped(*args, **kwargs):
            seen[what].append(ids(*args, **kwargs))
            return fn(*args, **kwargs)
        return wrapped

    monkeypatch.setattr(predictor_module, "fit_predictor", record(
        "fit", predictor_module.fit_predictor, lambda name, spec, ex, *a, **k: (set(ex.prompt_id),
                                                                               set(ex.of("train").prompt_id))))
    monkeypatch.setattr(predictor_module, "tune_rule", record(
        "tune_rule", predictor_module.tune_rule, lambda pred, cost, val, *a, **k: set(val)))
    monkeypatch.setattr(script, "best_static", record("best_static", script.best_static, lambda g, *a, **k: set(g)))
    monkeypatch.setattr(script, "tune_peer", record("tune_peer", script.tune_peer, lambda n, g, *a, **k: set(g)))

    out = script.main(["--run", str(run), "--kinds", ",".join(HELD), "--peers", ",".join(PEERS), "--resamples", "300",
                       "--out", str(tmp_path / "loko.json")])
    printed = capsys.readouterr().out

    held = list(out["kinds"])
    assert held == list(HELD) and not out["meta"]["skipped"]  # coding is not held out, only fitted on
    assert out["meta"]["counts"]["rare"] == {"train": 0, "val": 1, "test": 0}
    assert "  rare: train 0, val 1, test 0" in printed
    assert len(seen["fit"]) == len(seen["tune_rule"]) == len(held) and len(seen["best_static"]) == 2 * len(held)
    assert len(seen["tune_peer"]) == len(held) * len(PEERS) * 2  # each peer with each of the two drafters
    for i, kind in enumerate(held):
        fitted, trained = seen["fit"][i]
        assert not fitted & ids_of(rows, kind)  # no example of the held-out kind, of any split
        assert trained == ids_of(rows, split="train", exclude=kind)  # every other kind's train prompts
        assert seen["tune_rule"][i] == ids_of(rows, split="val", exclude=kind)  # rare's val prompt among them
        assert seen["best_static"][2 * i] == ids_of(rows, split="val", exclude=kind)  # the rule's fallback
        assert seen["best_static"][2 * i + 1] == ids_of(rows, kind, "val")  # the static the rows are set against
        tuned = seen["tune_peer"][i * 2 * len(PEERS):(i + 1) * 2 * len(PEERS)]
        assert all(g == ids_of(rows, kind, "val") for g in tuned)
        r = out["kinds"][kind]
        assert r["prompts"]["test"] == len(ids_of(rows, kind, "test")) == r["rows"][0]["prompts"]
        assert r["prompts"]["fit_val"] == len(ids_of(rows, split="val", exclude=kind))
        assert set(r["peers"]) == set(PEERS) and r["peers"]["llamacpp"]["drafter"] in ("draft", "ngram")
        fallback = r["fallback_static"]  # the rule falls back on the other kinds' best static, not on K's
        assert r["rule"]["fallback"] == [fallback["drafter"], fallback["k"]]
        assert r["rule"]["online_row"] == OnlineSettings().to_dict()  # the run's fit.online: {} (the defaults)

    names = ["learned-hgb-offline", "learned-hgb-online", *PEERS, "best-static", "oracle"]
    for rows_ in [*(r["rows"] for r in out["kinds"].values()), out["pooled"]]:
        assert [r["name"] for r in rows_] == names
        for r in rows_:
            lo, hi = r["vs_best_static_ci"]
            assert lo <= r["vs_best_static"] <= hi and r["tokens_per_s"] > 0
        base = rows_[names.index("best-static")]
        assert base["vs_best_static"] == 1.0 and base["vs_best_static_ci"] == [1.0, 1.0]
    assert out["pooled"][0]["prompts"] == sum(r["prompts"]["test"] for r in out["kinds"].values())
    # the pooled rate is the test prompts' summed tokens over summed seconds: between the kinds' own rates
    kind_rates = [r["rows"][0]["tokens_per_s"] for r in out["kinds"].values()]
    assert min(kind_rates) <= out["pooled"][0]["tokens_per_s"] <= max(kind_rates)
    # the oracle knows every step's accepted run: no kind's best static beats it
    assert all(r["rows"][-1]["vs_best_static"] >= 1.0 for r in out["kinds"].values())
    table = printed.split("ratio to best static")[1]
    assert all(f"| {k} |" in table for k in (*HELD, "pooled")) and "| coding |" not in table
    assert (tmp_path / "loko.json").is_file()


def test_kinds_too_small_to_hold_out_and_bad_options_are_refused_by_name(run_dir, tmp_path, capsys):
    run, _ = run_dir
    script = load_script("bench_loko")
    for argv, match in ((["--kinds", "poetry"], r"\['poetry'\] are not in the traces; kinds: \['"),
                        (["--predictor", "mlp"], r"'mlp' is not among the run's predictors \['hgb'\]"),
                        (["--peers", "vllm"], r"unknown peers \['vllm'\]"),
                        (["--kinds", "rare"], "no kind has enough val and test prompts")):
        with pytest.raises(SystemExit, match=match):
            script.main(["--run", str(run), "--out", str(tmp_path / "x.json"), *argv])
    assert "skipped (fewer than 3 val or test prompts): rare (val 1, test 0)" in capsys.readouterr().out
    assert not (tmp_path / "x.json").exists()
