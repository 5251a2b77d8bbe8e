"""Traces: schema and loading, teacher-forced collection, exact replay of policies, features, resume after a kill,
sampled traces (beta of the processed distributions, replayed in expectation over seeded draws)."""

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
import torch
from omegaconf import OmegaConf
from toys import synthetic_traces

from sacpolicy.data import load_prompts
from sacpolicy.decoding import (
    DecoderConfig,
    LayerSkipDrafter,
    ModelDrafter,
    NgramDrafter,
    RequestInfo,
    SamplingConfig,
    SpeculativeDecoder,
)
from sacpolicy.decoding.sampling import probs_from_logits
from sacpolicy.policy import Confidence, Heuristic, Static
from sacpolicy.policy.features import FEATURE_NAMES, token_features
from sacpolicy.profiling import CostModel, PiecewiseLinear
from sacpolicy.runtime.features import FEATURE_NAMES as RUNTIME_FEATURES
from sacpolicy.runtime.features import feature_spec
from sacpolicy.runtime.predictors import Predictor, PredictorError
from sacpolicy.traces.collect import collect_teacher_forced, resolve_shard, teacher_forced_rows
from sacpolicy.traces.draws import DRAWS
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
    simulate_batch,
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
    assert meta["schema_version"] == SCHEMA_VERSION == 5 and meta["drafters"] == ["skip2", "self", "ngram"]
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
    drafted, stats = 0, DecoderConfig(step_stats=True)
    for row in prompts:
        live = SpeculativeDecoder(tiny_target.model, drafters, Static(4, "ngram"), config=stats,
                                  stop_token_ids=[]).generate(row["input_ids"], N_NEW)
        sim = simulate(Static(4, "ngram"), {row["prompt_id"]: grouped[row["prompt_id"]]},
                       cost_model(["skip2", "self", "ngram"]), vocab_size=V, config=stats).results[0][1]
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


def test_two_shards_merge_to_the_rows_of_one_process_and_a_missing_shard_is_named(tiny_target, tmp_path):
    from sacpolicy.traces.shards import MANIFEST, merge_shards

    prompts = list(load_prompts("mt_bench", tokenizer=tiny_target.tokenizer, limit=5))
    drafters = [NgramDrafter(), LayerSkipDrafter(tiny_target.model, 2, name="skip2")]

    def collect(out, shard):
        collect_teacher_forced(tiny_target, drafters, prompts, out, max_new_tokens=6, shard=shard, chunk_size=2,
                               meta={"target": tiny_target.spec}, progress=False)

    collect(tmp_path / "one", None)  # one process: its manifest merged at once
    one = json.loads((tmp_path / "one" / MANIFEST).read_text())
    assert one["shards"] == 1 and one["prompts"] == 5
    collect(tmp_path / "two", "1/2")
    with pytest.raises(TraceError, match=r"misses shard\(s\) 0/2 \(s000of002.json\)"):
        merge_shards(tmp_path / "two")
    collect(tmp_path / "two", "0/2")
    merged = merge_shards(tmp_path / "two")
    assert (merged["shards"], merged["rows"], merged["prompts"]) == (2, one["rows"], 5)

    def rows(d):
        return sorted(map(tuple, load_traces(d).to_pandas().astype(str).values.tolist()))

    assert rows(tmp_path / "two") == rows(tmp_path / "one")  # exactly the same rows
    # a chunk that is not the file its shard wrote is refused
    chunk = min((tmp_path / "two").glob("s001*.parquet"))
    chunk.write_bytes(next((tmp_path / "one").glob("*.parquet")).read_bytes())
    with pytest.raises(TraceError, match=f"{chunk.name} of shard 1/2"):
        merge_shards(tmp_path / "two")


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


