"""Learning while serving (``runtime.online``, ``LearnedPolicy(online=...)``): settings refused with their fix, the
calibration identical to the fitted model until its gate finds it better (never on labels drawn from the fitted p
itself) and then moving with the labels (bounded, never NaN on adversarial streams), the shadow guard falling back
and returning, and the learning policy lossless and replayed step for step."""

import math

import numpy as np
import pytest
import torch
from test_peers import traced  # noqa: F401  (a module-scoped fixture: Markov target, its traces)
from test_traces import cost_model

from sacpolicy.decoding import SpeculativeDecoder
from sacpolicy.policy import Autoregressive
from sacpolicy.policy.learned import LearnedPolicy
from sacpolicy.profiling import CostModel, PiecewiseLinear
from sacpolicy.runtime.features import FEATURE_NAMES, feature_spec
from sacpolicy.runtime.online import (
    P_SCORE,
    SLOPE_BOUNDS,
    WEIGHT_BOUND,
    OnlineCalibration,
    OnlineError,
    OnlineSettings,
    ShadowGuard,
    chain_labels,
)
from sacpolicy.runtime.predictors import Predictor
from sacpolicy.runtime.rule import DecisionRule
from sacpolicy.traces.simulate import simulate

N_NEW = 24
F = len(FEATURE_NAMES)


def rule_over(names, coef: dict, intercept: float, mode: str = "stop", online=None) -> DecisionRule:
    c = np.zeros(F)
    for name, v in coef.items():
        c[FEATURE_NAMES.index(name)] = v
    pred = Predictor("linear", {"mean": np.zeros(F), "scale": np.ones(F), "coef": c,
                                "intercept": np.array([intercept])}, {"features": feature_spec()})
    cost = cost_model(list(names))
    cost = CostModel(cost.device, cost.verify, cost.draft, cost.per_token_draft,
                     batch={b: {"tokens": PiecewiseLinear([1, 9], [0.010 * (1 + b / 8), 0.014 * b]),
                                "per_context": 1e-6} for b in (2, 4)})
    return DecisionRule(pred, cost, tuple(names), 8, (names[0], 2), mode, 1.0, online=online)


def rows(n: int, drafter: int = 0, position: int = 0, top1: float | None = None) -> np.ndarray:
    X = np.zeros((n, F))
    X[:, FEATURE_NAMES.index("drafter_index")] = drafter
    X[:, FEATURE_NAMES.index("position")] = position
    if top1 is not None:
        X[:, FEATURE_NAMES.index("top1")] = top1
        X[:, FEATURE_NAMES.index("conf_known")] = 1.0
    else:
        X[:, :3] = np.nan
    return X


# ---------------------------------------------------------------------- settings
@pytest.mark.parametrize("bad, option", [({"lr": -0.1}, "online.lr"), ({"shrink": 2.0}, "online.shrink"),
                                         ({"margin": float("nan")}, "online.margin"), ({"window": 0}, "online.window"),
                                         ({"hold": 1.5}, "online.hold"), ({"min_steps": 100}, "online.min_steps"),
                                         ({"gate_margin": -0.01}, "online.gate_margin"),
                                         ({"gate_margin": "0.1"}, "online.gate_margin"),
                                         ({"gate_window": 0}, "online.gate_window")])
def test_bad_settings_are_refused_naming_the_option_and_fix(bad, option):
    with pytest.raises(OnlineError, match=option.replace(".", r"\.")) as e:
        OnlineSettings(**bad)
    assert "e.g." in str(e.value) or "lower" in str(e.value)
    with pytest.raises(OnlineError, match="unknown online setting"):
        OnlineSettings.of({"learning_rate": 0.1})
    assert OnlineSettings.of(None) is None and OnlineSettings.of(False) is None
    assert OnlineSettings.of(True) == OnlineSettings() == OnlineSettings.of(OnlineSettings().to_dict())
    s = OnlineSettings(gate_margin=0.05, gate_window=64)
    assert OnlineSettings.of(s.to_dict()) == s and s.to_dict()["gate_margin"] == 0.05
    assert OnlineSettings.of({"lr": 0.1}).gate_margin == OnlineSettings().gate_margin  # older artifacts: the default


