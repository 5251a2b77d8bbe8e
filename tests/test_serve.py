"""vLLM's OpenAI server with an export (sacpolicy.export.vllm_serve, scripts/serve.py, scripts/bench_serve.py).

Fast: exports that cannot be served are refused before a server starts; the custom proposer plans a step's rows at
vLLM's live batch size and never lets a failure reach the engine; the ``/metrics`` reader. Slow (``vllm``): a real
server with the exported learned policy answers concurrent completions over HTTP exactly as a server without
speculation, counts its drafts on ``/metrics``, answers a malformed request with vLLM's error and stays up, and a
server killed mid-flight serves again once restarted.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from toys import load_script, ngram_batch_rule, ngram_rule

from sacpolicy.export.vllm import STATS_ENV, PolicyProposer, export_vllm, speculative_config
from sacpolicy.export.vllm_serve import (
    ServeError,
    VllmServer,
    completions,
    parse_spec_metrics,
    serve_config,
)
from sacpolicy.models import EMBEDDED_TARGET
from sacpolicy.runtime import ArtifactError, save_policy

NGRAM = {"ngram": {"kind": "ngram", "max_ngram": 3}}


def _export(tmp_path, rule=None, target=EMBEDDED_TARGET, name="deploy"):
    policy = save_policy(tmp_path / f"{name}-policy", rule or ngram_rule("stop"), drafters=NGRAM,
                         provenance={"target": target}, metrics={})
    return export_vllm(policy, tmp_path / name)


def test_serve_config_reads_an_export(tmp_path):
    out = _export(tmp_path)
    learned = serve_config("learned", export=out)
    assert learned.speculative_config["method"] == "custom_class"
    assert learned.env["SACPOLICY_POLICY_DIR"] == str((out / "policy").resolve())
    static = serve_config("static", export=out)
    assert static.speculative_config["method"] == "ngram" and static.env == {}
    assert serve_config("none").speculative_config is None
    sync = serve_config("none-sync")  # no speculation, scheduled as vLLM schedules n-gram and custom_class ones
    assert sync.speculative_config is None and sync.args == ("--no-async-scheduling",)
    assert "--no-async-scheduling" in VllmServer("m", sync, port=1).command()
    assert "--no-async-scheduling" not in VllmServer("m", serve_config("none"), port=1).command()
    idle = serve_config("spec-idle")  # speculation on, nothing ever proposed
    assert idle.speculative_config["method"] == "custom_class" and idle.speculative_config["num_speculative_tokens"] == 8
    from sacpolicy.export.vllm_cost import IdleProposer

    assert idle.speculative_config["model"].endswith(IdleProposer.__name__)
    assert IdleProposer(None).propose([[5], [7, 8], []], [3, 4, 5], None) == [[], [], []]
    assert serve_config("vllm-ngram").speculative_config["num_speculative_tokens"] == 5
    logged = serve_config("learned-logged", export=out, log_dir=tmp_path / "steplog")  # learned, its step log on
    assert logged.speculative_config == learned.speculative_config
    assert logged.env == {**learned.env, "SACPOLICY_PROPOSER_LOG": str(tmp_path / "steplog"),
                          "SACPOLICY_PROPOSER_LOG_RATE": "1"}
    assert "SACPOLICY_PROPOSER_LOG" not in learned.env


def test_bench_serve_prices_the_step_log_against_learned_with_it_off():
    """learned-logged gets its own verdict row: its mean TPOT to learned's is the logging overhead."""
    cli = load_script("bench_serve")
    run = lambda tpot: [{"mean_tpot_ms": tpot, "output_throughput": 100.0, "p99_e2el_ms": 900.0, "identical": 4,
                         "compared": 4, "failed": 0}]  # noqa: E731
    results = {"none": {"1.0": run(80)}, "learned": {"1.0": run(50)}, "learned-logged": {"1.0": run(51)}}
    rows = {x["policy"]: x for x in cli.verdict(results, [1.0])}
    assert rows["learned-logged"]["tpot_vs_learned"] == pytest.approx(1.02)
    assert "tpot_vs_learned" not in rows["learned"]  # never against itself
    assert cli.log_cost(results, [1.0]) is None  # no proposer stats: nothing to say
    # the log's own cost: its seconds from the proposers' stats over the time each server served, all repeats
    results["learned-logged"]["1.0"][0] |= {"duration": 40.0, "repeat": 0}
    results["learned-logged"]["1.0"].append({**run(52)[0], "duration": 60.0, "repeat": 1})
    log = lambda e, w: {"engine_s": e, "writer_cpu_s": w, "steps": 900, "written": 4000, "dropped": 0}  # noqa: E731
    results["learned-logged"]["proposer"] = [{"repeat": 0, "steplog": log(0.2, 0.4)},
                                             {"repeat": 1, "steplog": log(0.3, 0.6)}]
    cost = cli.log_cost(results, [1.0])
    assert cost["engine_share"] == pytest.approx(0.005) and cost["writer_share"] == pytest.approx(0.01)
    assert cost["steps"] == 1800 and cost["written"] == 8000
    assert "engine thread 0.50% of the served time, writer thread CPU 1.00%" in cli.markdown(results, [1.0], 4.0)
    # and the process's garbage collections, log on against log off, where the proposers timed them
    results["learned"]["1.0"][0] |= {"duration": 50.0, "repeat": 0}
    results["learned"]["proposer"] = [{"repeat": 0, "gc": {"collections": [9, 1, 0], "seconds": [0.1, 0.1, 0.0]}}]
    for x in results["learned-logged"]["proposer"]:
        x["gc"] = {"collections": [20, 2, 1], "seconds": [0.2, 0.1, 0.2]}
    cost = cli.log_cost(results, [1.0])
    assert cost["gc_share"] == pytest.approx(1.0 / 100) and cost["gc_share_off"] == pytest.approx(0.2 / 50)
    assert "garbage collections 1.00% of it, 0.40% with the log off" in cli.markdown(results, [1.0], 4.0)


