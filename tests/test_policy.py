"""Learned policies: examples from traces, predictors that learn acceptance, the decision rule, bad input, the bandit."""

import dataclasses

import numpy as np
import pytest
from test_traces import cost_model
from toys import PREDICTORS, decide_one, synthetic_traces

from sacpolicy.data import assign_split
from sacpolicy.decoding import (
    Decision,
    DecodeState,
    DraftToken,
    ModelDrafter,
    NgramDrafter,
    RequestInfo,
    SpeculativeDecoder,
)
from sacpolicy.evaluation.evaluate import Timed
from sacpolicy.policy import Autoregressive, Bandit, SeedRule, Static
from sacpolicy.policy.learned import LearnedPolicy
from sacpolicy.runtime.features import FEATURE_NAMES, accept_rate, feature_spec, next_accept_history
from sacpolicy.runtime.predictors import Predictor
from sacpolicy.runtime.rule import DecisionRule, RuleError
from sacpolicy.traces.simulate import Oracle, best_static, group_traces, simulate
from sacpolicy.training.predictor import (
    FORMS,
    acceptance_examples,
    fit_predictor,
    tune_rule,
)

V = 1000


@pytest.fixture(scope="module")
def synth():
    grouped = group_traces(synthetic_traces(90, drafters=("draft",)))
    cost = cost_model(["draft"])
    split = {s: {p: v for p, v in grouped.items() if assign_split(p) == s} for s in ("train", "val", "test")}
    return grouped, split, cost, acceptance_examples(grouped, cost, vocab_size=V, k=8)


@pytest.fixture(scope="module")
def fitted(synth, tmp_path_factory):
    _, _, _, ex = synth
    return {name: fit_predictor(name, spec, ex, out_dir=tmp_path_factory.mktemp(name)) for name, spec in PREDICTORS.items()}


def test_examples_follow_the_replay_and_the_prompt_split(synth):
    grouped, split, cost, ex = synth
    # one example per drafted position up to the first rejection of its block, in each of the three forms
    steps = simulate(Static(8, "draft"), grouped, cost, vocab_size=V)
    relevant = sum(min(s.accepted + 1, s.drafted) for _, r in steps.results for s in r.steps)
    assert len(ex) == 3 * relevant
    assert set(ex.form) == set(FORMS) and ex.X.shape[1] == len(FEATURE_NAMES)
    assert all(ex.split[i] == assign_split(ex.prompt_id[i]) for i in range(0, len(ex), 97))
    known = ex.X[ex.form == "known"]
    assert np.isfinite(known).all()  # confidence is known once the token is drafted
    plan = ex.X[(ex.form == "plan") & (ex.position > 0)]
    assert np.isnan(plan[:, :3]).all() and np.isnan(plan[:, FEATURE_NAMES.index("prev_top1")]).all()
    # labels: an accepted token is followed, in its block, by the next position
    assert set(np.unique(ex.y)) == {0.0, 1.0}


@pytest.mark.parametrize("name", list(PREDICTORS))
def test_predictors_learn_acceptance_and_are_calibrated(fitted, name):
    pred, metrics = fitted[name]
    for split in ("val", "test"):
        assert metrics[split]["auc"] > 0.65, metrics
        assert metrics[split]["ece"] < 0.1, metrics
    assert pred.meta["features"] == feature_spec() and pred.meta["name"] == name


@pytest.mark.parametrize("name", list(PREDICTORS))
def test_a_feature_constant_in_training_moves_no_prediction(synth, fitted, name):
    """Traces collected one request at a time hold load = 0 throughout; a batched decoder later feeds the live load.
    No predictor may read a signal from a feature it never saw vary (the MLP's weights on it would be their random
    initialisation): its predictions are the same at any load."""
    _, _, _, ex = synth
    load = FEATURE_NAMES.index("load")
    X = ex.X[ex.split == "test"][:500]
    assert np.all(ex.X[ex.split == "train"][:, load] == 0.0)
    pred, _ = fitted[name]
    for value in (0.25, 1.0):
        loaded = X.copy()
        loaded[:, load] = value
        np.testing.assert_array_equal(pred.raw(loaded), pred.raw(X))
        np.testing.assert_array_equal(pred.predict(loaded), pred.predict(X))


