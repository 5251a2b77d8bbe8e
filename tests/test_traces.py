"""Traces: schema and loading, teacher-forced collection, exact replay of policies, features, resume after a kill,
sampled traces (refused by every replay, ranked in expectation instead)."""

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from omegaconf import OmegaConf
from toys import synthetic_traces

from sacpolicy.data import load_prompts
from sacpolicy.decoding import (
    LayerSkipDrafter,
    ModelDrafter,
    NgramDrafter,
    RequestInfo,
    SamplingConfig,
    SpeculativeDecoder,
)
from sacpolicy.policy import Confidence, Heuristic, Static
from sacpolicy.policy.features import FEATURE_NAMES, token_features
from sacpolicy.profiling import CostModel, PiecewiseLinear
from sacpolicy.runtime.features import FEATURE_NAMES as RUNTIME_FEATURES
from sacpolicy.runtime.features import feature_spec
from sacpolicy.runtime.predictors import Predictor
from sacpolicy.traces.collect import collect_teacher_forced, resolve_shard
from sacpolicy.traces.schema import (
    SCHEMA_VERSION,
    TraceError,
    load_traces,
    read_meta,
    trace_temperature,
    write_meta,
)
from sacpolicy.traces.simulate import (
    Oracle,
    SampledTracesError,
    best_static,
    expected_best_static,
    expected_tokens_per_s,
    group_traces,
    simulate,
)

ROOT = Path(__file__).resolve().parents[1]
V = 49152
N_NEW = 24


def cost_model(names):
    return CostModel(
        device="cpu",
        verify={"tokens": PiecewiseLinear([1, 9], [0.010, 0.014]), "per_context": 1e-6},
        draft={n: PiecewiseLinear([0, 1000], [0.002, 0.003]) for n in names if n != "ngram"}
        | ({"ngram": PiecewiseLinear([0], [0.0002])} if "ngram" in names else {}),
        per_token_draft={n: n != "ngram" for n in names},
    )


@pytest.fixture(scope="module")
def setup(tiny_target, tmp_path_factory):
    prompts = load_prompts("mt_bench", tokenizer=tiny_target.tokenizer, limit=6)
    prompts = list(prompts) + [{"prompt_id": "rep", "category": "writing", "input_ids": [5, 6, 7, 8] * 6}]
    drafters = [LayerSkipDrafter(tiny_target.model, 2, name="skip2"), ModelDrafter(tiny_target.model, name="self"),
                NgramDrafter(name="ngram")]
    out = tmp_path_factory.mktemp("tf")
    collect_teacher_forced(tiny_target, drafters, prompts, out, max_new_tokens=N_NEW, k_max=8,
                           meta={"target": tiny_target.spec}, chunk_size=3, progress=False)
    traces = load_traces(out, kind="teacher_forced", target=tiny_target.spec)
    return prompts, drafters, out, traces


def test_teacher_forced_records(setup):
    prompts, drafters, out, traces = setup
    assert len(traces) == len(prompts) * len(drafters) * N_NEW
    rows = [r for r in traces if r["drafter"] == "self"]
    assert all(r["match"] and r["q_target"] > 0 for r in rows)  # the target drafting for itself always agrees
    assert all(abs(r["beta"] - 1) < 1e-4 for r in rows)
    assert {r["run_len"] for r in rows if r["position"] == 0} == {8}  # capped at k_max
    for r in traces:
        assert 0 <= r["p_target"] <= 1 and 0 <= r["beta"] <= 1 + 1e-5 and 0 <= r["run_len"] <= 8
        assert r["match"] == (r["draft_token"] == r["target_token"])
    meta = json.loads((out / "meta.json").read_text())
    assert meta["schema_version"] == SCHEMA_VERSION == 4 and meta["drafters"] == ["skip2", "self", "ngram"]
    assert meta["target"] == "tiny:llama-4l" and meta["dtype"] == "torch.float32" and meta["device"] == "cpu"
    assert meta["package_version"] and meta["sampling"]["temperature"] == 0.0