def test_broken_or_mismatched_exports_are_refused_before_a_server_starts(tmp_path):
    out = _export(tmp_path)
    with pytest.raises(ServeError, match="needs --export"):
        serve_config("learned")
    with pytest.raises(ServeError, match="unknown configuration"):
        serve_config("eagle9")
    other = _export(tmp_path, target="hf:meta-llama/Llama-3.1-8B-Instruct", name="other")
    with pytest.raises(ServeError, match="trained for target 'hf:meta-llama/Llama-3.1-8B-Instruct'.*--target"):
        serve_config("learned", export=other)
    (out / "static_speculative_config.json").unlink()
    with pytest.raises(ServeError, match="static_speculative_config.json is missing.*export.py"):
        serve_config("static", export=out)
    out = _export(tmp_path, name="tampered")
    weights = next((out / "policy").glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[:-8] + b"\0" * 8)
    with pytest.raises(ServeError, match="checksum mismatch"):
        serve_config("learned", export=out)


def _head_rule():
    """``ngram_batch_rule``'s predictor and costs with the EAGLE-3 head as its drafter (a small per-token cost): its
    k-by-batch-size map is [(1, 1, 4), (2, 4, 0)]."""
    from dataclasses import replace

    from sacpolicy.runtime import PiecewiseLinear

    rule = ngram_batch_rule()
    cost = replace(rule.cost, draft={"feature": PiecewiseLinear([0], [1e-6])}, per_token_draft={"feature": True})
    return replace(rule, cost=cost, drafters=("feature",), fallback=("feature", 4))