# ---------------------------------------------------------------------- calibration
def test_calibration_is_the_fitted_model_until_a_cells_gate_opens():
    cal = OnlineCalibration(OnlineSettings(gate_window=64), drafters=2, positions=8)
    X, p = rows(5, drafter=1, position=3), np.array([0.0, 0.2, 0.5, 0.9, 1.0])
    assert cal.adjust(X, p) is p
    cal.learn(rows(1, drafter=0, position=0), np.array([0.5]), np.array([1.0]))
    assert cal.adjust(rows(1, 0, 0), np.array([0.5]))[0] == 0.5  # one label: the gate has not seen enough
    for _ in range(200):  # the fitted 0.5 against labels that are all 1: the calibration does better
        cal.learn(rows(1, drafter=0, position=0), np.array([0.5]), np.array([1.0]))
    np.testing.assert_array_equal(cal.adjust(X, p), p)  # another cell learned; this one is untouched
    assert cal.open[0, 0] and cal.open.sum() == 1
    assert cal.adjust(rows(1, 0, 0), np.array([0.5]))[0] > 0.5  # the learned cell moved toward its label


def _stream(cal, truth, steps: int, seed: int):
    """Blocks of 5 positions of drafter 0: fitted p per row from the shared pattern (row confidence, position), labels
    drawn from ``truth(p)``; returns (the fitted p, the rows) of the last block."""
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        top1 = rng.random(5)
        X = rows(5, top1=0.0)
        X[:, FEATURE_NAMES.index("position")] = np.arange(5)
        X[:, FEATURE_NAMES.index("top1")] = top1
        p = np.clip(0.15 + 0.8 * top1 - 0.05 * np.arange(5), 0.02, 0.98)
        cal.learn(X, p, (rng.random(5) < truth(p)).astype(float))
    return p, X


def test_gate_stays_closed_on_labels_drawn_from_the_fitted_p():
    """Traffic the predictor is calibrated on: the calibration cannot beat it, its gate never opens and the rule
    decides with the fitted p exactly."""
    cal = OnlineCalibration(OnlineSettings(), drafters=2, positions=8)
    p, X = _stream(cal, lambda p: p, 6000, seed=2)
    assert cal.updates == 30000 and not cal.open.any()
    assert cal.adjust(X, p) is p
    assert np.all(cal.loss[0, :5, 0] < cal.loss[0, :5, 1] + OnlineSettings().gate_margin * cal.mass[0, :5])


def test_gate_opens_on_shifted_traffic_and_the_calibrated_loss_is_lower():
    """Traffic accepting a third as often as the predictor says: every position's gate opens, the calibrated
    running log-loss is below the fitted one there, and the rule's probabilities come down toward the truth."""
    cal = OnlineCalibration(OnlineSettings(), drafters=2, positions=8)
    p, X = _stream(cal, lambda p: p / 3, 3000, seed=3)
    assert cal.open[0, :5].all() and not cal.open[1].any() and not cal.open[0, 5:].any()
    assert np.all(cal.loss[0, :5, 1] < cal.loss[0, :5, 0] - OnlineSettings().gate_margin * cal.mass[0, :5])
    out = cal.adjust(X, p)
    assert np.all(np.abs(out - p / 3) < np.abs(p - p / 3))


def test_calibration_follows_traffic_the_predictor_was_not_fitted_on_and_shrinks_toward_the_fit():
    """The predictor says 0.8; the traffic accepts 20%: the calibrated probability comes down near the truth, and a
    strong pull toward the fitted model keeps it nearer 0.8."""
    rng = np.random.default_rng(0)
    labels = (rng.random(3000) < 0.2).astype(float)
    out = {}
    for shrink in (0.0, 0.2):
        cal = OnlineCalibration(OnlineSettings(lr=0.05, shrink=shrink), drafters=1, positions=4)
        X = rows(1, position=2)
        for y in labels:
            cal.learn(X, np.array([0.8]), np.array([y]))
        out[shrink] = float(cal.adjust(X, np.array([0.8]))[0])
        assert cal.updates == len(labels) and cal.seen[0, 2] == len(labels)
    assert abs(out[0.0] - 0.2) < 0.08
    assert out[0.0] < out[0.2] < 0.8