@pytest.mark.parametrize("make_policy", [
    lambda: Static(1, "skip2"), lambda: Static(3, "skip2"), lambda: Static(5, "ngram"), lambda: Static(4, "self"),
    lambda: Heuristic(k0=2, drafter="skip2"), lambda: Heuristic(k0=3, drafter="ngram"),
    lambda: Confidence(0.0, k=4, drafter="skip2"), lambda: Confidence(2e-4, k=6, drafter="skip2"),
], ids=["static1", "static3", "ngram5", "self4", "heuristic", "heuristic-ngram", "confidence0", "confidence"])
def test_replay_equals_live_decoding(tiny_target, setup, make_policy):
    """Greedy: simulated target calls and accepted tokens per step equal the live decoder's exactly."""
    prompts, drafters, _, traces = setup
    grouped = group_traces(traces)
    sim = simulate(make_policy(), grouped, cost_model([d.name for d in drafters]), vocab_size=V)
    for row in prompts:
        live = SpeculativeDecoder(tiny_target.model, drafters, make_policy(), stop_token_ids=[]).generate(
            row["input_ids"], N_NEW)
        assert sim.per_prompt[row["prompt_id"]] == (live.target_calls, [s.accepted for s in live.steps])


def test_features_live_equal_features_from_traces(tiny_target, setup):
    prompts, drafters, _, traces = setup
    grouped = group_traces(traces)

    class Recording(Confidence):
        def start(self, request):
            self.prev = None

        def should_stop(self, row, token):
            self.log.append((row.state.generated, token.position, token_features(row.state, token, self.prev)))
            self.prev = token.top1
            return super().should_stop(row, token)

        def observe(self, row, record):
            self.prev = None

    seen = {}
    for drafter in ("skip2",):
        for row in prompts:
            live_pol, sim_pol = Recording(2e-4, k=5, drafter=drafter), Recording(2e-4, k=5, drafter=drafter)
            live_pol.log, sim_pol.log = [], []
            SpeculativeDecoder(tiny_target.model, drafters, live_pol, stop_token_ids=[]).generate(
                row["input_ids"], N_NEW, request=RequestInfo(category=row["category"]))
            simulate(sim_pol, {row["prompt_id"]: grouped[row["prompt_id"]]},
                     cost_model(["skip2", "self", "ngram"]), vocab_size=V)
            runs = grouped[row["prompt_id"]]["drafters"][drafter]["run_len"]
            # positions drafted on the target's own prefix (up to the first mismatch) are the ones traces describe
            valid = lambda log, runs=runs: [(g, j, f) for g, j, f in log if j <= runs[g]]
            a, b = valid(live_pol.log), valid(sim_pol.log)
            assert [(g, j) for g, j, _ in a] == [(g, j) for g, j, _ in b]
            for (_, _, fa), (_, _, fb) in zip(a, b):
                assert len(fa) == len(FEATURE_NAMES)
                assert fa == pytest.approx(fb, rel=1e-4, abs=1e-5)
            seen.setdefault(drafter, []).extend(f for _, _, f in a)
    assert len(seen["skip2"]) > 20


def test_ngram_confidence_is_the_match_length_live_and_replayed(tiny_target, setup):
    """The n-gram drafter's block is one copied span: every token carries the span's matched length / max_ngram,
    live and in replay alike."""
    prompts, drafters, _, traces = setup
    grouped = group_traces(traces)
    drafted = 0
    for row in prompts:
        live = SpeculativeDecoder(tiny_target.model, drafters, Static(4, "ngram"), stop_token_ids=[]).generate(
            row["input_ids"], N_NEW)
        sim = simulate(Static(4, "ngram"), {row["prompt_id"]: grouped[row["prompt_id"]]},
                       cost_model(["skip2", "self", "ngram"]), vocab_size=V).results[0][1]
        flat = lambda steps: [t for s in steps for t in s.top1]
        assert [s.drafted for s in live.steps] == [s.drafted for s in sim.steps]
        assert flat(live.steps) == pytest.approx(flat(sim.steps))
        for s in live.steps:
            drafted += s.drafted
            assert len(set(s.top1)) <= 1 and all(round(t * 3) in (1, 2, 3) for t in s.top1)
    assert drafted > 0