def test_the_rules_head_is_exported_as_eagle3_under_its_k_by_batch_size_map(tmp_path, embedded):
    """drafter=feature: the head written in the speculators format for the policy's target, served as vLLM's eagle3
    with the rule's k-by-batch-size map (vLLM's dynamic speculative decoding), as configuration learned-head."""
    from sacpolicy.heads import shipped_head
    from sacpolicy.models import model_dir

    drafters = {"feature": {"kind": "feature", "path": str(shipped_head(EMBEDDED_TARGET))}, **NGRAM}
    rule = _head_rule()
    policy = save_policy(tmp_path / "policy", rule, drafters={"feature": drafters["feature"]},
                         provenance={"target": EMBEDDED_TARGET}, metrics={})
    out = export_vllm(policy, tmp_path / "deploy_head", drafter="feature")
    spec = json.loads((out / "speculative_config.json").read_text())
    assert spec == {"method": "eagle3", "model": str((out / "head").resolve()), "num_speculative_tokens": 4,
                    "num_speculative_tokens_per_batch_size": [[1, 1, 4], [2, 4, 0]]}
    assert json.loads((out / "static_speculative_config.json").read_text()) == spec
    head = json.loads((out / "head" / "config.json").read_text())
    assert head["speculators_config"]["verifier"]["name_or_path"] == str(model_dir())
    served = serve_config("learned-head", head_export=out)
    assert served.speculative_config == spec and served.env == {}
    # the export moved: its own head copy is served
    moved = out.rename(tmp_path / "moved")
    assert serve_config("learned-head", head_export=moved).speculative_config["model"] == str((moved / "head").resolve())
    with pytest.raises(ServeError, match="needs --head-export"):
        serve_config("learned-head")
    with pytest.raises(ServeError, match="not the rule's EAGLE-3 head"):
        serve_config("learned-head", head_export=_export(tmp_path))
    with pytest.raises(ArtifactError, match="speculators format"):  # no head export to point vLLM at
        speculative_config(policy, drafter="feature")


def test_a_head_for_another_verifier_is_refused(tmp_path):
    head = tmp_path / "head"
    head.mkdir()
    with pytest.raises(ServeError, match="needs --head"):
        serve_config("head")
    with pytest.raises(ServeError, match="config.json is missing"):
        serve_config("head", head=head, served_model=str(tmp_path))
    (head / "config.json").write_text(json.dumps({"speculators_config": {
        "verifier": {"name_or_path": "/elsewhere/model"}, "proposal_methods": [{"speculative_tokens": 4}]}}))
    with pytest.raises(ServeError, match="weights"):
        serve_config("head", head=head, served_model=str(tmp_path))
    (head / "model.safetensors").write_bytes(b"x")
    with pytest.raises(ServeError, match="verifier '/elsewhere/model'"):
        serve_config("head", head=head, served_model=str(tmp_path))
    got = serve_config("head", head=head, served_model="/elsewhere/model")
    assert got.speculative_config == {"method": "eagle3", "model": str(head.resolve()), "num_speculative_tokens": 4}


def _proposer(tmp_path, rule, k=8):
    cfg = SimpleNamespace(speculative_config=SimpleNamespace(num_speculative_tokens=k),
                          model_config=SimpleNamespace(max_model_len=256))
    policy = save_policy(tmp_path / "p", rule, drafters=NGRAM, provenance={}, metrics={})
    return PolicyProposer(cfg, policy)


def _step(proposer, rows):
    table = np.zeros((len(rows), 256), dtype=np.int32)
    for i, ctx in enumerate(rows):
        table[i, : len(ctx)] = ctx
    return proposer.propose([[1]] * len(rows), np.array([len(c) for c in rows]), table)


def test_proposer_plans_a_steps_rows_at_vllms_live_batch_size(tmp_path):
    """A cost model profiled over batch sizes where drafting is free alone and dear in any batch: a request alone
    gets its block; the same request among four scheduled together gets none (speculation turns itself off)."""
    rng = np.random.default_rng(0)
    rows = [np.tile(rng.integers(0, 50, 4), 10) for _ in range(4)]  # repetitive: the n-gram drafter has matches
    proposer = _proposer(tmp_path, ngram_batch_rule())
    assert proposer.load_aware
    alone = _step(proposer, rows[:1])
    assert alone[0] and len(alone[0]) <= 4
    assert _step(proposer, rows) == [[]] * 4
    assert proposer.batch_sizes == {1: 1, 4: 1}
    # a rule profiled at one request prices every step as one: the four rows draft as if alone
    flat = _proposer(tmp_path / "flat", ngram_rule("k"))
    assert not flat.load_aware
    assert _step(flat, rows) == [flat.block(r) for r in rows] and all(_step(flat, rows))