def test_adversarial_label_streams_never_make_the_calibration_nan_or_unbounded():
    rng = np.random.default_rng(1)
    cal = OnlineCalibration(OnlineSettings(lr=1.0, shrink=0.0), drafters=2, positions=8)
    specials = np.array([0.0, 1.0, np.nan, np.inf, -np.inf, 1e-300, 1 - 1e-16])
    for t in range(4000):
        n = int(rng.integers(1, 6))
        X = rows(n, drafter=int(rng.integers(0, 5)), position=int(rng.integers(-3, 20)), top1=float(rng.random()))
        if t % 7 == 0:
            X[0, int(rng.integers(0, F))] = rng.choice([np.nan, np.inf, -np.inf, 1e308])
        p = rng.choice(specials, n) if t % 3 == 0 else rng.random(n)
        y = np.ones(n) if t % 5 else rng.choice([0.0, 1.0, np.nan], n)  # long runs of one label, then noise
        cal.learn(X, p, y)
        out = cal.adjust(X, np.nan_to_num(p, nan=0.5, posinf=1.0, neginf=0.0))
        assert np.all(np.isfinite(out)) and np.all((0 <= out) & (out <= 1))
    assert np.all(np.isfinite(cal.w))
    assert np.all((SLOPE_BOUNDS[0] <= cal.w[..., 0]) & (cal.w[..., 0] <= SLOPE_BOUNDS[1]))
    assert np.all(np.abs(cal.w[..., 1:]) <= WEIGHT_BOUND)
    # the gate's running losses: finite, their means within one label's worst loss, their weight at most 1
    assert np.all(np.isfinite(cal.loss)) and np.all(np.isfinite(cal.mass))
    assert np.all((cal.loss >= 0) & (cal.loss <= -math.log(P_SCORE) * cal.mass[..., None] + 1e-12))
    assert np.all(cal.mass <= 1.0)
    assert cal.skipped > 0  # the NaN labels and p were counted, not learned


def test_chain_labels():
    assert chain_labels(4, 2) == [1, 1, 0] and chain_labels(3, 3) == [1, 1, 1] and chain_labels(2, 0) == [0]
    with pytest.raises(OnlineError, match="accepted"):
        chain_labels(2, 3)


# ---------------------------------------------------------------------- guard
def test_guard_falls_back_to_the_static_block_its_steps_price_better_then_tries_again():
    s = OnlineSettings(window=20, min_steps=10, hold=15, margin=0.05)
    guard = ShadowGuard(s, cost_model(["q"]), ("q",), 8)
    for _ in range(9):  # blocks of 8 the target rejects at once: any shorter block, and AR, did better
        guard.observe("q", 8, 0, 1, 100)
    assert guard.held is None  # fewer steps than min_steps: no verdict yet
    guard.observe("q", 8, 0, 1, 100)
    assert guard.held == (None, 0) and guard.fallbacks == 1
    for _ in range(14):
        guard.observe(None, 0, 0, 1, 100)
    assert guard.held == (None, 0) and guard.hold_left == 1
    guard.observe(None, 0, 0, 1, 100)
    assert guard.held is None and guard.steps == 0  # the hold is over: the rule decides again, on a fresh window

    good = ShadowGuard(s, cost_model(["q"]), ("q",), 8)
    for _ in range(200):  # blocks of 4 all accepted: no shorter block or AR does as well
        good.observe("q", 4, 4, 5, 100)
    assert good.held is None and good.fallbacks == 0
    half = ShadowGuard(s, cost_model(["q"]), ("q",), 8)
    for _ in range(40):  # blocks of 8 accepting 2: a static 2 gets the same 3 tokens cheaper
        half.observe("q", 8, 2, 3, 100)
    assert half.held is not None and half.held[0] in ("q", None) and half.held[1] <= 2


