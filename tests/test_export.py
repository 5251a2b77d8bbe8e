"""Policy artifacts and their exports: save/load with checksums and exact parity in a numpy-only process, bad
artifacts, sacpolicy drafters rebuilt from specs, transformers' assisted generation, the vLLM config and proposer,
the command line."""

import dataclasses
import hashlib
import json
import os
import subprocess
import sys
from importlib.util import find_spec
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from test_traces import cost_model
from toys import PREDICTORS, Markov, load_script, ngram_rule, propose_one, synthetic_traces

from sacpolicy.build import artifact_specs, build_drafters
from sacpolicy.data import assign_split
from sacpolicy.decoding import (
    DecodeState,
    ModelDrafter,
    NgramDrafter,
    PolicyRow,
    RequestInfo,
    SamplingConfig,
    SpeculativeDecoder,
)
from sacpolicy.decoding.controller import stop_callback
from sacpolicy.export import (
    confidence_threshold,
    reference_row,
    static_k,
)
from sacpolicy.export.hf import export_generation_config, generate_with_policy
from sacpolicy.export.vllm import (
    PolicyProposer,
    learned_config,
    speculative_config,
    write_vllm_config,
)
from sacpolicy.policy.learned import LearnedPolicy
from sacpolicy.runtime import (
    FEATURE_NAMES,
    FEATURE_VERSION,
    ArtifactError,
    Block,
    DecisionRule,
    Predictor,
    feature_spec,
    load_artifact,
    load_policy,
    save_policy,
)
from sacpolicy.runtime.ngram import ngram_proposal
from sacpolicy.traces.simulate import best_static, group_traces
from sacpolicy.training.predictor import acceptance_examples, fit_predictor, tune_rule

V, K_MAX, F = 1000, 8, len(FEATURE_NAMES)
DRAFTERS = ("draft", "ngram")
ROOT = Path(__file__).resolve().parents[1]

# The decisions compared between the in-memory rule and the artifact loaded in a numpy-only process: plan() over
# windows of test plan rows (varying caps), stop() over the test blocks in order, raw and calibrated predictions.
DECIDE = r'''
def decide(rule, d):
    import numpy as np
    from sacpolicy.runtime import Block
    plans = []
    for b in range(len(d["plan_draft"])):
        rows = {"draft": d["plan_draft"][b], "ngram": d["plan_ngram"][b]}
        name, k = rule.plan(rows, int(d["plan_ctx"][b]), 1 + b % rule.k_max)
        plans.append((rule.drafters.index(name) if name is not None else -1, k))
    stops, block = [], None
    for row, nxt, pos, drafter, ctx in zip(d["known"], d["next"], d["position"], d["stop_drafter"], d["stop_ctx"]):
        if pos == 0:
            block = Block(rule.drafters[drafter], int(ctx), rule.k_max)
        stops.append(rule.stop(block, row, nxt))
    return {"plans": np.array(plans), "stops": np.array(stops), "raw": rule.predictor.raw(d["X"]),
            "pred": rule.predictor.predict(d["X"])}
'''
CHILD = DECIDE + r'''
import sys
import numpy as np
from sacpolicy.runtime import load_policy
rule = load_policy(sys.argv[1])
out = decide(rule, dict(np.load(sys.argv[2])))
heavy = [m for m in ("torch", "sklearn", "lightning", "transformers") if m in sys.modules]
assert not heavy, f"the runtime imported {heavy}"
np.savez(sys.argv[3], **out)
'''


# ---------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def draft_dir(tiny_draft, tmp_path_factory):
    d = tmp_path_factory.mktemp("draft") / "draft"
    tiny_draft.model.save_pretrained(d)
    tiny_draft.tokenizer.save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def synth():
    grouped = group_traces(synthetic_traces(90, drafters=DRAFTERS))
    cost = cost_model(list(DRAFTERS))
    val = {p: v for p, v in grouped.items() if assign_split(p) == "val"}
    return val, cost, acceptance_examples(grouped, cost, vocab_size=V, k=K_MAX)


@pytest.fixture(scope="module")
def fitted(synth, draft_dir, tmp_path_factory):
    """name -> (rule, predictor metrics, artifact dir) for hgb, logreg and mlp."""
    val, cost, ex = synth
    out, static = {}, best_static(val, cost, vocab_size=V, k_max=K_MAX)["all"]
    for name, spec in PREDICTORS.items():
        pred, metrics = fit_predictor(name, spec, ex, out_dir=tmp_path_factory.mktemp(f"fit_{name}"))
        # one simulated candidate each (tune_rule's grid search is tested in test_policy): export does not care
        # which mode wins, and the grid cost 25 s of this module's 50 s set-up
        rule, tuning = tune_rule(pred, cost, val, static, vocab_size=V, k_max=K_MAX, modes=("stop",), optimism=(1.0,))
        path = save_policy(tmp_path_factory.mktemp("policies") / name, rule,
                           drafters={"draft": {"kind": "model", "path": str(draft_dir)},
                                     "ngram": {"kind": "ngram", "max_ngram": 3}},
                           provenance={"target": "tiny:llama-4l", "traces": ["synthetic"]},
                           metrics={"predictor": metrics, "tuning": tuning})
        out[name] = (rule, metrics, path)
    return out