def test_a_proposer_failure_never_reaches_the_engine(tmp_path, monkeypatch, caplog):
    stats = tmp_path / "stats.json"
    monkeypatch.setenv(STATS_ENV, str(stats))
    proposer = _proposer(tmp_path, ngram_rule("stop"))
    rows = [np.tile(np.arange(5), 8)]
    assert _step(proposer, rows)[0]

    def boom(*args, **kwargs):
        raise RuntimeError("policy exploded")

    monkeypatch.setattr(proposer.policy, "decide", boom)
    before = proposer.gc.stats()["collections"][2]
    import gc

    gc.collect()  # the stats count the process's garbage collections too
    assert _step(proposer, rows) == [[]] and _step(proposer, rows * 2) == [[], []]
    assert proposer.failures == 2 and "policy exploded" in caplog.text
    written = json.loads(stats.read_text())
    assert written["failures"] >= 1 and written["gc"]["collections"][2] >= before + 1
    monkeypatch.undo()
    assert _step(proposer, rows)[0]  # the next step drafts again
    # a drafter that raises is dropped for the request that made it raise, as the decoder drops it: counted, no failure
    monkeypatch.setattr(proposer.lookups[proposer.drafter], "propose", lambda rows: 1 / 0)
    assert _step(proposer, rows) == [[]] and proposer.failures == 2 and proposer.dropped_drafters == 1
    proposer.write_stats()
    assert json.loads(stats.read_text())["dropped_drafters"] == 1


def test_spec_metrics_are_read_from_prometheus_text():
    text = """# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 12.0
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 40.0
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 17.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="0"} 9.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="1"} 5.0
vllm:num_requests_running{engine="0"} 0.0
"""
    assert parse_spec_metrics(text) == {"num_drafts": 12, "num_draft_tokens": 40, "num_accepted_tokens": 17,
                                        "accepted_per_pos": [9, 5]}


def test_intel_openmp_is_preloaded_for_vllm_where_installed_and_the_callers_setting_wins(tmp_path, monkeypatch):
    from sacpolicy.export import vllm_run

    monkeypatch.setattr(vllm_run.sys, "prefix", str(tmp_path))
    monkeypatch.setattr(vllm_run.platform, "machine", lambda: "x86_64")
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    assert vllm_run.cpu_openmp_env() == {}  # not installed: nothing preloaded
    assert "LD_PRELOAD" not in VllmServer("model").env
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "libiomp5.so").write_bytes(b"")
    lib = str(tmp_path / "lib" / "libiomp5.so")
    assert vllm_run.cpu_openmp_env() == {"LD_PRELOAD": lib, "NUMBA_THREADING_LAYER": "workqueue"}
    assert VllmServer("model").env["LD_PRELOAD"] == lib
    monkeypatch.setenv("LD_PRELOAD", "")  # the caller's own setting (here: none) wins
    assert VllmServer("model").env["LD_PRELOAD"] == ""
    monkeypatch.setattr(vllm_run.platform, "machine", lambda: "aarch64")
    assert vllm_run.cpu_openmp_env() == {}


# ---------------------------------------------------------------------- a real server (CI: vLLM is installed)
@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from sacpolicy.export.vllm_run import vllm_status

    ok, why = vllm_status()
    if not ok:
        if os.environ.get("CI"):
            pytest.fail(f"CI must run the vLLM server test, but {why}")
        pytest.skip(why)
    return tmp_path_factory.mktemp("serve")


def _prompts():
    from sacpolicy.bench import held_out_prompts
    from sacpolicy.models import load_tokenizer

    tok = load_tokenizer(EMBEDDED_TARGET)
    rows = held_out_prompts("humaneval_edit", tok, n=2) + held_out_prompts("mt_bench", tok, n=2)
    return [r["input_ids"] for r in rows]