def test_oracle_and_best_static(setup):
    prompts, drafters, _, traces = setup
    grouped = group_traces(traces)
    cost = cost_model([d.name for d in drafters])
    oracle = simulate(Oracle(cost, k_max=8), grouped, cost, vocab_size=V)
    best = best_static(grouped, cost, vocab_size=V, k_max=6)["all"]
    assert oracle.tokens_per_s >= best["tokens_per_s"] > 0
    assert oracle.tokens == sum(N_NEW for _ in prompts)
    per_cat = best_static(grouped, cost, vocab_size=V, k_max=3, by_category=True)
    assert set(per_cat) == {r["category"] for r in prompts}


def test_a_trace_directory_loads_alone_and_as_plain_parquet(setup):
    """``load_traces`` reads the kind from the directory's meta when not told it, and the shards are plain Parquet
    that any reader (here ``datasets``) loads without sacpolicy."""
    prompts, _, out, traces = setup
    ds = load_traces(out)
    assert set(ds["prompt_id"]) == {r["prompt_id"] for r in prompts} and len(ds) == len(traces)
    import datasets

    again = datasets.load_dataset("parquet", data_files=str(out / "*.parquet"), split="train")
    assert len(again) == len(ds) and set(again["prompt_id"]) == set(ds["prompt_id"])


def test_bad_trace_directories(tiny_target, setup, tmp_path):
    _, _, out, _ = setup
    with pytest.raises(TraceError, match="configured target is 'embedded"):
        load_traces(out, target="embedded:smollm2-135m-instruct")
    with pytest.raises(TraceError, match="not a trace directory"):
        load_traces(tmp_path)
    bad = tmp_path / "v0"
    write_meta(bad, {"kind": "live"})
    meta = json.loads((bad / "meta.json").read_text())
    (bad / "meta.json").write_text(json.dumps({**meta, "schema_version": 0}))
    with pytest.raises(TraceError, match=f"schema version 0.*reads version {SCHEMA_VERSION}"):
        load_traces(bad)
    empty = tmp_path / "empty"
    write_meta(empty, {"kind": "live"})
    with pytest.raises(TraceError, match="no trace shards"):
        load_traces(empty)
    # a truncated shard: named in the error, or skipped on request
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(out, broken)
    shard = min(broken.glob("*.parquet"))
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(TraceError, match=shard.name):
        load_traces(broken)
    assert 0 < len(load_traces(broken, skip_corrupt=True)) < len(load_traces(out))
    with pytest.raises(TraceError, match="shard 2/2"):
        resolve_shard("2/2")


def test_shards_cover_the_prompts_once(tiny_target, tmp_path):
    prompts = list(load_prompts("mt_bench", tokenizer=tiny_target.tokenizer, limit=5))
    for i in range(2):
        collect_teacher_forced(tiny_target, [NgramDrafter()], prompts, tmp_path, max_new_tokens=4, shard=f"{i}/2",
                               meta={"target": tiny_target.spec}, progress=False)
    ids = load_traces(tmp_path)["prompt_id"]
    assert sorted(set(ids)) == sorted(r["prompt_id"] for r in prompts) and len(ids) == 5 * 4


COLLECT = """
import sys
from sacpolicy.models import load_model
from sacpolicy.data import load_prompts
from sacpolicy.decoding import LayerSkipDrafter
from sacpolicy.traces.collect import collect_teacher_forced
t = load_model("tiny:llama-4l", device="cpu", dtype="float32")
ps = load_prompts("mt_bench", tokenizer=t.tokenizer, limit=40)
collect_teacher_forced(t, [LayerSkipDrafter(t.model, 2, name="skip2")], ps, sys.argv[1], max_new_tokens=48,
                       meta={"target": t.spec}, chunk_size=2, progress=False)
"""