def _constant_rule(logit: float, mode: str = "k", k_max: int = 2, drafters=("draft",), coef=None) -> DecisionRule:
    """A rule whose predictor says sigmoid(logit + coef . features) (unknown features count 0)."""
    pred = Predictor("linear", {"mean": np.zeros(F), "scale": np.ones(F),
                                "coef": np.zeros(F) if coef is None else coef, "intercept": np.array([logit])},
                     {"features": feature_spec()})
    return DecisionRule(pred, cost_model(list(drafters)), drafters, k_max, (drafters[0], 1), mode)


def _same_rule(a: DecisionRule, b: DecisionRule) -> bool:
    pa, pb = a.predictor, b.predictor
    return (a.config() == b.config() and a.cost.to_dict() == b.cost.to_dict() and pa.kind == pb.kind
            and json.dumps(pa.meta) == json.dumps(pb.meta) and pa.arrays.keys() == pb.arrays.keys()
            and all(pa.arrays[k].dtype == pb.arrays[k].dtype and np.array_equal(pa.arrays[k], pb.arrays[k])
                    for k in pa.arrays))


def _copy(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


# ---------------------------------------------------------------------- artifact
def test_artifact_layout(fitted, draft_dir):
    for name, (rule, metrics, path) in fitted.items():
        m = json.loads((path / "policy.json").read_text())
        assert m["format_version"] == 1 and m["feature"] == feature_spec()
        assert m["predictor"]["kind"] == rule.predictor.kind and m["predictor"]["meta"]["name"] == name
        assert m["rule"] == rule.config() and m["cost_model"] == rule.cost.to_dict()
        assert m["drafters"] == {"draft": {"kind": "model", "path": str(draft_dir.resolve())},
                                 "ngram": {"kind": "ngram", "max_ngram": 3, "min_ngram": 1}}
        assert {"target", "traces", "created", "sacpolicy", "git_commit", "command"} <= set(m["provenance"])
        assert m["metrics"]["predictor"]["test"]["n"] == metrics["test"]["n"]
        files = {f.name for f in path.iterdir()} - {"policy.json"}
        assert set(m["checksums"]) == files
        assert ("predictor.onnx" in files) == (name == "mlp")  # onnx is in the dev extras
        for f in files:
            assert m["checksums"][f] == hashlib.sha256((path / f).read_bytes()).hexdigest()
        assert [p.name for p in path.parent.iterdir()] == [name]  # no temporary siblings left
        art = load_artifact(path)
        assert _same_rule(art.rule, rule) and art.provenance == m["provenance"]
        assert {n: s.to_dict() for n, s in art.drafters.items()} == m["drafters"]  # DrafterSpec round trip


@pytest.mark.parametrize("name", list(PREDICTORS))
def test_loaded_rule_decides_exactly_as_in_memory_without_torch(fitted, synth, name, tmp_path):
    rule, _, path = fitted[name]
    _, _, ex = synth
    test = ex.of("test")
    plan = {d: test.X[(test.form == "plan") & (test.drafter == d)] for d in DRAFTERS}
    n = min(len(p) for p in plan.values()) // K_MAX
    known = test.form == "known"
    data = {
        "plan_draft": plan["draft"][: n * K_MAX].reshape(n, K_MAX, F),
        "plan_ngram": plan["ngram"][: n * K_MAX].reshape(n, K_MAX, F),
        "plan_ctx": np.rint(np.expm1(plan["draft"][: n * K_MAX : K_MAX, FEATURE_NAMES.index("log_context_len")])),
        "known": test.X[known], "next": test.X[test.form == "next"], "position": test.position[known],
        "stop_drafter": np.array([rule.drafters.index(d) for d in test.drafter[known]]),
        "stop_ctx": np.rint(np.expm1(test.X[known, FEATURE_NAMES.index("log_context_len")])),
        "X": test.X,
    }
    assert n > 10 and data["known"].shape == data["next"].shape and np.isnan(data["X"]).any()
    np.savez(tmp_path / "rows.npz", **data)
    subprocess.run([sys.executable, "-c", CHILD, str(path), str(tmp_path / "rows.npz"), str(tmp_path / "out.npz")],
                   check=True, cwd=ROOT, capture_output=True)
    ns = {}
    exec(DECIDE, ns)
    expected, got = ns["decide"](dataclasses.replace(rule), data), np.load(tmp_path / "out.npz")
    for key in ("plans", "stops", "raw", "pred"):
        assert np.array_equal(expected[key], got[key]), key
    assert len(set(map(tuple, got["plans"]))) > 1 and 0 < got["stops"].mean() < 1  # decisions that vary
    assert np.array_equal(got["pred"], rule.predictor.predict(data["X"]))


def test_compiled_hgb_matches_sklearn(fitted, synth):
    rule, _, _ = fitted["hgb"]
    X = synth[2].of("test").X
    assert np.isnan(X).any()  # missing values take sklearn's learned direction
    expected = PREDICTORS["hgb"].keywords["estimator"].predict_proba(X)[:, 1]
    np.testing.assert_allclose(load_policy(fitted["hgb"][2]).predictor.raw(X), expected, rtol=0, atol=1e-9)


def test_onnx_mlp_matches_the_runtime(fitted, synth):
    from onnx.reference import ReferenceEvaluator  # a dev extra: a missing onnx fails here rather than skipping

    rule, _, path = fitted["mlp"]
    X = synth[2].of("test").X
    (p_raw,) = ReferenceEvaluator(str(path / "predictor.onnx")).run(None, {"features": X})
    np.testing.assert_allclose(p_raw[:, 0], rule.predictor.raw(X), rtol=0, atol=1e-12)


def test_an_mlp_artifact_without_onnx_installed_has_no_onnx_file_and_loads(fitted, tmp_path, monkeypatch):
    import sacpolicy.runtime.artifact as artifact

    monkeypatch.setattr(artifact, "find_spec", lambda name: None if name == "onnx" else find_spec(name))
    rule, _, _ = fitted["mlp"]
    drafters = {"draft": {"kind": "model", "path": "tiny:llama-1l"}, "ngram": {"kind": "ngram"}}
    path = save_policy(tmp_path / "p", rule, drafters=drafters, provenance={}, metrics={})
    assert {f.name for f in path.iterdir()} == {"policy.json", "predictor.safetensors"}
    assert _same_rule(load_artifact(path).rule, rule)


def test_saving_again_replaces_the_artifact_atomically(fitted, tmp_path):
    rule, _, _ = fitted["logreg"]
    drafters = {"draft": {"kind": "model", "path": "tiny:llama-1l"}, "ngram": {"kind": "ngram"}}
    path = save_policy(tmp_path / "p", rule, drafters=drafters, provenance={}, metrics={"v": 1})
    save_policy(path, rule, drafters=drafters, provenance={}, metrics={"v": np.int64(2)})
    assert load_artifact(path).metrics == {"v": 2} and [p.name for p in tmp_path.iterdir()] == ["p"]
    # a failed save leaves the previous artifact as it was and nothing half-written beside it
    with pytest.raises(ArtifactError, match="JSON"):
        save_policy(path, rule, drafters=drafters, provenance={}, metrics={"v": object()})
    assert load_artifact(path).metrics == {"v": 2} and [p.name for p in tmp_path.iterdir()] == ["p"]
    with pytest.raises(ArtifactError, match="JSON"):
        save_policy(tmp_path / "q", rule, drafters=drafters, provenance={"when": object()}, metrics={})
    assert [p.name for p in tmp_path.iterdir()] == ["p"]


@pytest.mark.parametrize("drafters, match", [
    ({"draft": {"kind": "model", "path": "x"}}, "exactly one spec per drafter"),
    ({"draft": {"kind": "gguf", "path": "x"}, "ngram": {"kind": "ngram"}}, "kinds are"),
    ({"draft": {"kind": "model"}, "ngram": {"kind": "ngram"}}, "needs \\['path'\\]"),
    ({"draft": {"kind": "model", "path": "x"}, "ngram": {"kind": "ngram", "n": 3}}, "may have"),
])
def test_bad_drafter_specs_are_refused_before_writing(fitted, tmp_path, drafters, match):
    with pytest.raises(ArtifactError, match=match):
        save_policy(tmp_path / "p", fitted["logreg"][0], drafters=drafters, provenance={}, metrics={})
    assert list(tmp_path.iterdir()) == []


def test_bad_artifacts_are_refused_with_the_fix(fitted, tmp_path):
    src = fitted["logreg"][2]
    tampered = _copy(src, tmp_path / "tampered")
    data = bytearray((tampered / "predictor.safetensors").read_bytes())
    data[-3] ^= 0xFF
    (tampered / "predictor.safetensors").write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match="checksum mismatch for .*predictor.safetensors.*modified or truncated"):
        load_policy(tampered)

    def edited(name, change):
        d = _copy(src, tmp_path / name)
        m = json.loads((d / "policy.json").read_text())
        change(m)
        (d / "policy.json").write_text(json.dumps(m))
        return d

    with pytest.raises(ArtifactError, match="format version 99; this runtime reads format version 1.*upgrade"):
        load_policy(edited("newer", lambda m: m.update(format_version=99)))
    newer = f"feature spec version 1 .*this runtime computes version {FEATURE_VERSION}"
    with pytest.raises(ArtifactError, match=newer):
        load_policy(edited("features", lambda m: m["feature"].update(version=1)))
    with pytest.raises(ArtifactError, match="re-export"):
        load_policy(edited("broken", lambda m: m["rule"].pop("k_max")))
    missing = _copy(src, tmp_path / "missing")
    (missing / "predictor.safetensors").unlink()
    with pytest.raises(ArtifactError, match="lacks predictor.safetensors"):
        load_policy(missing)
    with pytest.raises(ArtifactError, match="policy.json is missing"):
        load_policy(tmp_path / "nowhere")
    (missing / "policy.json").write_text("{not json")
    with pytest.raises(ArtifactError, match="not valid JSON"):
        load_policy(missing)