@pytest.mark.slow
@pytest.mark.vllm
def test_a_served_learned_policy_is_lossless_over_http_under_concurrent_load(served):
    """Two servers, one after the other (each takes both cores): no speculation (killed mid-flight, restarted: it
    serves the same again) and the exported learned rule (custom proposer): four concurrent completions equal, drafts
    counted on /metrics, a malformed request answered with an HTTP error while the server stays up."""
    from sacpolicy.models import model_dir

    target, prompts, n = model_dir(), _prompts(), 48
    with VllmServer(target, serve_config("none"), log=served / "none.log") as none:
        ref = completions(none.url, prompts, max_tokens=n, concurrency=4)
        assert all(r["error"] is None and len(r["token_ids"]) > 8 for r in ref), ref
        none.kill()  # a crash
        assert not none.alive()
        lost = completions(none.url, prompts[:1], max_tokens=4, timeout=10)
        assert lost[0]["error"] is not None  # reported, not raised
        none.start()
        assert completions(none.url, prompts[:2], max_tokens=n, concurrency=2) == ref[:2]

    export = _export(served)
    learned = serve_config("learned", export=export)
    stats = served / "proposer.json"
    learned.env[STATS_ENV] = str(stats)
    with VllmServer(target, learned, log=served / "learned.log") as server:
        got = completions(server.url, prompts, max_tokens=n, concurrency=4)
        assert [g["token_ids"] for g in got] == [r["token_ids"] for r in ref]
        counters = server.metrics()
        assert counters["num_drafts"] > 0 and counters["num_accepted_tokens"] > 0, counters
        bad = completions(server.url, [{"not": "a prompt"}], max_tokens=4)
        assert bad[0]["error"].startswith("HTTP 400")
        bad = completions(server.url, prompts[:1], max_tokens=-3)
        assert bad[0]["error"].startswith("HTTP 400")
        assert server.healthy()
        assert completions(server.url, prompts[:1], max_tokens=n) == got[:1]
    assert json.loads(stats.read_text())["failures"] == 0  # written every 20 steps from vLLM's engine


def test_bench_serve_sets_the_learned_rule_against_the_best_other_and_none_sync():
    """The verdict: TPOT against none, vLLM n-gram and (where it ran) none-sync and learned-ngram; throughput against
    the highest of {none, vLLM n-gram, static} and P99 against the lowest; none-sync, spec-idle and learned-ngram are
    diagnostics, never the best other."""
    cli = load_script("bench_serve")

    def run(tpot, tp, p99):
        return [{"mean_tpot_ms": tpot, "output_throughput": tp, "p99_e2el_ms": p99, "identical": 4, "compared": 4,
                 "failed": 0}]

    results = {"none": {"1.0": run(80, 100, 900)}, "none-sync": {"1.0": run(120, 200, 100)},
               "vllm-ngram": {"1.0": run(100, 90, 1000)}, "static": {"1.0": run(90, 95, 800)},
               "spec-idle": {"1.0": run(30, 10, 5000)}, "learned": {"1.0": run(60, 98, 840)},
               "learned-ngram": {"1.0": run(75, 97, 850)}}
    x, y = cli.verdict(results, [1.0])  # learned-ngram: a row of its own too
    assert (x["policy"], y["policy"]) == ("learned", "learned-ngram") and y["tpot_vs_learned"] == pytest.approx(1.25)
    assert x["tpot_vs_none"] == pytest.approx(0.75) and x["tpot_vs_ngram"] == pytest.approx(0.6)
    assert x["tpot_vs_none_sync"] == pytest.approx(0.5) and x["tpot_vs_spec_idle"] == pytest.approx(2.0)
    assert x["best_other"] == "none" and x["throughput_vs_best"] == pytest.approx(0.98)
    assert x["p99_e2el_vs_best"] == pytest.approx(840 / 800)
    assert x["p99_e2el_vs_none_sync"] == pytest.approx(8.4)
    assert x["p99_e2el_vs_best_ci"] is None  # runs without per-request latencies: no interval, the ratio alone
    assert x["tpot_vs_learned_ngram"] == pytest.approx(0.8)  # the same rule without its suffix drafter: not an other
    table = cli.markdown(results, [1.0], 2.0)
    assert "| learned | 1.0x | 0.75 | 0.60 | 0.98 | 1.05 | 0.50 | 8.40 | 2.00 | - | 0.80 | - | none |" in table


def _raw_run(latencies, errors=None):
    """A ``vllm bench serve`` result of these per-request latencies (s): TTFT a tenth of each, 64 tokens each."""
    lat = np.asarray(latencies, dtype=float)
    errors = errors or [""] * len(lat)
    return {"latencies": lat.tolist(), "ttfts": (lat / 10).tolist(), "output_lens": [64] * len(lat), "errors": errors}