def test_learned_policy_beats_best_static_and_trails_the_oracle(synth, fitted):
    _, split, cost, _ = synth
    pred, _ = fitted["hgb"]
    rule, tuning = tune_rule(pred, cost, split["val"], best_static(split["val"], cost, vocab_size=V, k_max=8)["all"],
                             vocab_size=V, k_max=8)
    assert {r["mode"] for r in tuning["grid"]} == {"stop", "k"}
    best = best_static(split["val"], cost, vocab_size=V, k_max=8)["all"]
    learned = simulate(LearnedPolicy(rule), split["test"], cost, vocab_size=V).tokens_per_s
    static = simulate(Static(best["k"], best["drafter"]), split["test"], cost, vocab_size=V).tokens_per_s
    oracle = simulate(Oracle(cost, 8), split["test"], cost, vocab_size=V).tokens_per_s
    assert static < learned < oracle


def _rule(pred, cost, **kw):
    return DecisionRule(pred, cost, ("draft",), 8, ("draft", 3), **kw)


def test_non_finite_features_fall_back_to_the_best_static_rule_and_are_counted(synth, fitted):
    _, split, cost, ex = synth
    rule = _rule(fitted["hgb"][0], cost)
    rows = ex.of("test", "plan").X[:8].copy()
    before = rule.fallbacks
    rule.plan({"draft": rows}, 100)
    assert rule.fallbacks == before  # unknown confidence (NaN by design) is not a broken feature
    rows[2, FEATURE_NAMES.index("load")] = np.nan
    assert rule.plan({"draft": rows}, 100) == ("draft", 3)
    row = ex.of("test", "known").X[0].copy()
    row[FEATURE_NAMES.index("log_context_len")] = np.inf
    from sacpolicy.runtime.rule import Block

    block = Block("draft", 100, 8)
    assert [rule.stop(block, row, rows[1]) for _ in range(3)] == [False, False, True]  # static k=3
    assert rule.fallbacks == before + 4


def test_bad_input_is_refused_with_the_fix(synth, fitted, tiny_target):
    _, _, cost, _ = synth
    pred = fitted["logreg"][0]
    old = dataclasses.replace(pred, meta={**pred.meta, "features": {**feature_spec(), "version": 1}})
    with pytest.raises(RuleError, match="feature spec"):
        _rule(old, cost)
    with pytest.raises(ValueError, match="trained on drafters"):
        SpeculativeDecoder(tiny_target.model, [NgramDrafter(name="ngram")], LearnedPolicy(_rule(pred, cost)))
    with pytest.raises(RuleError, match="mode"):
        _rule(pred, cost, mode="sometimes")


def test_learned_policy_decodes_live_losslessly(synth, fitted, tiny_target, tiny_draft):
    """Live, with a real model drafter: the decisions vary and the output is the target's own greedy output."""
    _, _, cost, _ = synth
    prompt = [5, 6, 7, 8] * 6
    ar = SpeculativeDecoder(tiny_target.model, [], Autoregressive(), stop_token_ids=[]).generate(prompt, 24)
    for mode in ("stop", "k"):
        policy = Timed(LearnedPolicy(_rule(fitted["mlp"][0], cost, mode=mode)))
        dec = SpeculativeDecoder(tiny_target.model, [ModelDrafter(tiny_draft.model, name="draft")], policy,
                                 stop_token_ids=[])
        out = dec.generate(prompt, 24)
        assert out.tokens == ar.tokens
        assert policy.seconds > 0 and all(s.drafted <= 8 for s in out.steps)