def test_sampled_traces_are_recorded_and_replayed_in_expectation(setup, sampled):
    out, grouped = sampled
    assert read_meta(out)["sampling"]["temperature"] == 0.8 and read_meta(out)["beta"] == "processed"
    assert {p["temperature"] for p in grouped.values()} == {0.8}
    assert {p["draws"] for p in grouped.values()} == {DRAWS}
    cost = cost_model(["skip2", "ngram"])
    sim = simulate(Static(2, "skip2"), grouped, cost, vocab_size=V)
    assert sim.tokens == DRAWS * 3 * 8 and sim.tokens_per_s > 0  # every draw of every prompt, merged per prompt
    assert [r.draws for _, r in sim.results] == [DRAWS] * 3
    assert simulate(Static(2, "skip2"), grouped, cost, vocab_size=V).per_prompt == sim.per_prompt  # seeded draws
    best = best_static(grouped, cost, vocab_size=V, k_max=2)["all"]
    oracle = simulate(Oracle(cost, k_max=4), grouped, cost, vocab_size=V)
    assert oracle.tokens_per_s >= best["tokens_per_s"] > 0  # the oracle knows each draw's outcomes
    one = {pid: grouped[pid] for pid in list(grouped)[:1]}  # a prompt replays alike alone and among others
    pid = next(iter(one))
    assert simulate(Static(1, "ngram"), one, cost, vocab_size=V).per_prompt[pid] == simulate(
        Static(1, "ngram"), grouped, cost, vocab_size=V).per_prompt[pid]
    from sacpolicy.training.predictor import tune_rule

    _, tuning = tune_rule(constant_predictor(), cost, grouped, best, vocab_size=V, k_max=4)
    assert len(tuning["grid"]) > 1 and all(r["val_tokens_per_s"] > 0 for r in tuning["grid"])
    with pytest.raises(SampledTracesError, match=r"simulate_batch replays greedy traces only.*temperature \[0.8\]"):
        simulate_batch(Static(2, "skip2"), grouped, cost, vocab_size=V, max_batch=1)
    # greedy traces with their meta replay as before
    _, _, greedy_out, traces = setup
    greedy = group_traces(traces, read_meta(greedy_out))
    assert {p["temperature"] for p in greedy.values()} == {0.0}
    assert simulate(Static(2, "skip2"), greedy, cost_model(["skip2", "self", "ngram"]), vocab_size=V).tokens > 0


def test_sampled_beta_is_computed_on_the_processed_distributions(tiny_target):
    """With top-p (and temperature) the traces' p, q and beta are the warped distributions verification accepts with,
    for a model drafter (sum min(p, q)) and a copying one (p of its token)."""
    prompt = {"prompt_id": "p", "category": "writing", "input_ids": [5, 6, 7, 8, 5, 6, 7, 8, 5, 6]}
    generated = [7, 8, 5, 6, 7, 9]
    cfg = SamplingConfig(temperature=0.7, top_p=0.9)
    logits = torch.randn(len(generated), V, generator=torch.Generator().manual_seed(0)) * 3
    skip, ngram = LayerSkipDrafter(tiny_target.model, 2, name="skip2"), NgramDrafter(name="ngram")
    rows = teacher_forced_rows(tiny_target, [skip, ngram], prompt, generated, 4, target_logits=logits, sampling=cfg)
    ids = torch.tensor(prompt["input_ids"] + generated)
    p = probs_from_logits(logits, cfg)
    q = probs_from_logits(skip.teacher_force(ids, len(prompt["input_ids"]), 4).logits.float(), cfg)
    by = {(r["drafter"], r["position"]): r for r in rows}
    for g, tok in enumerate(generated):
        assert by["skip2", g]["beta"] == pytest.approx(float(torch.minimum(p[g], q[g]).sum()), abs=1e-5)
        assert by["skip2", g]["p_target"] == pytest.approx(float(p[g, tok]), abs=1e-6)
        first = by["ngram", g]["draft_token"]
        assert by["ngram", g]["beta"] == pytest.approx(float(p[g, first]) if first >= 0 else 0.0, abs=1e-6)
    assert (p == 0).any()  # top-p did cut the tail
    greedy = teacher_forced_rows(tiny_target, [skip], prompt, generated, 4, target_logits=logits)
    p1 = probs_from_logits(logits, SamplingConfig(temperature=1.0))
    assert greedy[0]["p_target"] == pytest.approx(float(p1[0, generated[0]]), abs=1e-6)  # greedy: temperature 1