def test_bench_serve_rescores_a_run_from_its_raw_results_with_intervals(tmp_path):
    """--rescore re-tables an earlier run from the raw results its --workdir kept: per-request TPOT and latency
    (vLLM's definitions), and each ratio with a paired interval over repeats and requests. Every request of the
    learned rule 1.3x slower than no speculation's (n-gram 1.5x): the ratio is 1.3 in every resample."""
    cli = load_script("bench_serve")
    rng = np.random.default_rng(0)
    work, results = tmp_path / "work", {}
    work.mkdir()
    for rep in range(2):
        base = rng.uniform(2.0, 6.0, 24)
        for name, scale in (("none", 1.0), ("vllm-ngram", 1.5), ("learned", 1.3)):
            raw = _raw_run(base * scale)
            (work / f"{name}-{rep}-0.5.json").write_text(json.dumps(raw))
            req = cli.per_request(raw)
            results.setdefault(name, {"0.5": []})["0.5"].append({
                "repeat": rep, "mean_tpot_ms": float(np.mean(req["tpot_ms"])), "output_throughput": 50.0 / scale,
                "p99_e2el_ms": float(np.percentile(req["e2el_ms"], 99)), "identical": 24, "compared": 24, "failed": 0})
    run = tmp_path / "old.json"
    run.write_text(json.dumps({"results": results, "rates_x": [0.5], "capacity_rps": 2.0}))
    assert cli.main(["--rescore", str(run), "--workdir", str(work), "--out", str(tmp_path / "new.json")]) == 0
    (x,) = json.loads((tmp_path / "new.json").read_text())["verdict"]
    for key in ("tpot_vs_none", "p99_e2el_vs_best"):
        assert x[key] == pytest.approx(1.3) and x[f"{key}_ci"] == pytest.approx([1.3, 1.3])
    assert x["tpot_vs_ngram_ci"] == pytest.approx([1.3 / 1.5, 1.3 / 1.5])
    assert "1.30 [1.30, 1.30]" in json.loads((tmp_path / "new.json").read_text())["markdown"]
    # two runs pooled: the second's repeats join the first's (renumbered), the same ratios
    assert cli.main(["--rescore", f"{run},{run}", "--workdir", f"{work},{work}", "--out", str(tmp_path / "p.json")]) == 0
    pooled = json.loads((tmp_path / "p.json").read_text())
    assert [x["repeat"] for x in pooled["results"]["learned"]["0.5"]] == [0, 1, 2, 3]
    assert pooled["verdict"][0]["p99_e2el_vs_best_ci"] == pytest.approx([1.3, 1.3])
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"results": results, "rates_x": [1.0], "capacity_rps": 2.0}))
    with pytest.raises(SystemExit, match="pool runs of the same rates"):
        cli.main(["--rescore", f"{run},{other}", "--workdir", f"{work},{work}", "--out", str(tmp_path / "x.json")])
    with pytest.raises(SystemExit, match="needs --workdir"):
        cli.main(["--rescore", str(run), "--out", str(tmp_path / "x.json")])
    (work / "learned-1-0.5.json").unlink()
    with pytest.raises(SystemExit, match="learned-1-0.5.json is missing"):
        cli.main(["--rescore", str(run), "--workdir", str(work), "--out", str(tmp_path / "x.json")])


def test_per_request_figures_follow_vllm_and_leave_out_failures():
    cli = load_script("bench_serve")
    raw = _raw_run([2.0, 3.0, 4.0], errors=["", "HTTP 500", ""])
    raw["output_lens"] = [64, 64, 1]
    req = cli.per_request(raw)
    assert req["e2el_ms"][0] == pytest.approx(2000.0) and req["e2el_ms"][1] is None
    assert req["e2el_ms"][2] == pytest.approx(4000.0)
    assert req["tpot_ms"][0] == pytest.approx((2.0 - 0.2) / 63 * 1e3)
    assert req["tpot_ms"][1] is None and req["tpot_ms"][2] is None  # failed; one token (no TPOT)


