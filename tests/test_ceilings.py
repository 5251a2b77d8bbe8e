"""Ceilings (per-prompt hindsight static, in-sample refit) and the evaluation rows on synthetic traces, simulated."""

from types import SimpleNamespace

import pytest
from toys import PREDICTORS, synthetic_traces

from sacpolicy.data import assign_split
from sacpolicy.evaluation.ceilings import InSample, in_sample_rules, per_prompt_static
from sacpolicy.evaluation.evaluate import EvalSettings, evaluate
from sacpolicy.evaluation.report import write_eval
from sacpolicy.runtime.cost import CostModel, PiecewiseLinear
from sacpolicy.traces import simulate as sim
from sacpolicy.training.predictor import acceptance_examples, fit_predictor, tune_rule

V, K_MAX = 1000, 8


@pytest.fixture(scope="module")
def synth():
    """Synthetic traces split by prompt id, a cost model, and the pipeline's learned rule (fit on train, tuned on
    val)."""
    grouped = sim.group_traces(synthetic_traces(60, length=32, drafters=("draft",)))
    cost = CostModel(device="cpu", verify={"tokens": PiecewiseLinear([1, 9], [0.010, 0.014]), "per_context": 1e-6},
                     draft={"draft": PiecewiseLinear([0, 1000], [0.002, 0.003])}, per_token_draft={"draft": True})
    split = {s: {p: v for p, v in grouped.items() if assign_split(p) == s} for s in ("train", "val", "test")}
    pred, _ = fit_predictor("logreg", PREDICTORS["logreg"], acceptance_examples(grouped, cost, vocab_size=V, k=K_MAX))
    static = sim.best_static(split["val"], cost, vocab_size=V, k_max=K_MAX)["all"]
    rule, _ = tune_rule(pred, cost, split["val"], static, vocab_size=V, k_max=K_MAX)
    return split, cost, rule, static


def _tps(results) -> float:
    return sum(len(r.tokens) for _, r in results) / sum(r.total_s for _, r in results)


def test_per_prompt_static_beats_any_static_in_hindsight(synth):
    split, cost, _, _ = synth
    test = split["test"]
    hindsight = sim.best_static(test, cost, vocab_size=V, k_max=K_MAX)["all"]
    per_prompt = per_prompt_static(test, cost, vocab_size=V, k_max=K_MAX)
    assert [c for c, _ in per_prompt] == [p["category"] for p in test.values()]  # one result per prompt, in order
    assert _tps(per_prompt) >= hindsight["tokens_per_s"]  # each prompt at its own best is never slower


def test_in_sample_rule_falls_back_to_the_hindsight_static(synth):
    split, cost, _, _ = synth
    few = dict(list(split["test"].items())[:3])
    hindsight = sim.best_static(few, cost, vocab_size=V, k_max=K_MAX)["all"]
    refit, skipped = in_sample_rules(few, cost, InSample({"logreg": PREDICTORS["logreg"]}, k=K_MAX), vocab_size=V,
                                     k_max=K_MAX)
    assert skipped == {}
    assert refit["logreg"].fallback == (hindsight["drafter"], hindsight["k"])


def test_in_sample_ceiling_is_skipped_when_the_test_traces_cannot_be_fitted(synth, caplog):
    split, cost, _, _ = synth
    pid, p = next(iter(split["test"].items()))
    rows = dict(p["drafters"]["draft"], run_len=[K_MAX] * len(p["drafters"]["draft"]["run_len"]))
    accepted = {pid: {**p, "drafters": {"draft": rows}}}  # every drafted token accepted: one label only
    spec = InSample({"logreg": PREDICTORS["logreg"]}, k=K_MAX)
    refit, skipped = in_sample_rules(accepted, cost, spec, vocab_size=V, k_max=K_MAX)
    assert refit == {} and "every training example is accepted" in skipped["logreg"]
    assert "no in-sample ceiling for logreg" in caplog.text


def _stub_target():
    head = SimpleNamespace(out_features=V)
    return SimpleNamespace(model=SimpleNamespace(get_output_embeddings=lambda: head), spec="synthetic",
                           device="cpu", dtype="float32")