def test_artifact_records_the_sampling_it_was_fitted_for_and_the_policy_warns_once_elsewhere(tmp_path, caplog):
    """The pipeline's fit records the traces' temperature and top_p in the predictor's meta; the artifact gives them
    back, and a learned policy decoding at other settings (a decoder's own, or a request's) warns once. Artifacts that
    do not record them (older ones) load and decode without a word."""
    rule = _constant_rule(0.0, k_max=2, drafters=("ngram",))
    rule.predictor.meta.update(fitted_temperature=0.7, fitted_top_p=0.9)
    art = load_artifact(save_policy(tmp_path / "p", rule, drafters={"ngram": {"kind": "ngram"}}, provenance={},
                                    metrics={}))
    assert art.fitted_sampling == {"temperature": 0.7, "top_p": 0.9}
    assert art.rule.sampling_mismatch(0.7, 0.9) is None and art.rule.sampling_mismatch(0.74, 0.88) is None
    assert "decodes greedy" in art.rule.sampling_mismatch(0.0)
    assert "decodes temperature 0.8, top_p 0.9" in art.rule.sampling_mismatch(0.8, 0.9)
    assert "decodes temperature 0.7, top_p 1" in art.rule.sampling_mismatch(0.7, 1.0)
    policy = LearnedPolicy(art.rule)
    with caplog.at_level("WARNING", logger="sacpolicy.policy.learned"):
        for t in (0.7, 1.0, 1.0, 0.0):
            policy.start(RequestInfo(sampling=SamplingConfig(temperature=t, top_p=0.9)))
    warned = [r for r in caplog.records if r.name == "sacpolicy.policy.learned"]
    assert len(warned) == 1 and "fitted on traces decoded temperature 0.7, top_p 0.9, but decodes temperature 1" in (
        warned[0].getMessage())
    caplog.clear()
    logp = torch.log_softmax(torch.randn(16, 16, generator=torch.Generator().manual_seed(0)), -1)
    with caplog.at_level("WARNING", logger="sacpolicy.policy.learned"):
        for t, fitted in ((0.7, art.rule), (0.0, art.rule), (0.0, _constant_rule(0.0, k_max=2, drafters=("ngram",)))):
            dec = SpeculativeDecoder(Markov(logp), [NgramDrafter(name="ngram")], LearnedPolicy(fitted),
                                     sampling=SamplingConfig(temperature=t, top_p=0.9), stop_token_ids=[])
            dec.generate([1, 2, 3, 1, 2], 6)
            dec.generate([1, 2, 3, 1, 2], 6)
    warned = [r.getMessage() for r in caplog.records if r.name == "sacpolicy.policy.learned"]
    assert len(warned) == 1 and "but decodes greedy" in warned[0]  # the decoder's settings reach the policy
    old = load_artifact(save_policy(tmp_path / "old", _constant_rule(0.0, k_max=2, drafters=("ngram",)),
                                    drafters={"ngram": {"kind": "ngram"}}, provenance={}, metrics={}))
    assert old.fitted_sampling is None and old.rule.sampling_mismatch(1.0) is None