def test_bench_serve_keeps_every_repeats_proposer_stats(tmp_path):
    """The learned rule's proposer writes its stats per server run; every repeat's are kept (a list over repeats,
    not the last one's), only for the learned rule, and the tables and verdict read past them."""
    cli = load_script("bench_serve")

    row = [{"mean_tpot_ms": 60, "output_throughput": 98, "p99_e2el_ms": 840, "identical": 4, "compared": 4,
            "failed": 0}]
    results = {"none": {"1.0": row}, "learned": {"1.0": row}}
    for rep, calls in ((0, 10), (1, 12)):
        (tmp_path / f"proposer-{rep}.json").write_text(json.dumps({"calls": calls, "failures": 0}))
        cli.keep_proposer_stats(results, "learned", rep, tmp_path / f"proposer-{rep}.json")
        cli.keep_proposer_stats(results, "none", rep, tmp_path / f"proposer-{rep}.json")
    cli.keep_proposer_stats(results, "learned", 2, tmp_path / "missing.json")  # a run that wrote none
    assert results["learned"]["proposer"] == [{"repeat": 0, "calls": 10, "failures": 0},
                                              {"repeat": 1, "calls": 12, "failures": 0}]
    assert "proposer" not in results["none"]
    assert cli.verdict(results, [1.0])[0]["tpot_vs_none"] == pytest.approx(1.0)
    assert "| learned |" in cli.markdown(results, [1.0], 2.0)


def test_engines_are_shaped_by_device_and_openmp_is_preloaded_on_cpu_only(tmp_path, monkeypatch):
    """On CUDA: bfloat16, CUDA graphs (no --enforce-eager), no CPU KV-cache size, no Intel OpenMP preload; on CPU:
    float32, eager, the preload where installed. Explicit settings win."""
    from sacpolicy.export import vllm_run

    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "libiomp5.so").write_bytes(b"")
    monkeypatch.setattr(vllm_run.sys, "prefix", str(tmp_path))
    monkeypatch.setattr(vllm_run.platform, "machine", lambda: "x86_64")
    for k in ("LD_PRELOAD", "VLLM_CPU_KVCACHE_SPACE"):
        monkeypatch.delenv(k, raising=False)
    assert vllm_run.engine_defaults(cuda=True) == {"dtype": "bfloat16", "enforce_eager": False}
    assert vllm_run.engine_defaults(cuda=False) == {"dtype": "float32", "enforce_eager": True}
    assert "LD_PRELOAD" not in vllm_run.engine_env(cuda=True)
    assert "VLLM_CPU_KVCACHE_SPACE" not in vllm_run.engine_env(cuda=True)
    assert vllm_run.engine_env(cuda=False)["LD_PRELOAD"] == str(tmp_path / "lib" / "libiomp5.so")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    gpu = VllmServer("model")
    assert gpu.args[gpu.args.index("--dtype") + 1] == "bfloat16" and "--enforce-eager" not in gpu.args
    assert "LD_PRELOAD" not in gpu.env and "VLLM_CPU_KVCACHE_SPACE" not in gpu.env
    forced = VllmServer("model", dtype="float16", enforce_eager=True)
    assert forced.args[forced.args.index("--dtype") + 1] == "float16" and "--enforce-eager" in forced.args

    # run_engine's job and environment, read where it starts the engine's child
    seen = {}

    def fake_run(cmd, env, **kw):
        seen.update(job=json.loads(Path(cmd[-2]).read_text()), env=env)
        return SimpleNamespace(returncode=1, stdout="", stderr="stopped here")

    monkeypatch.setattr(vllm_run.subprocess, "run", fake_run)
    with pytest.raises(RuntimeError, match="stopped here"):
        vllm_run.run_engine("model", [[1, 2]])
    assert (seen["job"]["dtype"], seen["job"]["enforce_eager"]) == ("bfloat16", False)
    assert "LD_PRELOAD" not in seen["env"]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError):
        vllm_run.run_engine("model", [[1, 2]])
    assert (seen["job"]["dtype"], seen["job"]["enforce_eager"]) == ("float32", True)
    assert seen["env"]["LD_PRELOAD"].endswith("libiomp5.so")


def test_the_step_log_hand_off_runs_inside_the_proposers_guard(tmp_path):
    proposer = _proposer(tmp_path, ngram_rule("k"))
    rows = [np.tile(np.arange(5), 8)]

    class Broken:
        def step(self, *args):
            raise RuntimeError("log exploded")

        def cost(self):
            return {}

    proposer.steplog = Broken()
    assert _step(proposer, rows)[0] and proposer.failures == 1  # the step's drafts stand; the failure is counted