def test_learned_policy_decides_with_numpy_on_one_blas_thread(synth, fitted, tiny_target, tiny_draft):
    """The rule's numpy (predictor, cost model) runs on one BLAS thread while the policy plans and stops, and the
    process's own setting is back after each call: a multi-threaded OpenBLAS spins its threads on the cores the
    target's next forward needs."""
    from threadpoolctl import threadpool_info

    def blas_threads():
        return [lib["num_threads"] for lib in threadpool_info() if lib["user_api"] == "blas"]

    _, _, cost, _ = synth
    rule = _rule(fitted["mlp"][0], cost, mode="stop")
    seen, predict = [], rule.predictor.predict

    def recording(X):
        seen.append(blas_threads())
        return predict(X)

    rule.predictor = dataclasses.replace(rule.predictor)
    rule.predictor.predict = recording
    before = blas_threads()
    dec = SpeculativeDecoder(tiny_target.model, [ModelDrafter(tiny_draft.model, name="draft")], LearnedPolicy(rule),
                             stop_token_ids=[])
    dec.generate([5, 6, 7, 8] * 6, 12)
    assert seen and all(threads == [1] * len(threads) for threads in seen)
    assert blas_threads() == before


def test_bandit_learns_the_better_arm_online(synth):
    """Replayed over traces where drafting pays, the bandit ends up drafting and beats autoregressive decoding."""
    grouped, _, cost, _ = synth
    bandit = Bandit(ks=(1, 2, 4), cost=cost, discount=1.0)
    res = simulate(bandit, grouped, cost, vocab_size=V)
    ar = simulate(Autoregressive(), grouped, cost, vocab_size=V)
    assert res.tokens_per_s > ar.tokens_per_s
    pulls = dict(zip(bandit.arms, bandit.n))
    assert max(pulls, key=pulls.get) != (None, 0)
    with pytest.raises(ValueError, match="ks"):
        Bandit(ks=())


def test_seed_rule_speculates_less_for_long_prompts_and_under_load():
    rule = SeedRule(k_short=6, k_long=2, short_len=64, long_len=1024, load_weight=1.0)
    assert rule.k_for(10, 0.0) == 6 and rule.k_for(5000, 0.0) == 2  # clamped at both ends
    assert rule.k_for(256, 0.0) == 4  # log-linear: 256 is halfway between 64 and 1024 in log space
    assert [rule.k_for(10, load) for load in (0.0, 0.5, 1.0)] == [6, 3, 0]  # load scales k down to autoregressive
    rule.validate(("ngram",), 8)
    state = DecodeState(RequestInfo(prompt_len=10, drafters=("ngram",), load=0.5), drafters=("ngram",))
    assert decide_one(rule, state) == Decision("ngram", 3)  # the request's load signal
    state.load = 1.0  # the live load a batched decoder measures (rows / max_batch) takes its place
    assert decide_one(rule, state) == Decision.autoregressive()
    with pytest.raises(ValueError, match="load must be in"):
        rule.k_for(10, 1.5)


def test_accept_ema_counts_tokens_at_risk_whatever_the_block_lengths():
    """The feature is accepted / at risk (accepted + the rejected one): a block of 8 that accepts 2 and rejects the
    third says what a block of 3 does, so a predictor trained on one policy's blocks reads another's alike."""
    short = long = None
    for _ in range(3):
        short, long = next_accept_history(short, 2, 3), next_accept_history(long, 2, 8)
    assert accept_rate(short) == accept_rate(long) == pytest.approx(2 / 3)
    assert accept_rate(next_accept_history(None, 4, 4)) == 1.0  # no rejection seen: nothing at risk was lost
    assert accept_rate(next_accept_history(None, 0, 5)) == 0.0
    h = next_accept_history(next_accept_history(None, 1, 4), 3, 3)  # (1, 2) then (3, 3), weighted 0.5 per block
    assert h == (2.0, 2.5) and accept_rate(None) is None
    with pytest.raises(ValueError, match="accepted <= drafted"):
        next_accept_history(None, 3, 2)
    # blocks of 1 and of 8 from one drafter accepting each token with p = 0.6: the rates agree, accepted / drafted
    # (the old feature) did not (0.59 vs 0.18)
    rng = np.random.default_rng(0)
    means = {}
    for k in (1, 8):
        h, rates = None, []
        for _ in range(3000):
            a = 0
            while a < k and rng.random() < 0.6:
                a += 1
            h = next_accept_history(h, a, k)
            rates.append(accept_rate(h))
        means[k] = np.mean(rates)
    assert abs(means[1] - 0.6) < 0.02 and abs(means[1] - means[8]) < 0.1