def test_drafters_rebuilt_from_the_artifact(fitted, tiny_target):
    path = fitted["logreg"][2]
    draft, ngram = build_drafters(path, tiny_target)
    assert isinstance(draft, ModelDrafter) and draft.name == "draft"
    assert isinstance(ngram, NgramDrafter) and (ngram.name, ngram.max_ngram) == ("ngram", 3)
    with pytest.raises(ArtifactError, match=r"has no drafter \['layerskip'\]; its drafters are \['draft', 'ngram'\]"):
        artifact_specs(path, ["ngram", "layerskip"])
    assert [d.name for d in build_drafters(artifact_specs(path, ["ngram"]), tiny_target)] == ["ngram"]


# ---------------------------------------------------------------------- transformers
@pytest.fixture(scope="module")
def prompt(tiny_target):
    return tiny_target.tokenizer("The capital of France is", return_tensors="pt").input_ids


@pytest.mark.parametrize("case", ["fitted", "k2", "ar"])
def test_assisted_generation_applies_the_policy_and_stays_lossless(fitted, tiny_target, tiny_draft, prompt, case):
    policy = {"fitted": dataclasses.replace(fitted["hgb"][0], mode="stop"), "k2": _constant_rule(30.0),
              "ar": _constant_rule(-30.0)}[case]
    expected = tiny_target.model.generate(prompt, max_new_tokens=24, do_sample=False)
    out, rounds = generate_with_policy(tiny_target.model, prompt, tiny_draft.model, policy, drafter="draft",
                                       max_new_tokens=24, do_sample=False)
    assert torch.equal(out, expected)
    assert "_get_candidate_generator" not in vars(tiny_target.model)
    assert rounds and sum(r["accepted"] + 1 for r in rounds) == out.shape[1] - prompt.shape[1]
    if case == "k2":  # the plan's k is the round's draft length (capped near max_new_tokens)
        assert all(r["k"] == min(2, 24 + prompt.shape[1] - r["context_len"] - 1) for r in rounds)
        assert all(r["drafted"] == r["k"] for r in rounds)
    elif case == "ar":  # autoregressive rounds: the target decodes alone, one token each
        assert all(r["k"] == 0 and r["drafted"] == 0 for r in rounds) and len(rounds) == 24
    else:  # the stop rule ends blocks before the cap
        assert all(1 <= r["drafted"] <= r["k"] <= K_MAX for r in rounds if r["k"])
        assert any(r["drafted"] < r["k"] for r in rounds)