def test_guard_off_learns_but_never_falls_back():
    guard = ShadowGuard(OnlineSettings(guard=False, window=20, min_steps=5), cost_model(["q"]), ("q",), 8)
    for _ in range(100):
        guard.observe("q", 8, 0, 1, 100)
    assert guard.held is None and guard.fallbacks == 0


# ---------------------------------------------------------------------- the learning policy
def _rules(names):
    """An over-confident rule (it believes every draft is accepted) and a fair one (confidence, history)."""
    return {"overconfident": rule_over(names, {}, 6.0),
            "fair": rule_over(names, {"top1": 3.0, "accept_ema": 3.0, "position": -0.3}, -1.0)}


@pytest.mark.parametrize("which", ["overconfident", "fair"])
def test_learning_policy_is_lossless_alone_and_in_batches(traced, which):  # noqa: F811
    target, prompts, drafters, _, _ = traced
    names = [d.name for d in drafters]
    ps = [p["input_ids"] for p in prompts]
    want = [SpeculativeDecoder(target.model, [], Autoregressive(), stop_token_ids=[]).generate(p, N_NEW).tokens
            for p in ps]
    pol = LearnedPolicy(_rules(names)[which], online=OnlineSettings(window=16, min_steps=8, hold=8))
    dec = SpeculativeDecoder(target.model, drafters, pol, stop_token_ids=[])
    outs = [dec.generate(p, N_NEW) for p in ps] + dec.generate_batch(ps, N_NEW, max_batch=3)
    assert [r.tokens for r in outs] == want + want
    assert pol.learning["labels"] > 0
    if which == "overconfident":  # its blocks of 8 lose: the guard took over for a while, and the records say so
        guarded = [s for r in outs for s in r.steps if s.guard]
        assert guarded and pol.learning["fallbacks"] > 0


@pytest.mark.parametrize("which", ["overconfident", "fair"])
def test_a_learning_policy_replays_its_live_decisions_step_for_step(traced, which):  # noqa: F811
    """Greedy: its state is the policy's, so the simulator (the real decoder over the traces) and live decoding, each
    with one policy for every prompt in the simulator's order, decide the same blocks, fall back at the same steps and
    end with the same calibration (to the traces' float32 precision)."""
    target, prompts, drafters, grouped, v = traced
    names = [d.name for d in drafters]
    settings = OnlineSettings(window=16, min_steps=8, hold=8)
    sim_policy, live_policy = (LearnedPolicy(_rules(names)[which], online=settings) for _ in range(2))
    sim = simulate(sim_policy, grouped, sim_policy.rule.cost, vocab_size=v)
    by_id = {p["prompt_id"]: p for p in prompts}
    for pid, (_, replayed) in zip(grouped, sim.results):
        live = SpeculativeDecoder(target.model, drafters, live_policy, stop_token_ids=[]).generate(
            by_id[pid]["input_ids"], N_NEW)
        steps = lambda res: [(s.drafter, s.k, s.accepted, min(s.drafted, s.accepted + 1), s.guard)  # noqa: E731
                             for s in res.steps]
        assert steps(replayed) == steps(live), pid
    # the drafted tokens' confidence reaches the replay through the traces' float32 columns: equal to ~1e-7
    np.testing.assert_allclose(sim_policy.rule.calibration.w, live_policy.rule.calibration.w, rtol=1e-6, atol=1e-9)
    assert sim_policy.learning == live_policy.learning and live_policy.learning["labels"] > 0


def test_instances_learn_apart_and_offline_is_untouched(traced):  # noqa: F811
    target, prompts, drafters, _, _ = traced
    rule = _rules([d.name for d in drafters])["overconfident"]
    a, b, off = LearnedPolicy(rule, online=True), LearnedPolicy(rule, online=True), LearnedPolicy(rule)
    assert off.learning is None and off.rule.calibration is None and rule.calibration is None
    SpeculativeDecoder(target.model, drafters, a, stop_token_ids=[]).generate(prompts[0]["input_ids"], N_NEW)
    assert a.learning["labels"] > 0 and b.learning["labels"] == 0  # b shares nothing of a's state
    assert not np.array_equal(a.rule.calibration.w, b.rule.calibration.w)
    # settings travel with the rule (its artifact config); False turns them off
    r2 = rule_over(["q", "ngram"], {}, 0.0, online={"window": 32, "min_steps": 4})
    assert r2.config()["online"]["window"] == 32 and LearnedPolicy(r2).guard is not None
    assert LearnedPolicy(r2, online=False).guard is None and "online" not in rule.config()