def test_collection_resumes_after_a_kill(tmp_path):
    def run(out):
        return subprocess.Popen([sys.executable, "-c", COLLECT, str(out)], cwd=ROOT,
                                env={**os.environ, "OMP_NUM_THREADS": "1"})

    proc = run(tmp_path / "killed")
    deadline = time.time() + 300
    while time.time() < deadline and len(list((tmp_path / "killed").glob("*.parquet"))) < 3:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    done = len(list((tmp_path / "killed").glob("*.parquet")))
    assert 3 <= done < 20, "the collection should have been killed midway"
    resumed, clean = run(tmp_path / "killed"), run(tmp_path / "clean")  # side by side
    assert resumed.wait() == 0 and clean.wait() == 0
    key = lambda r: (r["prompt_id"], r["position"])
    resumed = sorted(load_traces(tmp_path / "killed"), key=key)
    clean = sorted(load_traces(tmp_path / "clean"), key=key)
    assert len(resumed) == 40 * 48 and [key(r) for r in resumed] == [key(r) for r in clean]
    assert [r["draft_token"] for r in resumed] == [r["draft_token"] for r in clean]


# ---------------------------------------------------------------------- sampled traces
def test_trace_temperature_from_meta():
    assert trace_temperature({"kind": "teacher_forced", "sampling": {"temperature": 0.7, "top_p": 0.9}}) == 0.7
    assert trace_temperature({"kind": "live", "sampling": {"temperature": 0.0}}) == 0.0
    assert trace_temperature({"kind": "teacher_forced"}) == 0.0  # collect_teacher_forced's default is greedy
    with pytest.raises(TraceError, match="does not record its sampling"):
        trace_temperature({"kind": "live"})


def constant_predictor(p: float = 0.6) -> Predictor:
    F = len(RUNTIME_FEATURES)
    return Predictor("linear", {"mean": np.zeros(F), "scale": np.ones(F), "coef": np.zeros(F),
                                "intercept": np.array([math.log(p / (1 - p))])},
                     meta={"features": feature_spec(), "name": "constant"})


@pytest.fixture(scope="module")
def sampled(tiny_target, tmp_path_factory):
    prompts = load_prompts("mt_bench", tokenizer=tiny_target.tokenizer, limit=3)
    out = tmp_path_factory.mktemp("sampled")
    collect_teacher_forced(tiny_target, [LayerSkipDrafter(tiny_target.model, 2, name="skip2"), NgramDrafter()],
                           prompts, out, max_new_tokens=8, k_max=4, meta={"target": tiny_target.spec},
                           sampling=SamplingConfig(temperature=0.8, seed=1), progress=False)
    return out, group_traces(load_traces(out), read_meta(out))


def test_sampled_traces_are_recorded_and_refused_by_every_replay(setup, sampled):
    out, grouped = sampled
    assert read_meta(out)["sampling"]["temperature"] == 0.8
    assert {p["temperature"] for p in grouped.values()} == {0.8}
    cost = cost_model(["skip2", "ngram"])
    with pytest.raises(SampledTracesError, match=r"simulate .*temperature \[0.8\].*sampling.temperature=0"):
        simulate(Static(2, "skip2"), grouped, cost, vocab_size=V)
    with pytest.raises(SampledTracesError, match="best_static"):
        best_static(grouped, cost, vocab_size=V, k_max=2)
    with pytest.raises(SampledTracesError):
        simulate(Oracle(cost, k_max=4), grouped, cost, vocab_size=V)
    one = {pid: grouped[pid] for pid in list(grouped)[:1]}  # a subset (a split) carries the stamp along
    with pytest.raises(SampledTracesError):
        simulate(Static(1, "ngram"), one, cost, vocab_size=V)
    from sacpolicy.training.predictor import tune_rule

    static = expected_best_static(grouped, cost, k_max=4)["all"]
    assert static["estimate"] == "expected" and static["tokens_per_s"] > 0
    with pytest.raises(SampledTracesError):
        tune_rule(constant_predictor(), cost, grouped, static, vocab_size=V, k_max=4)
    # walking the positions without reading rates (training examples labelled with beta) is allowed explicitly
    assert simulate(Static(2, "skip2"), grouped, cost, vocab_size=V, allow_sampled=True).tokens == 3 * 8
    # greedy traces with their meta replay as before
    _, _, greedy_out, traces = setup
    greedy = group_traces(traces, read_meta(greedy_out))
    assert {p["temperature"] for p in greedy.values()} == {0.0}
    assert simulate(Static(2, "skip2"), greedy, cost_model(["skip2", "self", "ngram"]), vocab_size=V).tokens > 0