def _confident_rule(k_max: int = 6) -> DecisionRule:
    """Acceptance 0.95 before drafting; once drafted, sigmoid(40 top1 - 12): the stop rule drafts on while the
    draft is confident (past top-1 ~0.28 at the reference state)."""
    coef = np.zeros(F)
    coef[FEATURE_NAMES.index("top1")], coef[FEATURE_NAMES.index("conf_known")] = 40.0, -15.0
    return _constant_rule(3.0, mode="stop", k_max=k_max, coef=coef)


def test_stop_rule_runs_on_the_assistants_confidence(tiny_target, tiny_draft, prompt):
    seen = []
    rule = _confident_rule()
    stop = rule.stop
    rule.stop = lambda block, row, nxt: seen.append((row[0], stop(block, row, nxt))) or seen[-1][1]
    out, rounds = generate_with_policy(tiny_target.model, prompt, tiny_draft.model, rule, max_new_tokens=12,
                                       do_sample=False)
    assert torch.equal(out, tiny_target.model.generate(prompt, max_new_tokens=12, do_sample=False))
    assert len(seen) == sum(r["drafted"] for r in rounds)
    top1 = torch.softmax(tiny_draft.model(prompt).logits[0, -1].float(), -1).max().item()
    assert seen[0][0] == pytest.approx(top1, abs=1e-6)  # raw temperature-1 confidence of the first draft


def test_generator_refuses_a_drafter_the_policy_does_not_know(fitted, tiny_target, tiny_draft, prompt):
    with pytest.raises(ValueError, match="not 'other'"):
        generate_with_policy(tiny_target.model, prompt, tiny_draft.model, fitted["hgb"][2], drafter="other",
                             max_new_tokens=4)
    with pytest.raises(ArtifactError, match="pass drafter="):  # a bare two-drafter rule does not say which
        generate_with_policy(tiny_target.model, prompt, tiny_draft.model, fitted["hgb"][0], max_new_tokens=4)
    with pytest.raises(ArtifactError, match="ngram drafter; this export takes"):
        generate_with_policy(tiny_target.model, prompt, tiny_draft.model, fitted["hgb"][2], drafter="ngram",
                             max_new_tokens=4)
    assert "_get_candidate_generator" not in vars(tiny_target.model)