def _hand_sampled(betas: dict, length: int, k_max: int = 8, temperature: float = 1.0, draws: int = DRAWS) -> dict:
    """Grouped sampled traces of one prompt: per drafter (name -> beta per position; a token-by-token drafter), the
    recorded tokens all drafted right (run_len as long as the rest), certain confidence."""
    rows = []
    for name, beta in betas.items():
        for g in range(length):
            rows.append({"prompt_id": "hand", "category": "writing", "prompt_len": 16, "drafter": name, "position": g,
                         "target_token": 3 + g % 50, "draft_token": 3 + g % 50, "match": True, "top1": 0.9,
                         "entropy": 0.3, "margin": 0.8, "p_target": 0.5, "q_target": 0.5, "beta": beta[g],
                         "run_len": min(k_max, length - g), "proposal_len": k_max, "proposal": False})
    meta = {"kind": "teacher_forced", "sampling": {"temperature": temperature, "top_p": 1.0}, "beta": "processed"}
    return group_traces(rows, meta, draws=draws)


def test_expected_replay_accepts_as_the_product_of_betas():
    """beta 0.5 everywhere, static k = 2: a block accepts its first token with probability 0.5 and both with 0.25, so
    0.75 accepted tokens per block on average, and 1.75 tokens per target call; the rate is the closed form's."""
    length, draws = 400, 8
    grouped = _hand_sampled({"draft": [0.5] * length}, length, draws=draws)
    cost = cost_model(["draft"])
    sim = simulate(Static(2, "draft"), grouped, cost, vocab_size=1000)
    blocks = [s for _, r in sim.results for s in r.steps if s.drafted == 2]
    assert len(blocks) > 1500
    sd = (0.6875 / len(blocks)) ** 0.5  # accepted: 0, 1, 2 with probabilities 0.5, 0.25, 0.25
    mean = sum(s.accepted for s in blocks) / len(blocks)
    assert mean == pytest.approx(0.75, abs=4 * sd)
    assert sum(s.emitted for s in blocks) / len(blocks) == pytest.approx(1.75, abs=4 * sd)
    shares = [sum(s.accepted == a for s in blocks) / len(blocks) for a in (0, 1, 2)]
    assert shares == pytest.approx([0.5, 0.25, 0.25], abs=0.04)
    assert sim.tokens_per_s == pytest.approx(expected_tokens_per_s(grouped, cost, "draft", 2), rel=0.03)
    # later tokens of a block read the betas ahead of it: 1, 0, 1, 0, ... accepts one token from an even position
    alternating = _hand_sampled({"draft": [float(g % 2 == 0) for g in range(40)]}, 40)
    steps = simulate(Static(3, "draft"), alternating, cost, vocab_size=1000).results[0][1].steps
    assert all(s.accepted == (1 if s.context_len % 2 == 0 else 0) for s in steps if s.drafted)  # prompt_len 16


@pytest.mark.parametrize("make_policy", [lambda: Static(3, "draft"), lambda: Confidence(0.5, k=6, drafter="draft"),
                                         lambda: Heuristic(k0=2, drafter="ngram")], ids=["static", "confidence",
                                                                                          "heuristic-ngram"])