def test_expected_tokens_per_s_hand_computed():
    cost = cost_model(["draft"])
    rows = {"beta": [1.0, 1.0, 0.5, 0.5], "proposal_len": [8, 8, 8, 8]}
    grouped = {"p": {"prompt_len": 10, "category": "x", "temperature": 0.7, "drafters": {"draft": rows}}}
    # steps from generated positions 1, 2, 3 (0 is the prefill's token), k=2 capped by the tokens left
    tokens = (1 + 1 + 0.5) + (1 + 0.5 + 0.25) + (1 + 0.5)
    seconds = cost.step_time("draft", 2, 11) + cost.step_time("draft", 2, 12) + cost.step_time("draft", 1, 13)
    assert expected_tokens_per_s(grouped, cost, "draft", 2) == pytest.approx(tokens / seconds)
    rows["proposal_len"][3] = 0  # nothing to propose there: one autoregressive step
    seconds = seconds - cost.step_time("draft", 1, 13) + cost.verify_time(0, 13)
    assert expected_tokens_per_s(grouped, cost, "draft", 2) == pytest.approx((tokens - 0.5) / seconds)


def test_expected_best_static_prefers_the_drafter_accepted_more():
    rows = synthetic_traces(6, length=24, drafters=("good", "bad"))
    for r in rows:
        r["beta"], r["proposal"], r["proposal_len"] = (0.9 if r["drafter"] == "good" else 0.1), False, 8
    grouped = group_traces(rows, {"kind": "teacher_forced", "sampling": {"temperature": 1.0}})
    cost = cost_model(["good", "bad"])
    best = expected_best_static(grouped, cost, k_max=6)["all"]
    assert best["drafter"] == "good" and best["k"] > 1
    assert best["tokens_per_s"] == pytest.approx(expected_tokens_per_s(grouped, cost, "good", best["k"]))
    per_cat = expected_best_static(grouped, cost, k_max=2, by_category=True)
    assert set(per_cat) == {r["category"] for r in rows}


def test_fit_stage_skips_rule_tuning_on_sampled_traces(caplog):
    """Fit on sampled traces: the untuned rule with the static fallback, and why; on greedy traces: tuned by replay."""
    from sacpolicy.pipeline.fit import decision_rule

    rows = synthetic_traces(12, length=16, drafters=("draft",))
    cfg = OmegaConf.create({"fit": {"k_max": 4}, "decoder": {"_target_": "sacpolicy.decoding.DecoderConfig"}})
    cost, static = cost_model(["draft"]), {"drafter": "draft", "k": 3, "tokens_per_s": 1.0}
    for temperature in (0.7, 0.0):
        grouped = group_traces(rows, {"kind": "teacher_forced", "sampling": {"temperature": temperature}})
        ctx = SimpleNamespace(cfg=cfg, cost=cost, vocab_size=1000, soft_labels=temperature > 0,
                              traces=(grouped, {"val": grouped}, None, None))
        with caplog.at_level("WARNING", logger="sacpolicy.pipeline.fit"):
            rule, tuning = decision_rule(ctx, "const", constant_predictor(), static)
        assert rule.fallback == ("draft", 3) and rule.drafters == ("draft",) and rule.k_max == 4
        if temperature:
            assert tuning["grid"] == [] and "sampled" in tuning["skipped"] and (rule.mode, rule.optimism) == ("stop", 1.0)
            assert "not tuned" in caplog.text
        else:
            assert len(tuning["grid"]) > 1 and "skipped" not in tuning