def test_generation_config_export(fitted, draft_dir, tmp_path):
    from transformers import GenerationConfig

    d = _copy(draft_dir, tmp_path / "draft")
    before = json.loads((d / "generation_config.json").read_text())
    rule = _confident_rule(K_MAX)
    settings = export_generation_config(rule, d)
    cfg = GenerationConfig.from_pretrained(d)
    assert cfg.num_assistant_tokens == settings["num_assistant_tokens"] == rule.fallback[1]
    assert cfg.num_assistant_tokens_schedule == "constant"
    assert cfg.assistant_confidence_threshold == settings["assistant_confidence_threshold"]
    assert cfg.eos_token_id == before["eos_token_id"]  # other settings kept
    # the threshold is where the stop rule turns: it keeps drafting from t on, stops just below
    t = settings["assistant_confidence_threshold"]
    assert t == pytest.approx(0.28, abs=0.011)

    def keeps(top1):
        return not rule.stop(Block("draft", 256, K_MAX), np.array(reference_row(rule, "draft", 0, top1=top1)),
                             np.array(reference_row(rule, "draft", 1, prev_top1=top1)))

    assert keeps(t) and keeps(1.0) and not keeps(round(t - 0.01, 2))
    assert confidence_threshold(dataclasses.replace(rule, mode="k"), "draft") == 0.0
    fitted_settings = export_generation_config(fitted["hgb"][2], d)  # from an artifact directory
    assert fitted_settings["num_assistant_tokens"] == max(1, static_k(fitted["hgb"][0], "draft"))
    assert 0.0 <= fitted_settings["assistant_confidence_threshold"] <= 1.0
    with pytest.raises(FileNotFoundError, match="does not exist"):
        export_generation_config(rule, tmp_path / "nowhere", drafter="draft")


# ---------------------------------------------------------------------- vLLM
def test_vllm_speculative_config(fitted, draft_dir, tmp_path):
    path = fitted["hgb"][2]
    rule = load_policy(path)
    for drafter in DRAFTERS:
        cfg = speculative_config(path, drafter=drafter)
        k = max(1, static_k(rule, drafter))  # vLLM needs at least one speculative token
        assert cfg["num_speculative_tokens"] == k and isinstance(k, int)
        if drafter == rule.fallback[0]:
            assert k == rule.fallback[1]
        if drafter == "draft":
            assert cfg == {"method": "draft_model", "model": str(draft_dir.resolve()), "num_speculative_tokens": k}
        else:
            assert cfg == {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 3,
                           "prompt_lookup_min": 1}
    assert speculative_config(path, "/srv/draft", drafter="draft")["model"] == "/srv/draft"
    out = write_vllm_config(path, tmp_path / "vllm.json")
    assert json.loads(out.read_text()) == speculative_config(path)
    with pytest.raises(ValueError, match="not 'layerskip'"):
        speculative_config(path, drafter="layerskip")


def test_ngram_proposal_matches_the_ngram_drafter():
    rng = np.random.default_rng(0)
    drafter = NgramDrafter(max_ngram=3, min_ngram=1)
    for _ in range(200):
        ctx = rng.integers(0, 6, int(rng.integers(1, 40)))
        block = propose_one(drafter, torch.as_tensor(ctx), 5)
        assert ngram_proposal(ctx, 5, 3, 1) == block.tokens.tolist()


@pytest.mark.parametrize("mode", ["k", "stop"])
def test_vllm_proposer_applies_the_rule_per_request(fitted, monkeypatch, mode):
    path = fitted["hgb"][2]
    vllm_config = SimpleNamespace(speculative_config=SimpleNamespace(num_speculative_tokens=6),
                                  model_config=SimpleNamespace(max_model_len=64))
    monkeypatch.delenv("SACPOLICY_POLICY_DIR", raising=False)
    with pytest.raises(ArtifactError, match="SACPOLICY_POLICY_DIR"):
        PolicyProposer(vllm_config)
    monkeypatch.setenv("SACPOLICY_POLICY_DIR", str(path))
    proposer = PolicyProposer(vllm_config)
    proposer.rule.mode = proposer.policy.rule.mode = mode
    proposer.policy.needs_token_feedback = mode == "stop"
    rule = proposer.rule
    rng = np.random.default_rng(1)
    lens = np.array([10, 40, 63, 5, 30, 50])
    tokens = np.zeros((len(lens), 64), dtype=np.int64)
    for i, n in enumerate(lens):
        tokens[i, :n] = np.tile(rng.integers(0, 50, 4), 16)[:n]  # repetitive: the n-gram lookup finds spans
    drafts = proposer.propose([[1]] * len(lens), lens, tokens)
    # the same decision through the framework's own path: sacpolicy's NgramDrafter peeks, LearnedPolicy decides
    # (the model drafter is absent, as in vLLM), the drafter proposes under the stop rule
    for i, n in enumerate(lens):
        context = torch.as_tensor(tokens[i, :n])
        ngram, policy = NgramDrafter(), LearnedPolicy(rule)
        request = RequestInfo(prompt_len=int(n), max_new_tokens=64 - int(n), drafters=rule.drafters)
        state = DecodeState(request, context_len=int(n), remaining=min(6, 64 - int(n) - 1) + 1,
                            drafters=("ngram",), peeks={"ngram": ngram.peek(None, context)})
        row = PolicyRow(state, policy.start(request))
        d = policy.decide([row])[0]
        state.drafter = d.drafter
        expected = propose_one(ngram, context, min(d.k, 6),
                               stop=stop_callback(policy, row)).tokens.tolist() if d.drafter else []
        assert drafts[i] == expected, i
    assert len(drafts[2]) == 0  # no room left before max_model_len
    assert len({len(d) for d in drafts}) > 1
    if mode == "stop":  # the stop rule cuts blocks the plan let run to the cap
        assert any(0 < len(d) < min(6, 63 - n) for d, n in zip(drafts, lens))
    assert proposer.propose([[]] * len(lens), lens, tokens) == [[]] * len(lens)  # mid-prefill rows: no drafts