def test_the_decoder_keeps_each_drafters_acceptance_history(tiny_target, tiny_draft):
    """Live: the history a policy reads before each step folds every earlier block of that drafter."""

    class Watch(Static):
        def __init__(self):
            super().__init__(3, None)
            self.seen, self.records = [], []

        def decide(self, rows):
            (row,) = rows
            self.seen.append(dict(row.state.accept_history))
            return [Decision(("ngram", "draft")[len(self.seen) % 2], 3)]

        def observe(self, row, record):
            self.records.append(record)

    policy = Watch()
    drafters = [NgramDrafter(name="ngram"), ModelDrafter(tiny_draft.model, name="draft")]
    dec = SpeculativeDecoder(tiny_target.model, drafters, policy, stop_token_ids=[])
    dec.generate([5, 6, 7, 8] * 6, 24)
    expect = {}
    for seen, record in zip(policy.seen, policy.records):
        assert seen == expect
        if record.drafter is not None and record.drafted:
            expect[record.drafter] = next_accept_history(expect.get(record.drafter), record.accepted, record.drafted)
    assert len(expect) == 2


def test_learned_policy_per_request_keeps_its_first_choice():
    """select="request": the drafter chosen at the first step is kept for the whole request; "step" re-chooses."""

    class Cheaper(Predictor):  # the better drafter changes: "b" (index 1) accepts 0.95 early, then "a" does
        def __init__(self):
            super().__init__("linear", {"mean": np.zeros(len(FEATURE_NAMES)), "scale": np.ones(len(FEATURE_NAMES)),
                                        "coef": np.zeros(len(FEATURE_NAMES)), "intercept": np.zeros(1)},
                             {"features": feature_spec()})

        def predict(self, X):
            X = np.asarray(X)
            return np.where(X[:, FEATURE_NAMES.index("drafter_index")] == (1 if self.early else 0), 0.95, 0.8)

    names = ("a", "b")
    cost = cost_model(list(names))
    pred = Cheaper()
    rule = DecisionRule(pred, cost, names, 4, ("a", 2), mode="k")
    for select, expected in (("request", ["b", "b"]), ("step", ["b", "a"])):
        policy = LearnedPolicy(rule, select=select)
        request = RequestInfo(prompt_len=10, max_new_tokens=32, drafters=names)
        policy.validate(names, 8)
        memory = policy.start(request)
        chosen = []
        for step, pred.early in ((0, True), (1, False)):
            state = DecodeState(request, step=step, context_len=10 + step, remaining=20, drafters=names)
            chosen.append(decide_one(policy, state, memory).drafter)
        assert chosen == expected, select


