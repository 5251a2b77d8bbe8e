"""Traces: schema and loading, teacher-forced collection, exact replay of policies, features, resume after a kill."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sacpolicy.data import load_prompts
from sacpolicy.decoding import (
    LayerSkipDrafter,
    ModelDrafter,
    NgramDrafter,
    RequestInfo,
    SpeculativeDecoder,
)
from sacpolicy.policy import Confidence, Heuristic, Static
from sacpolicy.policy.features import FEATURE_NAMES, token_features
from sacpolicy.profiling import CostModel, PiecewiseLinear
from sacpolicy.traces.collect import collect_live, collect_teacher_forced, resolve_shard
from sacpolicy.traces.schema import SCHEMA_VERSION, TraceError, load_traces, write_meta
from sacpolicy.traces.simulate import Oracle, best_static, group_traces, simulate

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
    assert meta["schema_version"] == SCHEMA_VERSION == 3 and meta["drafters"] == ["skip2", "self", "ngram"]
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
        def reset(self, request):
            self.prev = None

        def should_stop(self, state, token):
            self.log.append((state.generated, token.position, token_features(state, token, self.prev)))
            self.prev = token.top1
            return super().should_stop(state, token)

        def observe(self, record):
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
            valid = lambda log: [(g, j, f) for g, j, f in log if j <= runs[g]]  # noqa: E731
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
        flat = lambda steps: [t for s in steps for t in s.top1]  # noqa: E731
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


def test_live_collection_and_loading(tiny_target, tmp_path):
    prompts = list(load_prompts("mt_bench", tokenizer=tiny_target.tokenizer, limit=3))
    dec = SpeculativeDecoder(tiny_target.model, [NgramDrafter()], Static(3), stop_token_ids=[])
    collect_live(dec, prompts, tmp_path, max_new_tokens=12, meta={"target": tiny_target.spec}, progress=False)
    ds = load_traces(tmp_path)
    assert set(ds["prompt_id"]) == {r["prompt_id"] for r in prompts}
    assert sum(r["emitted"] for r in ds) + len(prompts) == 12 * len(prompts)
    import datasets

    again = datasets.load_dataset("parquet", data_files=str(tmp_path / "*.parquet"), split="train")
    assert len(again) == len(ds)


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
    shard = sorted(broken.glob("*.parquet"))[0]
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
    assert run(tmp_path / "killed").wait() == 0
    assert run(tmp_path / "clean").wait() == 0
    key = lambda r: (r["prompt_id"], r["position"])  # noqa: E731
    resumed = sorted(load_traces(tmp_path / "killed"), key=key)
    clean = sorted(load_traces(tmp_path / "clean"), key=key)
    assert len(resumed) == 40 * 48 and [key(r) for r in resumed] == [key(r) for r in clean]
    assert [r["draft_token"] for r in resumed] == [r["draft_token"] for r in clean]