def test_a_learning_policy_costs_o1_per_token():
    """Bounded memory: the calibration's arrays and the guard's ring do not grow with the steps served."""
    s = OnlineSettings(window=32)
    cal, guard = OnlineCalibration(s, 2, 8), ShadowGuard(s, cost_model(["q"]), ("q",), 8)
    sizes = (cal.w.nbytes, cal.loss.nbytes, guard._ring.nbytes)
    for t in range(3000):
        cal.learn(rows(3, position=t % 8, top1=0.5), np.full(3, 0.6), np.array([1.0, 1.0, 0.0]))
        guard.observe("q", 4, t % 5, min(t % 5 + 1, 5), 50 + t)
    assert (cal.w.nbytes, cal.loss.nbytes, guard._ring.nbytes) == sizes and math.isfinite(float(cal.w.sum()))
    assert torch.tensor(guard._sums).isfinite().all()


# ---------------------------------------------------------------------- served: the vLLM proposer
def test_the_vllm_proposer_learns_from_every_step_it_serves_and_logs_the_guard(tmp_path, monkeypatch):
    """The proposer's controller observes every served step (drafted or not) when the next one shows what was
    accepted, so the learning rule learns in vLLM's hook as in the decoder; the step log's ``guard`` column says which
    steps its guard decided; a replay of its log refuses to pretend it is exact, and replays the fitted rule on ask."""
    import dataclasses

    from test_production import TARGET, proposer, workload
    from toys import ngram_rule

    from sacpolicy.traces.logformat import StepLogError
    from sacpolicy.traces.production import build_production_traces
    from sacpolicy.traces.served_replay import replay_logged
    from sacpolicy.traces.steplog_read import read_step_log

    rule = dataclasses.replace(ngram_rule("stop"), online=OnlineSettings(window=16, min_steps=8, hold=8))
    monkeypatch.setattr("test_production.ngram_rule", lambda mode: rule)
    prop = proposer(tmp_path, monkeypatch)
    engine = workload(seed=3)
    engine.run(prop)
    prop.steplog.close()
    learned = prop.served.policy.learning
    assert learned is not None and learned["labels"] > 0
    steps = sum(len(t) for t in engine.truth.values())
    assert learned["labels"] <= sum(d for t in engine.truth.values() for d, _ in t)
    records, _ = read_step_log(tmp_path / "log")
    assert len(records) >= steps and all(r["guard"] in (True, False) for r in records)
    build_production_traces(tmp_path / "log", tmp_path / "traces", target=TARGET)
    art = tmp_path / "policy-stop"
    with pytest.raises(StepLogError, match="learns while serving"):
        replay_logged(tmp_path / "traces", art)
    out = replay_logged(tmp_path / "traces", art, learn=False)
    assert set(out["replayed"]) == set(out["logged"])


def test_a_shadow_defined_only_where_the_rule_chose_to_draft_cannot_win():
    """Half the steps draft 8 tokens (3 accepted), half are autoregressive: a static 3 looks better on the steps where
    it is defined, the ones the rule picked as promising, but would also run on the others; with ``coverage`` it is
    not eligible (and AR, defined everywhere, does worse than the rule), without it the guard falls for it."""
    for coverage, falls in ((0.8, False), (0.0, True)):
        guard = ShadowGuard(OnlineSettings(window=40, min_steps=10, coverage=coverage), cost_model(["q"]), ("q",), 8)
        for t in range(80):
            guard.observe(*(("q", 8, 3, 4) if t % 2 else (None, 0, 0, 1)), 100)
        assert (guard.fallbacks > 0) == falls, coverage