def _evaluate(synth, **kw):
    split, cost, rule, static = synth
    settings = EvalSettings(ks=(1, 4), k_max=K_MAX, live_prompts=0, max_new_tokens=16, price_per_hour=1.0,
                            confidence_grid=(0.3, 0.6), resamples=200, peers=())  # peers: tests/test_peers.py
    return evaluate(target=_stub_target(), drafters=[SimpleNamespace(name="draft")], cost=cost,
                    val_grouped=split["val"], test_grouped=split["test"], test_prompts=[], rules={"logreg": rule},
                    settings=settings, best_static=static, progress=False, **kw)


def test_evaluation_puts_ceilings_next_to_the_learned_rows(synth, tmp_path):
    rows, meta = _evaluate(synth, in_sample=InSample({"logreg": PREDICTORS["logreg"]}, k=K_MAX))
    names = [r["name"] for r in rows]
    # each rule's other mode (learning while serving) beside it, then the ceilings
    assert names[-4:] == ["learned-logreg", "learned-logreg-online", "learned-logreg-in-sample", "oracle"]
    assert names.index("per-prompt-static") == names.index("best-static") + 1
    by = {r["name"]: r for r in rows}
    assert by["learned-logreg-in-sample"]["tokens_per_s"] >= by["learned-logreg"]["tokens_per_s"]
    assert by["oracle"]["tokens_per_s"] >= by["per-prompt-static"]["tokens_per_s"]
    share = meta["learned-logreg_in_sample_gain_captured"]
    gain = by["learned-logreg-in-sample"]["tokens_per_s"] - by["best-static"]["tokens_per_s"]
    assert share == pytest.approx((by["learned-logreg"]["tokens_per_s"] - by["best-static"]["tokens_per_s"]) / gain)
    for r in rows:  # 9 test prompts: every ratio has its interval
        lo, hi = r["speedup_vs_best_static_ci"]
        assert lo <= r["speedup_vs_best_static"] <= hi
        assert not r["beats_ar_nothing_accepted"]
    write_eval(tmp_path, rows, meta)
    md = (tmp_path / "eval.md").read_text()
    assert f"learned-logreg captures {share:.0%} of learned-logreg-in-sample's gain over best-static" in md


def test_sampled_traces_give_simulated_rows_in_expectation(synth, tmp_path):
    """Sampled traces replay in expectation: every simulated row and ceiling is there, one result per test prompt
    (its draws merged), and the metadata says which replay ran."""
    split, cost, rule, static = synth
    sampled = {s: {pid: {**p, "temperature": 1.0, "draws": 2} for pid, p in g.items()} for s, g in split.items()}
    rows, meta = _evaluate((sampled, cost, rule, static), in_sample=InSample({"logreg": PREDICTORS["logreg"]}, k=K_MAX,
                                                                            soft=True))
    names = [r["name"] for r in rows]
    assert {"best-static", "per-prompt-static", "confidence-tuned", "learned-logreg", "learned-logreg-in-sample",
            "oracle"} <= set(names) and all(r["mode"] == "simulated" for r in rows)
    assert meta["test_prompts_simulated"] == len(split["test"]) and meta["confidence_threshold"] is not None
    assert meta["simulated_replay"].startswith("expected (sampled traces, temperature 1.0: 2 seeded draws")
    by = {r["name"]: r for r in rows}
    for r in rows:
        assert len(r["per_prompt"]["tokens"]) == len(split["test"])  # prompts, not draws, behind the intervals
        assert r["tokens"] == 2 * sum(len(p["drafters"]["draft"]["target_token"]) for p in split["test"].values())
    assert by["oracle"]["tokens_per_s"] >= by["per-prompt-static"]["tokens_per_s"] >= by["best-static"]["tokens_per_s"]
    assert by["ar"]["tokens_per_call"] == pytest.approx(1.0)  # one prefill per draw: no call left uncounted
    write_eval(tmp_path, rows, meta)
    assert "simulated_replay: expected" in (tmp_path / "eval.md").read_text()