# ---------------------------------------------------------------------- command line
def _cli(*args, env=None):
    return subprocess.run([sys.executable, "scripts/export.py", *args], cwd=ROOT, capture_output=True, text=True,
                          env=env)


def _main(capsys, *args):
    """scripts/export.py's ``main`` in this process (a process each costs ~3 s of imports): its exit code, what it
    printed and its error message, as ``_cli`` returns them."""
    cli = load_script("export")
    try:
        rc, err = cli.main(list(args)), ""
    except SystemExit as e:
        rc, err = 1, str(e.code)
    return SimpleNamespace(returncode=rc, stdout=capsys.readouterr().out, stderr=err)


@pytest.mark.slow  # a fresh Python process per case
@pytest.mark.parametrize("broken, message", [
    ("raise ModuleNotFoundError(\"No module named 'vllm'\", name='vllm')", "scripts/install.sh .venv --vllm"),
    ("raise RuntimeError('operator torchvision::nms does not exist')", "pip uninstall -y torchvision"),
])
def test_vllm_check_names_the_problem_and_the_fix(fitted, tmp_path, broken, message):
    """--check in an environment whose vLLM is missing or broken: a clear message, not a trace inside vLLM."""
    (tmp_path / "shadow" / "vllm").mkdir(parents=True)
    (tmp_path / "shadow" / "vllm" / "__init__.py").write_text(broken + "\n")
    env = {**os.environ, "PYTHONPATH": f"{tmp_path / 'shadow'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    r = _cli(f"policy_dir={fitted['hgb'][2]}", "format=vllm", "drafter=ngram", "--check", f"out={tmp_path / 'o'}",
             env=env)
    assert r.returncode != 0 and message in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert not (tmp_path / "o").exists()


def test_cli(fitted, draft_dir, tmp_path, capsys):
    """The first call and one refusal go through a real process (exit code, stdout, stderr); the rest call main()."""
    path = fitted["logreg"][2]
    r = _cli(f"policy_dir={path}", "format=runtime", f"out={tmp_path / 'copy'}")
    assert r.returncode == 0, r.stderr
    assert "verified" in r.stdout and f"wrote {tmp_path / 'copy'}" in r.stdout
    assert _same_rule(load_policy(tmp_path / "copy"), load_policy(path))
    r = _main(capsys, f"policy_dir={path}", "format=vllm", "drafter=ngram", f"out={tmp_path / 'v'}")
    assert r.returncode == 0, r.stderr
    assert json.loads((tmp_path / "v/speculative_config.json").read_text()) == learned_config(path, drafter="ngram")
    assert json.loads((tmp_path / "v/static_speculative_config.json").read_text()) == speculative_config(
        path, drafter="ngram")
    env = dict(line.split("=", 1) for line in (tmp_path / "v/vllm.env").read_text().splitlines())
    assert env == {"SACPOLICY_POLICY_DIR": str((tmp_path / "v/policy").resolve()), "SACPOLICY_POLICY_DRAFTER": "ngram"}
    assert _same_rule(load_policy(env["SACPOLICY_POLICY_DIR"]), load_policy(path))
    # a model drafter: static
    r = _main(capsys, f"policy_dir={path}", "format=vllm", "drafter=draft", f"out={tmp_path / 'm'}")
    assert json.loads((tmp_path / "m/speculative_config.json").read_text())["method"] == "draft_model"
    d = _copy(draft_dir, tmp_path / "draft")
    r = _main(capsys, f"policy_dir={path}", "format=transformers", f"draft_dir={d}")
    assert r.returncode == 0 and "num_assistant_tokens" in json.loads((d / "generation_config.json").read_text())
    for args, message in [((f"policy_dir={path}", "format=onnx"), "unknown format 'onnx'"),
                          (("format=vllm",), "policy_dir= is required"),
                          ((f"policy_dir={path}", "format=vllm", "colour=red"), "bad argument 'colour=red'"),
                          ((f"policy_dir={tmp_path}", "format=runtime"), "policy.json is missing"),
                          ((f"policy_dir={path}", "format=transformers"), "needs draft_dir="),
                          ((f"policy_dir={path}", "format=vllm"), "Pass drafter=<name>"),
                          ((f"policy_dir={path}", "format=vllm", "drafter=layerskip"), "not 'layerskip'")]:
        r = _main(capsys, *args)
        assert r.returncode != 0 and message in r.stderr, (args, r.stderr)
    r = _cli(f"policy_dir={tmp_path}", "format=runtime")
    assert r.returncode != 0 and "policy.json is missing" in r.stderr, r.stderr