def test_expected_replay_of_certain_acceptances_is_the_greedy_replay(make_policy):
    """beta 1 where the greedy traces match and 0 where they do not (and the copying drafter's matched tokens certain):
    every draw is the greedy replay, step for step, the stop rule reading the same recorded confidence."""
    rows = synthetic_traces(6, length=32, drafters=("draft", "ngram"))
    for r in rows:
        r["beta"], r["p_target"] = float(r["match"]), 1.0
    greedy = group_traces(rows)
    sampled = group_traces(rows, {"kind": "teacher_forced", "sampling": {"temperature": 0.7}, "beta": "processed"},
                           draws=3)
    cost = cost_model(["draft", "ngram"])
    exact, expected = (simulate(make_policy(), g, cost, vocab_size=1000) for g in (greedy, sampled))
    for pid, (calls, accepted) in exact.per_prompt.items():
        assert expected.per_prompt[pid] == (3 * calls, accepted * 3)
    assert expected.tokens_per_s == pytest.approx(exact.tokens_per_s)
    assert any(a for _, acc in exact.per_prompt.values() for a in acc)


def test_training_examples_of_sampled_traces_carry_their_acceptance_probability():
    """Soft labels: a drafted position's label is its acceptance probability (beta of its own position for a
    token-by-token drafter), on the positions one draw reaches."""
    from sacpolicy.training.predictor import acceptance_examples

    length = 60
    beta = [0.2 + 0.6 * (g % 3 == 0) for g in range(length)]
    grouped = _hand_sampled({"draft": beta}, length)
    ex = acceptance_examples(grouped, cost_model(["draft"]), vocab_size=1000, k=4, soft=True)
    known = ex.of(ex.split[0], "known")  # one prompt: one split
    assert len(known) and set(np.round(known.y, 6)) <= {0.2, 0.8}
    with pytest.raises(PredictorError, match="need sampled traces"):
        acceptance_examples(group_traces(synthetic_traces(2, drafters=("draft",))), cost_model(["draft"]),
                            vocab_size=1000, k=4, soft=True)


def test_predictor_calibration_on_beta_labels_compares_mean_prediction_and_mean_beta():
    """A constant prediction of 0.6 against beta labels averaging 0.6 is calibrated, against labels averaging 0.4 off
    by 0.2, as a reliability diagram of 0/1 labels would say of the same rates."""
    from sacpolicy.training.predictor import Examples, predictor_metrics

    n = 400
    X = np.zeros((n, len(RUNTIME_FEATURES)))

    def examples(y):
        return Examples(X, np.asarray(y), *(np.array(["x"] * n) for _ in range(5)))

    pred = constant_predictor(0.6)
    assert predictor_metrics(pred, examples([0.5, 0.7] * (n // 2)))["ece"] == pytest.approx(0.0, abs=1e-9)
    assert predictor_metrics(pred, examples([0.3, 0.5] * (n // 2)))["ece"] == pytest.approx(0.2, abs=1e-9)


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


def test_fit_stage_tunes_the_rule_on_sampled_traces_in_expectation():
    """Fit tunes the rule by replay on both kinds of traces: exactly on greedy ones, in expectation on sampled ones,
    and the tuning table says which."""
    from sacpolicy.pipeline.context import RunTraces
    from sacpolicy.pipeline.fit import decision_rule

    rows = synthetic_traces(12, length=16, drafters=("draft",))
    cfg = OmegaConf.create({"fit": {"k_max": 4}, "decoder": {"_target_": "sacpolicy.decoding.DecoderConfig"}})
    cost, static = cost_model(["draft"]), {"drafter": "draft", "k": 3, "tokens_per_s": 1.0}
    for temperature in (0.7, 0.0):
        grouped = group_traces(rows, {"kind": "teacher_forced", "sampling": {"temperature": temperature},
                                      "beta": "processed"}, draws=2)
        ctx = SimpleNamespace(cfg=cfg, cost=cost, vocab_size=1000, soft_labels=temperature > 0,
                              traces=RunTraces(grouped, {"val": grouped}, None, None))
        rule, tuning = decision_rule(ctx, "const", constant_predictor(), static)
        assert rule.fallback == ("draft", 3) and rule.drafters == ("draft",) and rule.k_max == 4
        assert len(tuning["grid"]) > 1 and "skipped" not in tuning
        assert tuning["replay"].startswith("expected (sampled traces, temperature 0.7: 2 seeded draws" if temperature
                                           else "exact")
