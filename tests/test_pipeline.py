"""The whole pipeline under Hydra: the smoke experiment end to end, a multirun, resume, from_run, W&B offline."""

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_config import cfg_for
from test_tracking import read_offline_run

from sacpolicy import pipeline
from sacpolicy.data import assign_split
from sacpolicy.traces import peer_tuning
from sacpolicy.traces.peer_tuning import PEERS, peer_grid

ROOT = Path(__file__).resolve().parents[1]
TRAIN = str(ROOT / "scripts/train.py")


def train(*args, timeout=600, env=None):
    flags = [a for a in args if a.startswith("-")]  # Hydra's flags go before the overrides
    args = [a for a in args if not a.startswith("-")]
    return subprocess.run([sys.executable, TRAIN, *flags, "experiment=smoke", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("smoke")
    res = train(f"hydra.run.dir={out}")
    assert res.returncode == 0, res.stderr[-3000:]
    return out, res


def test_smoke_experiment_runs_every_stage_and_reports(smoke_run):
    out, res = smoke_run
    for stage in ("distill", "collect", "fit", "evaluate", "export"):
        assert (out / f"{stage}.json").is_file(), stage
    ev = json.loads((out / "eval.json").read_text())
    rows = {(r["name"], r["mode"]): r for r in ev["rows"]}
    names = {n for n, _ in rows}
    assert {"ar", "best-static", "heuristic", "confidence-0.4", "confidence-tuned", "seed-rule", "bandit",
            "oracle", "learned-hgb", "learned-logreg", "learned-mlp"} <= names
    assert {"static-k1", "static-k2", "static-k4"} <= names
    assert {f"peer-{n}" for n in PEERS} | {"best-peer"} <= names  # the engines' controllers, tuned on val traces
    assert set(ev["meta"]["peers"]) == set(PEERS) and ev["meta"]["best_peer"] in PEERS
    for (name, mode), r in rows.items():
        assert r["tokens_per_s"] > 0 and r["mode"] in ("live", "simulated")
    assert ("learned-hgb", "live") in rows and ("oracle", "live") not in rows
    # the evaluation-only held-out sets (collect.eval_only): collected as test traces, reported per category
    assert json.loads((out / "collect.json").read_text())["eval_only_prompts"] == 2
    assert {"sharegpt", "revision"} <= set(rows["best-static", "simulated"]["per_category"])
    live = [n for n, m in rows if m == "live"]  # every live row set against its simulated one, the machine probed
    assert set(ev["meta"]["simulated_vs_live"]) == set(live) and ev["meta"]["machine_speed"]["reference"] == "probe"
    assert len(ev["meta"]["machine_speed"]["probes_s"]) >= 2
    report = (out / "report.md").read_text()
    assert "learned-mlp" in report and "scripts/train.py" in report and "experiment=smoke" in report
    assert list((out / "plots").glob("*.png"))
    assert json.loads((out / "report.json").read_text())["eval"]["rows"]
    for name in ("hgb", "logreg", "mlp"):
        assert (out / "policies" / name / "policy.json").is_file()
        assert (out / "export" / name / "vllm.json").is_file()
    assert "learned-hgb" in res.stdout and "report:" in res.stdout
    assert (out / "metrics.jsonl").is_file() and (out / "tables" / "eval" / "rows.csv").is_file()


def test_oracle_gap_benchmark_decomposes_the_oracles_gain(smoke_run, tmp_path):
    out, _ = smoke_run
    res = subprocess.run([sys.executable, str(ROOT / "scripts/bench_oracle_gap.py"), "--run", str(out),
                          "--out", str(tmp_path / "gap.json")], capture_output=True, text=True, timeout=600, cwd=ROOT,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert res.returncode == 0, res.stderr[-3000:]
    rows = {r["name"]: r for r in json.loads((tmp_path / "gap.json").read_text())["rows"]}
    assert set(rows) == {"best-static", "per-prompt-static", "oracle", "learned-hgb", "learned-hgb-in-sample"}
    # the same outputs under every policy: per-prompt hindsight can only save seconds over one global choice
    assert rows["per-prompt-static"]["tokens_per_s"] >= rows["best-static"]["tokens_per_s"] * (1 - 1e-9)
    assert rows["best-static"]["oracle_gain_captured"] in (0.0, None) and "| oracle |" in res.stdout


def test_batch_benchmark_runs_a_pipeline_runs_policy_on_its_test_prompts(smoke_run, tmp_path):
    out, _ = smoke_run
    fit = json.loads((out / "fit.json").read_text())
    losses = {n: p["metrics"]["val"]["log_loss"] for n, p in fit["predictors"].items()}
    assert fit["headline"] == min(losses, key=losses.get)
    assert json.loads((out / "eval.json").read_text())["meta"]["learned_policy"] == f"learned-{fit['headline']}"
    res = subprocess.run([sys.executable, str(ROOT / "scripts/bench_batch.py"), "--run", str(out), "--prompts", "4",
                          "--batch-sizes", "1,2", "--static-ks", "2", "--rates", "0.5x,2", "--max-tokens", "6",
                          "--repeats", "2", "--out", str(tmp_path / "batch.json")], capture_output=True, text=True,
                         timeout=600, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert res.returncode == 0, res.stderr[-3000:]
    assert f"policies/{fit['headline']} (the lowest validation log-loss)" in res.stdout
    bench = json.loads((tmp_path / "batch.json").read_text())
    best_k = json.loads((out / "best_static.json").read_text())["k"]
    policies = {r["policy"] for r in bench["batch"]}
    assert {"ar", "static-k2", f"static-k{best_k}", "heuristic", "seed-rule", "learned"} <= policies
    assert all(r["identical"] for r in bench["batch"] + bench["poisson"])  # every row equals its B = 1 AR output
    assert {r["batch"] for r in bench["batch"]} == {1, 2} and bench["n_prompts"] == 4
    for r in bench["batch"]:  # two alternating repeats: their paired ratios, and the row pools both
        assert len(r["tokens_per_s_runs"]) == len(r["vs_ar_runs"]) == len(r["vs_best_static_runs"]) == 2
        assert r["tokens_per_s"] == pytest.approx(r["tokens"] / r["wall_s"])
        assert min(r["tokens_per_s_runs"]) <= r["tokens_per_s"] * (1 + 1e-9)
        assert max(r["tokens_per_s_runs"]) >= r["tokens_per_s"] * (1 - 1e-9)
        if r["policy"] == "ar":
            assert r["vs_ar_runs"] == [1.0, 1.0]
        # steps with all B rows: at B = 1 every step, whose tokens/s leaves out only the prefills and the policy
        assert 0 < r["full_batch_share"] <= 1 and r["full_batch_tokens_per_s"] > 0
        if r["batch"] == 1:
            assert r["full_batch_tokens_per_s"] >= r["tokens_per_s"]
        ar = next(a for a in bench["batch"] if a["policy"] == "ar" and a["batch"] == r["batch"])
        assert r["vs_ar_runs"] == pytest.approx([x / y for x, y in zip(r["tokens_per_s_runs"],
                                                                         ar["tokens_per_s_runs"])])
    half = next(r for r in bench["poisson"] if r["rate"] == "0.5x")
    assert half["requests_per_s"] == pytest.approx(0.5 * bench["capacity_requests_per_s"])
    assert next(r for r in bench["poisson"] if r["rate"] == "2")["requests_per_s"] == 2.0
    mix = {m["policy"]: m for m in bench["mix"]}
    assert mix["ar"]["vs_ar"] == 1.0 and max(m["vs_best_static"] for p, m in mix.items()
                                             if p == "ar" or p.startswith("static-k")) == 1.0
    ceiling = mix.pop("per-rate best static (hindsight)")
    for name, m in mix.items():  # request speed pools every rate's requests: tokens over their summed latencies
        runs = [r for r in bench["poisson"] if r["policy"] == name]
        assert m["request_tokens_per_s"] == pytest.approx(sum(r["tokens"] for r in runs)
                                                          / sum(r["latency_sum_s"] for r in runs))
    # the hindsight ceiling: at each rate, the static (AR included) whose requests finished fastest
    assert set(ceiling["picks"]) == {"0.5x", "2"} and ceiling["vs_best_static"] >= 1.0
    for rate, pick in ceiling["picks"].items():
        statics = [r for r in bench["poisson"] if r["rate"] == rate and (r["policy"] == "ar" or
                                                                           r["policy"].startswith("static-k"))]
        assert pick == min(statics, key=lambda r: r["latency_sum_s"] / r["tokens"])["policy"]
    assert "Over the Poisson mix" in res.stdout


def run_in_process(out_dir, *overrides) -> dict:
    """``pipeline.run`` on the composed smoke config, in this process (what scripts/train.py does after Hydra)."""
    return pipeline.run(cfg_for("experiment=smoke", *overrides, tmp_path=out_dir))


def test_rerun_in_the_same_directory_skips_finished_stages_and_from_run_reuses_them(smoke_run, tmp_path, caplog):
    out, _ = smoke_run
    before = (out / "eval.json").stat().st_mtime
    with caplog.at_level(logging.INFO, logger="sacpolicy.pipeline"):
        outputs = run_in_process(out, "stages=[fit,evaluate]")
    assert "already finished" in caplog.text and outputs["metric"] > 0
    assert (out / "eval.json").stat().st_mtime == before
    outputs = run_in_process(tmp_path, f"from_run={out}", "stages=[evaluate]", "eval.live_prompts=0",
                             "eval.ceilings=false")
    assert not (tmp_path / "fit.json").exists() and (tmp_path / "eval.json").is_file()
    rows = json.loads((tmp_path / "eval.json").read_text())["rows"]
    assert {"learned-hgb", "oracle"} <= {r["name"] for r in rows} and all(r["mode"] == "simulated" for r in rows)
    in_sample = {r["name"] for r in json.loads((out / "eval.json").read_text())["rows"]} - {r["name"] for r in rows}
    assert in_sample and all(n.endswith("-in-sample") for n in in_sample)  # eval.ceilings=false: no refits
    chained = tmp_path / "chained"  # from_run follows the chain: this run reads the policies of the first one
    run_in_process(chained, f"from_run={tmp_path}", "stages=[export]")
    assert (chained / "export" / "hgb" / "vllm.json").is_file()


def test_peers_are_tuned_on_validation_traces_replayed_on_test_and_the_best_decoded_live(smoke_run, tmp_path,
                                                                                          monkeypatch):
    """Each peer of eval.peers is tuned on the run's validation traces alone (what the tuner received is recorded),
    replayed as a simulated peer-<name> row, and the fastest on val decodes live as best-peer, with the learned
    policy's paired interval against it in eval.json and eval.md."""
    out, _ = smoke_run
    received, tune = {}, peer_tuning.tune_peer

    def recording(name, grouped_val, *args, **kwargs):
        received[name] = set(grouped_val)
        return tune(name, grouped_val, *args, **kwargs)

    monkeypatch.setattr(peer_tuning, "tune_peer", recording)
    run_in_process(tmp_path, f"from_run={out}", "stages=[evaluate]", "eval.ceilings=false", "eval.live_prompts=2",
                   "eval.peers=[sglang,vllm_adaptive,llamacpp]", "eval.live_policies=[ar,best-static,learned,best-peer]")
    ev = json.loads((tmp_path / "eval.json").read_text())
    meta, rows = ev["meta"], {(r["name"], r["mode"]) for r in ev["rows"]}
    peers = ["sglang", "vllm_adaptive", "llamacpp"]
    assert list(received) == list(meta["peers"]) == peers
    for name, ids in received.items():  # validation traces only: every prompt of the val split, none of test's
        assert ids and {assign_split(pid) for pid in ids} == {"val"} and len(ids) == meta["val_prompts"]
    for name, tuned in meta["peers"].items():  # the setting chosen, one of the peer's grid, for the audit
        assert tuned["settings"] in peer_grid(name, 4) and tuned["val_tokens_per_s"] > 0
        assert (f"peer-{name}", "simulated") in rows and (f"peer-{name}", "live") not in rows
    best = meta["best_peer"]
    assert meta["peers"][best]["val_tokens_per_s"] == max(p["val_tokens_per_s"] for p in meta["peers"].values())
    learned = meta["learned_policy"]
    assert {n for n, m in rows if m == "live"} == {"ar", "best-static", learned, "best-peer"}
    by = {(r["name"], r["mode"]): r for r in ev["rows"]}
    vs = next(p for p in meta["learned_vs_peers"] if p["ref"] == "best-peer" and p["mode"] == "live")
    assert vs["row"] == learned and vs["n_prompts"] == 2
    assert vs["ratio"] == pytest.approx(by[learned, "live"]["tokens_per_s"] / by["best-peer", "live"]["tokens_per_s"])
    assert vs["ci"][0] <= vs["ratio"] <= vs["ci"][1] and meta[f"{learned}_vs_best_peer_live"] == vs["ratio"]
    assert {p["ref"] for p in meta["learned_vs_peers"] if p["mode"] == "simulated"} == {
        "best-peer", *(f"peer-{n}" for n in peers)}
    md = (tmp_path / "eval.md").read_text()
    assert f"| peer-{best} (best-peer) |" in md and f"- learned / best-peer (live, {learned} vs peer-{best}, 2" in md


def test_a_peer_policy_option_composes_and_decodes_in_the_decode_stage(smoke_run, tmp_path):
    """policy=vllm_adaptive: built with the run's cost model (its run-time parameter), decoded live against AR."""
    out, _ = smoke_run
    summary = run_in_process(tmp_path, f"from_run={out}", "stages=[decode]", "policy=vllm_adaptive",
                             "policy.num_speculative_tokens=3")
    policy = summary["decode"]["rows"]["policy"]
    assert policy["policy"] == "VllmAdaptiveVerification(vllm-adaptive-verification)" and policy["tokens"] > 0


def test_evaluate_script_runs_the_evaluate_stage(smoke_run, tmp_path):
    out, _ = smoke_run
    res = subprocess.run([sys.executable, str(ROOT / "scripts/evaluate.py"), "experiment=smoke", f"from_run={out}",
                          f"hydra.run.dir={tmp_path}", "eval.live_prompts=0", "predictor=[hgb]"],
                         capture_output=True, text=True, timeout=600, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert res.returncode == 0, res.stderr[-3000:]
    assert "learned-hgb" in res.stdout and (tmp_path / "report.md").is_file()


def test_from_run_of_another_target_is_refused(smoke_run):
    out, _ = smoke_run
    cfg = cfg_for("experiment=embedded_cpu", f"from_run={out}")
    with pytest.raises(pipeline.PipelineError, match="was made with target 'tiny:llama-4l'"):
        pipeline.validate(cfg)
    with pytest.raises(pipeline.PipelineError, match="not a sacpolicy run directory"):
        pipeline.validate(cfg_for("experiment=smoke", f"from_run={out / 'plots'}"))


def test_a_stage_without_its_inputs_says_which_stage_makes_them(tmp_path):
    with pytest.raises(pipeline.PipelineError, match="needs traces/tf"):
        run_in_process(tmp_path, "stages=[fit]")


@pytest.mark.slow  # two whole smoke pipelines
def test_multirun_sweep_runs_two_jobs(tmp_path):
    res = train("-m", "stages=[decode]", "policy=static,heuristic", f"hydra.sweep.dir={tmp_path}")
    assert res.returncode == 0, res.stderr[-3000:]
    for job in ("0", "1"):
        assert json.loads((tmp_path / job / "decode.json").read_text())["rows"]["policy"]["tokens_per_s"] > 0


def test_an_interrupted_run_resumes_where_it_stopped(tmp_path):
    """Kill the run during trace collection, rerun it in the same directory: finished stages and trace chunks are
    kept, the rest is done, and the result matches an uninterrupted run's traces. The traces are sampled: fit tunes
    the rule by the expected-value replay, and evaluation has simulated rows."""
    # sampled traces (beta labels, replayed in expectation): without a trained draft the tiny target's greedy text is
    # one every drafter predicts, nothing to learn from
    stages = ["stages=[collect,fit]", "collect.chunk_size=1", "sampling.temperature=1.0"]
    args = [sys.executable, TRAIN, "experiment=smoke", f"hydra.run.dir={tmp_path}", *stages]
    proc = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    deadline = time.time() + 300
    while time.time() < deadline and len(list((tmp_path / "traces" / "tf").glob("*.parquet"))) < 3:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (tmp_path / "fit.json").exists()
    shards = {p.name: p.stat().st_mtime for p in (tmp_path / "traces" / "tf").glob("*.parquet")}
    assert shards
    res = train(f"hydra.run.dir={tmp_path}", *stages)
    assert res.returncode == 0, res.stderr[-3000:]
    after = {p.name: p.stat().st_mtime for p in (tmp_path / "traces" / "tf").glob("*.parquet")}
    assert all(after[n] == t for n, t in shards.items())  # finished chunks were not redone
    collect = json.loads((tmp_path / "collect.json").read_text())
    assert len(after) == sum(collect["prompts"].values())
    fit = json.loads((tmp_path / "fit.json").read_text())
    for p in fit["predictors"].values():  # sampled: tuned by the expected-value replay, fitted for temperature 1
        assert p["tuning_replay"].startswith("expected (sampled traces, temperature 1.0") and p["val_tokens_per_s"] > 0
        assert p["fitted_sampling"] == {"temperature": 1.0, "top_p": 1.0}
    policy = json.loads((tmp_path / "policies" / "hgb" / "policy.json").read_text())
    assert policy["predictor"]["meta"]["fitted_temperature"] == 1.0
    run_in_process(tmp_path, "stages=[evaluate]", "sampling.temperature=1.0", "eval.live_prompts=0")
    ev = json.loads((tmp_path / "eval.json").read_text())
    names = {r["name"] for r in ev["rows"] if r["mode"] == "simulated"}
    assert {"ar", "best-static", "confidence-tuned", "learned-hgb", "learned-hgb-in-sample", "oracle"} <= names
    assert ev["meta"]["simulated_replay"].startswith("expected")


def test_wandb_offline_run_holds_the_logged_summary(tmp_path, monkeypatch, caplog):
    for key, value in {"WANDB_API_KEY": "", "NETRC": str(tmp_path / "no-netrc"), "WANDB_SILENT": "true"}.items():
        monkeypatch.setenv(key, value)
    with caplog.at_level(logging.WARNING):
        run_in_process(tmp_path, "logger=wandb", "logger.offline=false", "stages=[decode]")
    assert "logging offline instead" in caplog.text  # online without credentials falls back
    run = read_offline_run(tmp_path)  # the records of the transaction log that `wandb sync` uploads
    assert run.logged("decode/policy_tokens_per_s") and run.summary["metric"] == run.logged("summary/metric")[0]