def test_under_tensor_parallelism_one_rank_reports(tmp_path, monkeypatch):
    from sacpolicy.export.vllm_adapter import is_first_rank

    monkeypatch.setenv(STATS_ENV, str(tmp_path / "stats.json"))
    for rank, first in ((0, True), (1, False), (2, True), (3, False)):
        cfg = SimpleNamespace(speculative_config=SimpleNamespace(num_speculative_tokens=8),
                              model_config=SimpleNamespace(max_model_len=256),
                              parallel_config=SimpleNamespace(rank=rank, tensor_parallel_size=2))
        assert is_first_rank(cfg) == first
        policy = save_policy(tmp_path / f"p{rank}", ngram_rule("k"), drafters=NGRAM, provenance={}, metrics={})
        proposer = PolicyProposer(cfg, policy)
        assert (proposer.stats_path is not None) == first
        assert _step(proposer, [np.tile(np.arange(5), 8)])[0]  # every rank drafts the same


def test_serve_logged_exits_non_zero_and_says_why_when_a_request_failed_or_differs(capsys):
    """scripts/serve_logged.py's exit status from its check (``compare_with_vllm`` of a hand-made log against vLLM's
    per-request arrays): 0 only when every request was served and its logged steps equal vLLM's; a failed request, a
    request whose steps differ and a run that served nothing each exit 1 with the reason on stderr."""
    from sacpolicy.traces.vllm_compare import compare_with_vllm

    cli = load_script("serve_logged")
    logged = {"a": {"prompt_len": 2, "tokens": [1, 2, 3, 4, 5], "steps": [
                  {"drafted": 2, "accepted": 1, "unseen": 0, "committed": [3, 4]},
                  {"drafted": 1, "accepted": 0, "unseen": 0, "committed": [5]}]},
              "b": {"prompt_len": 2, "tokens": [7, 8, 9], "steps": [
                  {"drafted": 2, "accepted": 0, "unseen": 0, "committed": [9]}]}}
    arrays = {"a": {"per_step_drafted": [2, 1], "per_step_accepted": [1, 0]},
              "b": {"per_step_drafted": [2], "per_step_accepted": [0]}}

    def check(spec_b=arrays["b"], failed=()):
        out = compare_with_vllm(logged, [([1, 2], [3, 4, 5], arrays["a"]), ([7, 8], [9], spec_b)])
        return out | {"failed": list(failed)}

    good = check()
    assert good["mismatched"] == [] and cli.problems(good) == []
    assert cli.exit_status(good) == 0 and capsys.readouterr().err == ""
    differs = check(spec_b={"per_step_drafted": [2], "per_step_accepted": [1]})  # vLLM accepted what the log did not
    assert differs["mismatched"] == [1] and cli.exit_status(differs) == 1
    assert "FAILED: 1 of 2 served requests differ from vLLM's per-step arrays" in capsys.readouterr().err
    failed = check(failed=[0])
    assert cli.exit_status(failed) == 1 and "1 of 2 requests failed (indices 0)" in capsys.readouterr().err
    nothing = compare_with_vllm(logged, []) | {"failed": []}
    assert cli.exit_status(nothing) == 1 and "no request was served" in capsys.readouterr().err
    both = cli.problems(check(spec_b=None, failed=[1]))  # a failed request has no arrays: it differs too
    assert len(both) == 2 and "requests failed" in both[0] and "differ" in both[1]


def test_a_prompt_sent_again_after_its_twin_finished_starts_anew(tmp_path):
    """The proposer's one request table finds a request only from the engine step just before: a finished request's
    last memory never passes to a later request that reaches the same context (the same prompt sent again)."""
    proposer = _proposer(tmp_path, ngram_rule("k"))
    x = np.tile(np.arange(5), 8)
    u, v = np.array([7]), np.array([9])

    def step(*contexts):
        return _step(proposer, list(contexts))

    def memo(context):
        return proposer.history.entries[proposer.history._key(context)][-1]

    step(x)  # request A, first seen
    step(np.concatenate([x, u]))  # A: its block rejected, the target's u committed; then A finishes
    a = memo(np.concatenate([x, u]))
    step(np.arange(100, 140))  # another request's step
    step(x)  # B: the same prompt
    step(np.concatenate([x, u]))
    b = memo(np.concatenate([x, u]))
    assert b is not a
    step(np.concatenate([x, u, v]))
    assert memo(np.concatenate([x, u, v])) is b  # B continues its own memory, not A's