def test_a_peeked_proposal_gives_each_position_its_confidence_and_bounds_k():
    """The planner reads a peek per position (the suffix drafter's confidences fall along its proposal) and plans no
    position beyond the peeked proposal's end: a drafter that would propose 2 tokens gets k <= 2 however sure it is,
    and a position's row equals the row of that token once drafted (what the stop rule then reads)."""
    from sacpolicy.runtime.features import RowContext, feature_row, plan_rows

    top1 = FEATURE_NAMES.index("top1")
    peek = ((0.9, 0.1, 0.8), (0.6, 0.5, 0.3), (0.3, 0.9, 0.1))
    ctx = RowContext(context_len=20, drafter_index=0, peek=peek)
    rows = plan_rows(ctx, 8)
    assert len(rows) == 3 and [r[top1] for r in rows] == [0.9, 0.6, 0.3]
    assert rows[2] == feature_row(ctx, 2, peek[2], prev_top1=0.6)
    assert np.isnan(feature_row(ctx, 5)[top1])  # beyond the proposal: unknown, as with no peek
    assert len(plan_rows(RowContext(context_len=20, drafter_index=0), 8)) == 8

    class Sure(Predictor):  # every position is accepted with probability 0.99
        def __init__(self):
            super().__init__("linear", {"mean": np.zeros(len(FEATURE_NAMES)), "scale": np.ones(len(FEATURE_NAMES)),
                                        "coef": np.zeros(len(FEATURE_NAMES)), "intercept": np.zeros(1)},
                             {"features": feature_spec()})

        def predict(self, X):
            return np.full(len(X), 0.99)

    names = ("a", "b")
    rule = DecisionRule(Sure(), cost_model(list(names)), names, 8, ("a", 2), mode="k")
    short = RowContext(context_len=20, drafter_index=1, peek=peek[:2])
    assert rule.plan({"b": np.array(plan_rows(short, 8))}, 20, 8) == ("b", 2)
    full = RowContext(context_len=20, drafter_index=0)
    name, k = rule.plan({"a": np.array(plan_rows(full, 8)), "b": np.array(plan_rows(short, 8))}, 20, 8)
    assert name == "a" and k > 2  # the longer proposal wins once the short one cannot reach further
    policy = LearnedPolicy(rule)
    request = RequestInfo(prompt_len=10, max_new_tokens=32, drafters=names)
    state = DecodeState(request, context_len=20, remaining=20, drafters=("b",), peeks={"b": peek[:2]})
    assert decide_one(policy, state, policy.start(request)) == Decision("b", 2)


def test_agree_counts_the_other_peeked_proposals_that_start_with_the_same_token():
    """``agree``: for a drafter that peeked, +1 per other drafter whose peeked proposal starts with its first token
    and -1 per other whose proposal starts with another; 0 for a drafter that did not peek (a head: its first token is
    unknown before drafting), whose peek names no token, or that no other drafter's proposal speaks for or against
    (one peekable drafter, as vLLM serves). The decoder's state reads into it at every position of the block."""
    from sacpolicy.policy.features import token_features
    from sacpolicy.runtime.features import Peek, agreement

    agree = FEATURE_NAMES.index("agree")
    c = (0.5, 0.1, 0.4)
    peeks = {"ngram": Peek((c, c), first=7), "suffix": Peek((c,), first=7), "other": Peek((c,), first=3),
             "blind": Peek((c,)), "empty": None}
    assert [agreement(peeks, n) for n in ("ngram", "suffix", "other", "blind", "empty", "head", None)] == \
        [0, 0, -2, 0, 0, 0, 0]  # ngram: suffix agrees, other disagrees; blind and empty count neither way
    assert agreement({"ngram": Peek((c,), 5), "suffix": Peek((c,), 5), "x": Peek((c,), 5)}, "x") == 2
    assert agreement({"ngram": Peek((c,), 5), "suffix": None}, "ngram") == 0  # nobody else proposed
    assert agreement({"ngram": Peek((c,), 5)}, "ngram") == 0
    peeks = {n: p for n, p in peeks.items() if n != "other"}
    names = ("head", "ngram", "suffix")
    request = RequestInfo(prompt_len=10, max_new_tokens=32, drafters=names)
    state = DecodeState(request, context_len=20, remaining=20, drafters=names, peeks=peeks, drafter="ngram")
    assert [token_features(state, None, None, drafter=d, position=0)[agree] for d in names] == [0.0, 1.0, 1.0]
    assert token_features(state, DraftToken(1, 0.5, 0.1, 0.4), 0.5)[agree] == 1.0  # the stop rule's rows too
    state.peeks = {**peeks, "suffix": Peek((c,), first=8)}
    assert token_features(state, None, None, drafter="ngram", position=3)[agree] == -1.0