# ---------------------------------------------------------------- the head export and profile_vllm for any target
@pytest.fixture(scope="module")
def tiny_target_dir(tiny_target, tmp_path_factory):
    """(directory, LoadedModel): the tiny target saved as a Hugging Face directory (an engine could load it), loaded
    back from there, so its spec is the directory; a head for it in ``<directory>-head/head``."""
    from conftest import tiny_head_dir

    from sacpolicy.models import load_model

    root = tmp_path_factory.mktemp("tiny_target")
    tiny_target.model.save_pretrained(root / "target")
    tiny_target.tokenizer.save_pretrained(root / "target")
    loaded = load_model(str(root / "target"), device="cpu", dtype="float32")
    return root / "target", tiny_head_dir(loaded, root)


def test_head_export_names_any_target_and_checks_the_head_against_it(tiny_target_dir, tmp_path, capsys):
    target_dir, head = tiny_target_dir
    export = load_script("export")
    assert export.main([f"head_dir={head}", "format=speculators", f"out={tmp_path / 'spec'}"]) == 0
    verifier = json.loads((tmp_path / "spec" / "config.json").read_text())["speculators_config"]["verifier"]
    assert verifier == {"name_or_path": str(target_dir), "architectures": ["LlamaForCausalLM"]}  # the head's target
    assert f"target {target_dir}" in capsys.readouterr().out
    from sacpolicy.models import EMBEDDED_TARGET

    with pytest.raises(SystemExit, match="belongs to another target(.|\n)*hidden size: head 64, target 576"):
        export.main([f"head_dir={head}", "format=speculators", f"out={tmp_path / 'other'}",
                     f"target={EMBEDDED_TARGET}"])
    with pytest.raises(SystemExit, match="random-init test model"):
        export.main([f"head_dir={head}", "format=speculators", f"out={tmp_path / 'tiny'}", "target=tiny:llama-4l"])
    assert not (tmp_path / "other").exists() and not (tmp_path / "tiny").exists()


def test_profile_vllm_serves_the_runs_target_or_the_one_given(tiny_target_dir, tmp_path, monkeypatch):
    """Without an engine (a stand-in records what vLLM would be given): the run's target by default, --target
    otherwise; --head with a head of ours exports it for that target first; the profile names the target."""
    from sacpolicy.export.vllm_cost import profile_vllm_steps

    target_dir, head = tiny_target_dir
    run = tmp_path / "run"
    run.mkdir()
    cost_model_of_run = ngram_rule("k").cost
    cost_model_of_run.to_json(run / "cost.json")
    (run / "config.yaml").write_text(f"target:\n  spec: {target_dir}\n")
    profile = load_script("profile_vllm")
    served = []

    def fake_run(model, prompts, *, max_tokens, speculative_config, **kw):
        served.append((model, (speculative_config or {}).get("model")))
        return {"tokens": {"serial": 20}, "seconds": {"serial": 1.0},
                "spec": {"serial": {"num_accepted_tokens": 0, "num_drafts": 20 if speculative_config else 0}}}

    monkeypatch.setattr(profile, "vllm_status", lambda: (True, "stand-in"))
    monkeypatch.setattr(profile, "profile_vllm_steps", lambda *a, **kw: profile_vllm_steps(*a, **kw, run=fake_run))
    out = tmp_path / "out"
    args = ["--run", str(run), "--out", str(out), "--prompts", "2", "--ks", "0,2", "--repeats", "1"]
    assert profile.main([*args, "--head", str(head), "--head-name", "ngram"]) == 0
    result = json.loads((out / "vllm_profile.json").read_text())
    assert result["target"] == result["served"] == str(target_dir) and result["head"] == str(out / "head")
    assert {m for m, _ in served} == {str(target_dir)} and served[-1][1] == str((out / "head").resolve())
    spec = json.loads((out / "head" / "config.json").read_text())["speculators_config"]["verifier"]["name_or_path"]
    assert spec == str(target_dir)
    assert json.loads((out / "cost.json").read_text())["meta"]["vllm_target"] == str(target_dir)
    with pytest.raises(SystemExit, match="random-init test model"):
        profile.main([*args, "--target", "tiny:llama-4l"])
    with pytest.raises(SystemExit, match="no EAGLE-3 head ships for target"):
        profile.main([*args, "--head", "shipped", "--head-name", "ngram"])
    (run / "config.yaml").write_text("target:\n  spec: tiny:llama-4l\n")
    assert profile.run_target(run) == profile.EMBEDDED_TARGET  # a tiny run is profiled on the embedded target
