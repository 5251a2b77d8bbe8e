"""The cost model: piecewise-linear fits, expected tokens, choosing k, knot intervals and the monotone verify cost,
profiling real (tiny) models, JSON files.

No assertion here depends on how fast this machine is: profiled times are only checked to be positive and finite.
"""

import json
import logging
import math

import numpy as np
import pytest
from toys import synthetic_traces

from sacpolicy.decoding.drafters import ModelDrafter, NgramDrafter
from sacpolicy.policy import Autoregressive, Static
from sacpolicy.profiling import (
    COST_FORMAT,
    CostModel,
    PiecewiseLinear,
    fit_cost_model,
    monotone_knots,
    pool_adjacent_violators,
    profile,
)
from sacpolicy.traces.simulate import group_traces, simulate

TRUTH = PiecewiseLinear([0.0, 2.0, 5.0, 10.0], [1.0, 3.0, 2.0, 6.0])


# ---------------------------------------------------------------------- PiecewiseLinear
def test_piecewise_interpolates_and_extrapolates():
    assert [TRUTH(x) for x in TRUTH.xs] == TRUTH.ys
    assert TRUTH(1.0) == pytest.approx(2.0)
    assert TRUTH(3.5) == pytest.approx(2.5)
    assert TRUTH(12.0) == pytest.approx(6.0 + 2 * 0.8)  # last segment's slope continues
    assert TRUTH(-1.0) == pytest.approx(0.0)  # first segment's slope continues
    assert PiecewiseLinear([3.0], [0.5])(100.0) == 0.5  # one knot: a constant


def test_piecewise_fit_recovers_a_piecewise_linear_function():
    x = np.linspace(-1.0, 12.0, 57)
    fit = PiecewiseLinear.fit(x, [TRUTH(v) for v in x], knots=[5.0, 0.0, 10.0, 2.0])  # any order
    assert fit.xs == TRUTH.xs
    assert fit.ys == pytest.approx(TRUTH.ys, abs=1e-9)
    for v in (-3.0, 0.7, 4.2, 7.5, 15.0):
        assert fit(v) == pytest.approx(TRUTH(v), abs=1e-9)


def test_piecewise_fit_is_least_squares_with_noise():
    rng = np.random.default_rng(0)
    x = rng.uniform(0.0, 10.0, 400)
    y = np.array([TRUTH(v) for v in x]) + rng.normal(0.0, 0.05, x.size)
    assert PiecewiseLinear.fit(x, y, TRUTH.xs).ys == pytest.approx(TRUTH.ys, abs=0.05)


def test_piecewise_rejects_bad_knots():
    with pytest.raises(ValueError, match="strictly increasing"):
        PiecewiseLinear([1.0, 1.0], [0.0, 1.0])
    with pytest.raises(ValueError, match="as many ys as xs"):
        PiecewiseLinear([1.0, 2.0], [0.0])


# ---------------------------------------------------------------------- expected tokens and best k
def test_expected_tokens_hand_computed():
    assert CostModel.expected_tokens([1, 1, 1]) == 4.0
    assert CostModel.expected_tokens([0.5, 0.5]) == pytest.approx(1 + 0.5 + 0.25)
    assert CostModel.expected_tokens([]) == 1.0
    assert CostModel.expected_tokens([0.0, 1.0, 1.0]) == 1.0  # nothing after a certain rejection counts
    assert CostModel.expected_tokens([0.8, 0.5]) == pytest.approx(1 + 0.8 + 0.4)
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        CostModel.expected_tokens([1.2])


def hand_model(draft_per_token_s: float = 0.001) -> CostModel:
    """Verify: 10 ms for one token, +0.5 ms per extra token fed, +1 us per cached token."""
    return CostModel(
        device="cpu",
        verify={"tokens": PiecewiseLinear([1.0, 9.0], [0.010, 0.014]), "per_context": 1e-6},
        draft={"draft": PiecewiseLinear([0.0, 1000.0], [draft_per_token_s, 2 * draft_per_token_s]),
               "ngram": PiecewiseLinear([0.0], [0.0002])},
        per_token_draft={"draft": True, "ngram": False},
    )


def test_step_times_follow_the_model():
    cost = hand_model()
    assert cost.verify_time(0, 0) == pytest.approx(0.010)
    assert cost.verify_time(4, 100) == pytest.approx(0.012 + 100e-6)
    assert cost.draft_time(None, 4, 100) == 0.0
    assert cost.draft_time("draft", 0, 100) == 0.0
    # per token: 4 steps at the block's middle context (0 + 1.5 -> 0.001 * (1 + 1.5 / 1000))
    assert cost.draft_time("draft", 4, 0) == pytest.approx(4 * 0.001 * (1 + 1.5 / 1000))
    assert cost.draft_time("ngram", 1, 500) == cost.draft_time("ngram", 8, 500) == pytest.approx(0.0002)
    assert cost.step_time("draft", 4, 0) == pytest.approx(cost.draft_time("draft", 4, 0) + cost.verify_time(4, 0))
    with pytest.raises(ValueError, match="'eagle'.*profiled"):
        cost.draft_time("eagle", 2, 10)


def test_a_per_proposal_draft_cost_is_paid_once_per_block_and_round_trips(tmp_path):
    """A feature head feeds the rows committed since its last proposal before it drafts: ``draft_fixed`` adds that
    once per proposal (not per token, not when nothing is drafted), and survives the JSON file."""
    cost = hand_model()
    cost.draft_fixed = {"draft": PiecewiseLinear([0.0, 1000.0], [0.003, 0.005])}
    per_token = hand_model().draft_time
    assert cost.draft_time("draft", 0, 500) == 0.0
    assert cost.draft_time("draft", 1, 500) == pytest.approx(0.004 + per_token("draft", 1, 500))
    assert cost.draft_time("draft", 4, 500) == pytest.approx(0.004 + per_token("draft", 4, 500))
    # the stop rule's marginal token still costs one step
    assert cost.draft_time("draft", 5, 0) - cost.draft_time("draft", 4, 0) == pytest.approx(
        per_token("draft", 5, 0) - per_token("draft", 4, 0))
    cost.to_json(tmp_path / "cost.json")
    assert CostModel.from_json(tmp_path / "cost.json") == cost
    assert "draft_fixed" not in hand_model().to_dict()  # files without one keep the old layout
    with pytest.raises(ValueError, match=r"\['ngram'\] is not per-token"):
        CostModel("cpu", cost.verify, cost.draft, cost.per_token_draft,
                  draft_fixed={"ngram": PiecewiseLinear([0.0], [0.1])})


def test_rows_drafting_together_pay_their_profiled_share_and_it_round_trips(tmp_path):
    """``draft_batch``: a model drafter's rows drafting together each pay g(r) of one row's draft time (interpolated
    between the profiled r, the last one's beyond them); a drafter without one pays its one-row time; the batch plan
    prices each row at the number of rows drafting with its drafter; the share survives the JSON file."""
    cost = hand_model()
    cost.draft_batch = {"draft": PiecewiseLinear([1.0, 4.0, 16.0], [1.0, 0.5, 0.2])}
    one = cost.draft_time("draft", 3, 100)
    assert cost.draft_time("draft", 3, 100, rows=1) == one
    assert cost.draft_time("draft", 3, 100, rows=4) == pytest.approx(0.5 * one)
    assert cost.draft_time("draft", 3, 100, rows=10) == pytest.approx(0.35 * one)
    assert cost.draft_time("draft", 3, 100, rows=64) == pytest.approx(0.2 * one)  # not extrapolated below
    assert cost.draft_time("draft", 0, 100, rows=4) == 0.0
    assert cost.draft_time("ngram", 3, 100, rows=8) == cost.draft_time("ngram", 3, 100)
    assert cost.step_time("draft", 3, 100, rows=4) == pytest.approx(0.5 * one + cost.verify_time(3, 100))
    assert cost.tokens_per_s_table("draft", 100, [0.5] * 3, rows=4)[2] == pytest.approx(
        cost.expected_tokens([0.5] * 3) / (0.5 * one + cost.verify_time(3, 100)))
    # a batch of three rows, two drafting with "draft": each of those pays its share at 2 rows (0.833)
    cost.batch = {4: cost.verify}
    rows = [("draft", 100, [0.9] * 3), ("draft", 100, [0.9] * 3), ("ngram", 100, [0.9] * 3)]
    ks, tps = cost.best_batch_k(rows, 3, per_row=False)
    share = cost.draft_batch["draft"](2)
    assert share == pytest.approx(1 - 0.5 / 3)
    seconds = cost.verify_time(max(ks), 100, 3) + sum(
        (share if d == "draft" else 1.0) * cost.draft_time(d, k, c) for (d, c, _), k in zip(rows, ks))
    assert tps == pytest.approx(sum(cost.expected_tokens(a[:k]) for (_, _, a), k in zip(rows, ks)) / seconds)
    cost.to_json(tmp_path / "cost.json")
    assert CostModel.from_json(tmp_path / "cost.json") == cost
    assert "draft_batch" not in hand_model().to_dict()
    with pytest.raises(ValueError, match="draft_batch names drafter 'eagle'"):
        CostModel("cpu", cost.verify, cost.draft, cost.per_token_draft,
                  draft_batch={"eagle": PiecewiseLinear([1.0, 2.0], [1.0, 0.6])})
    with pytest.raises(ValueError, match="must start at 1 row with share 1"):
        CostModel("cpu", cost.verify, cost.draft, cost.per_token_draft,
                  draft_batch={"draft": PiecewiseLinear([2.0, 4.0], [0.8, 0.6])})


def test_the_decoders_own_work_is_priced_for_one_row_and_round_trips(tmp_path):
    """``step_base`` is paid by a one-row step (in its target pass's time); a drafter's ``step_draft(k)`` by a row
    drafting k > 0 tokens with it alone; batches and rows drafting together are priced by their passes alone (the
    terms were timed for one row); both survive the JSON file, and files without them keep the old layout."""
    plain = hand_model()
    cost = hand_model()
    cost.step_base = 0.002
    cost.step_draft = {"draft": PiecewiseLinear([1.0, 4.0], [0.001, 0.004])}
    cost.draft_batch = {"draft": PiecewiseLinear([1.0, 4.0], [1.0, 0.5])}
    cost.batch = {4: cost.verify}
    plain.batch = {4: plain.verify}
    assert cost.verify_time(0, 0) == pytest.approx(plain.verify_time(0, 0) + 0.002)
    assert cost.verify_time(3, 100, batch=4) == plain.verify_time(3, 100, batch=4)
    assert cost.verify_table(2, 100) == pytest.approx([t + 0.002 for t in plain.verify_table(2, 100)])
    assert cost.draft_time("draft", 0, 100) == 0.0
    assert cost.draft_time("draft", 2, 100) == pytest.approx(plain.draft_time("draft", 2, 100) + 0.002)
    assert cost.draft_time("draft", 2, 100, rows=4) == pytest.approx(0.5 * plain.draft_time("draft", 2, 100))
    assert cost.draft_time("ngram", 3, 100) == plain.draft_time("ngram", 3, 100)  # no curve: nothing added
    assert 1 / cost.expected_tokens_per_s(None, 0, 100, ()) == pytest.approx(plain.verify_time(0, 100) + 0.002)
    cost.step_base = -0.5  # a large negative calibration still leaves a positive time
    assert cost.verify_time(0, 0) > 0
    cost.step_base = 0.002
    cost.to_json(tmp_path / "cost.json")
    assert CostModel.from_json(tmp_path / "cost.json") == cost
    assert "step_base" not in plain.to_dict() and "step_draft" not in plain.to_dict()
    with pytest.raises(ValueError, match=r"step_draft names drafters \['eagle'\]"):
        CostModel("cpu", cost.verify, cost.draft, cost.per_token_draft,
                  step_draft={"eagle": PiecewiseLinear([1.0], [0.001])})


def test_step_overhead_is_fitted_on_medians():
    """``fit_step_overhead``: the autoregressive steps' median, and per drafter the median per tokens drafted less
    it, as a line: a step the machine interrupted moves neither. A drafter that never drafted gets no curve."""
    from sacpolicy.profiling import fit_step_overhead

    cost = fit_step_overhead(hand_model(), [0.001, 0.001, 0.5],
                             {"draft": [(1, 0.003), (1, 0.003), (3, 0.007), (3, 0.007), (3, 9.0)], "ngram": []},
                             {"temperature": 0.7})
    assert cost.step_base == pytest.approx(0.001)
    assert cost.step_draft["draft"].xs == [1.0, 3.0]
    assert cost.step_draft["draft"].ys == pytest.approx([0.002, 0.006])
    assert set(cost.step_draft) == {"draft"}
    assert cost.meta["overhead_sampling"] == {"temperature": 0.7}
    assert cost.meta["overhead_steps"] == {"autoregressive": 3, "draft": 5, "ngram": 0}
    with pytest.raises(ValueError, match="at least one autoregressive step"):
        fit_step_overhead(hand_model(), [], {}, {})
    # steps 5 ms faster than their 10 ms pass as timed alone: the passes were timed on a busier machine
    assert fit_step_overhead(hand_model(), [-0.005] * 3, {}, {}, context_len=0.0).meta["overhead_contended"]
    assert not fit_step_overhead(hand_model(), [-0.001] * 3, {}, {}).meta["overhead_contended"]  # noise


def test_prefill_is_its_profiled_curve_or_the_verify_curve_of_older_files(tmp_path):
    """A prompt's prefill is priced by its own profiled line when there is one; an older file without it extends the
    verify curve to the prompt's length (what the simulator did before)."""
    old = hand_model()
    assert old.prefill_time(300) == pytest.approx(old.verify_time(299, 0))
    cost = hand_model()
    cost.prefill = PiecewiseLinear([64.0, 512.0], [0.02, 0.2])
    assert cost.prefill_time(64) == pytest.approx(0.02) and cost.prefill_time(288) == pytest.approx(0.11)
    cost.to_json(tmp_path / "cost.json")
    assert CostModel.from_json(tmp_path / "cost.json") == cost
    assert "prefill" not in old.to_dict()


def test_expected_tokens_per_s():
    cost = hand_model()
    assert cost.expected_tokens_per_s(None, 0, 0, []) == pytest.approx(100.0)
    assert cost.expected_tokens_per_s("draft", 0, 0, []) == pytest.approx(100.0)
    probs = [1.0, 1.0, 0.0]
    assert cost.expected_tokens_per_s("draft", 2, 0, probs) == pytest.approx(3 / cost.step_time("draft", 2, 0))
    with pytest.raises(ValueError, match="k=4 .* 4 acceptance probabilities, got 3"):
        cost.expected_tokens_per_s("draft", 4, 0, probs)


def test_best_k_with_high_acceptance_drafts():
    k, tps = hand_model().best_k("draft", 100, [0.9] * 8, k_max=8)
    assert k > 0
    assert tps > hand_model().expected_tokens_per_s(None, 0, 100, [])


def test_best_k_is_zero_without_acceptance_or_with_an_expensive_drafter():
    cheap, costly = hand_model(), hand_model(draft_per_token_s=0.02)  # costlier per token than a target pass
    ar = cheap.expected_tokens_per_s(None, 0, 100, [])
    assert cheap.best_k("draft", 100, [0.0] * 8, k_max=8) == (0, pytest.approx(ar))
    assert costly.best_k("draft", 100, [1.0] * 8, k_max=8)[0] == 0
    assert cheap.best_k(None, 100, [1.0] * 8, k_max=8)[0] == 0


def test_best_k_matches_brute_force():
    cost, probs = hand_model(), [0.95, 0.9, 0.8, 0.6, 0.4, 0.3]
    rates = [cost.expected_tokens_per_s("draft", k, 300, probs) for k in range(7)]
    assert cost.best_k("draft", 300, probs, k_max=6) == (int(np.argmax(rates)), pytest.approx(max(rates)))


def test_tables_are_the_per_k_figures_exactly():
    """The planner reads tabulated figures (one pass per row): they must be the per-k functions' numbers, bit for bit,
    or a tie could go the other way between the decoder and a replay."""
    cost, probs = hand_model(), [0.95, 0.9, 0.8, 0.6, 0.4, 0.3]
    assert cost.expected_tokens_table(probs) == [CostModel.expected_tokens(probs[:k]) for k in range(7)]
    assert cost.draft_table("draft", 6, 300) == [cost.draft_time("draft", k, 300) for k in range(7)]
    assert cost.tokens_per_s_table("draft", 300, probs) == [cost.expected_tokens_per_s("draft", k, 300, probs)
                                                            for k in range(1, 7)]
    with pytest.raises(ValueError, match="must lie in"):
        cost.expected_tokens_table([0.5, 1.5])


# ---------------------------------------------------------------------- files
def test_json_round_trip_and_format_check(tmp_path):
    cost = hand_model()
    path = tmp_path / "sub" / "cost.json"
    cost.to_json(path)
    assert [p.name for p in path.parent.iterdir()] == ["cost.json"]  # no temp file left behind
    again = CostModel.from_json(path)
    assert again == cost
    data = json.loads(path.read_text())
    data["format"] = COST_FORMAT + 98
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=f"format {COST_FORMAT + 98}.*format {COST_FORMAT}"):
        CostModel.from_json(path)


def test_old_files_without_intervals_load_and_intervals_round_trip(tmp_path, caplog):
    old = hand_model().to_dict()
    assert "lo" not in old["verify"]["tokens"] and "hi" not in old["draft"]["draft"]  # no interval: the old layout
    assert CostModel.from_dict(json.loads(json.dumps(old))) == hand_model()
    with_iv = hand_model()
    with_iv.verify["tokens"] = PiecewiseLinear([1.0, 9.0], [0.010, 0.014], lo=[0.009, 0.013], hi=[0.011, 0.015])
    path = tmp_path / "cost.json"
    with_iv.to_json(path)
    assert json.loads(path.read_text())["verify"]["tokens"]["hi"] == [0.011, 0.015]
    assert CostModel.from_json(path) == with_iv
    # an old, unrepaired profile whose verify cost falls with more tokens fed: loads, but says to re-profile
    old["verify"]["tokens"] = {"xs": [1.0, 2.0, 5.0], "ys": [0.010, 0.009, 0.012]}
    with caplog.at_level(logging.WARNING, logger="sacpolicy.runtime.cost"):
        CostModel.from_dict(old, source="old.json")
    assert "old.json" in caplog.text and "re-profile" in caplog.text
    with pytest.raises(ValueError, match="both lo and hi"):
        PiecewiseLinear([1.0], [0.1], lo=[0.0])


# ---------------------------------------------------------------------- knot intervals and the monotone verify cost
def test_pool_adjacent_violators_is_isotonic_regression():
    from sklearn.isotonic import IsotonicRegression

    assert pool_adjacent_violators([1.0, 3.0, 2.0, 4.0]).tolist() == [1.0, 2.5, 2.5, 4.0]
    assert pool_adjacent_violators([3.0, 2.0, 1.0]).tolist() == [2.0, 2.0, 2.0]
    assert pool_adjacent_violators([1.0, 2.0, 2.0, 5.0]).tolist() == [1.0, 2.0, 2.0, 5.0]  # monotone: unchanged
    rng = np.random.default_rng(0)
    for _ in range(20):
        x = np.arange(12.0)
        y, w = 0.3 * x + rng.normal(0.0, 1.0, 12), rng.uniform(0.5, 2.0, 12)  # noisy knots of a rising cost
        fit = pool_adjacent_violators(y, w)
        assert np.all(np.diff(fit) >= 0)
        assert fit == pytest.approx(IsotonicRegression().fit_transform(x, y, sample_weight=w), abs=1e-12)


def test_monotone_knots_pool_noise_and_keep_decreases_beyond_it():
    ys, lo, hi = [10.0, 9.9, 12.0], [9.7, 9.6, 11.7], [10.3, 10.2, 12.3]  # 2 below 1 by less than the noise
    fit, kept = monotone_knots(ys, lo, hi)
    assert fit.tolist() == pytest.approx([9.95, 9.95, 12.0]) and kept == []
    ys, lo, hi = [10.0, 6.0, 7.0, 12.0], [9.8, 5.8, 6.8, 11.8], [10.2, 6.2, 7.2, 12.2]  # a real fall at 1 -> 2
    fit, kept = monotone_knots(ys, lo, hi)
    assert fit.tolist() == ys and kept == [0]
    fit, kept = monotone_knots(ys, lo, hi, trust_intervals=False)  # too few repeats to trust: pooled too
    assert np.all(np.diff(fit) >= 0) and kept == []


OFFSETS = np.array([-3, -2, -1, 0, 1, 2, 3]) * 1e-4  # 7 repeats around each cell's median, +-0.3 ms


def cells(base: dict, offsets=OFFSETS, per_context: float = 1e-6) -> list:
    """Verify cells (tokens fed, context, seconds) with median base[tokens fed] + per_context * context."""
    return [(n, c, base[n] + per_context * c + offsets) for n in sorted(base) for c in (16, 64)]


NGRAM = {"ngram": [(16, np.full(7, 1e-6)), (64, np.full(7, 1e-6))]}


def test_fitted_verify_cost_is_monotone_within_noise_with_intervals():
    cost = fit_cost_model("cpu", cells({1: 0.010, 2: 0.00995, 5: 0.012}), NGRAM, {"ngram": False})
    curve = cost.verify["tokens"]
    assert curve.xs == [1.0, 2.0, 5.0]
    assert np.all(np.diff(curve.ys) >= 0) and curve.ys[0] == curve.ys[1] == pytest.approx(0.009975, abs=1e-9)
    assert all(lo <= y <= hi for lo, y, hi in zip(curve.lo, [0.010, 0.00995, 0.012], curve.hi))
    assert curve.hi[1] > curve.lo[0]  # the measured fall lies within the noise
    assert cost.verify["per_context"] == pytest.approx(1e-6, rel=1e-6)
    assert cost.draft["ngram"].lo == cost.draft["ngram"].hi == [1e-6]  # every curve carries its intervals
    assert CostModel.from_dict(json.loads(json.dumps(cost.to_dict()))) == cost


def test_batch_verify_cost_has_a_context_slope_per_tokens_fed(tmp_path):
    """A batched pass's context cost grows with the tokens fed (every row's queries read a cache as wide as the
    longest row): the fit recovers a(tokens) + b(tokens) * context exactly, where one shared slope would misprice the
    wide pass against the narrow one at every context but one. One request keeps one slope."""
    a, b = {1: 0.010, 2: 0.014, 5: 0.020}, {1: 1e-5, 2: 3e-5, 5: 8e-5}
    grid = [(n, c, a[n] + b[n] * c + OFFSETS) for n in sorted(a) for c in (64, 256, 512)]
    cost = fit_cost_model("cpu", cells({1: 0.010, 2: 0.011, 5: 0.012}), NGRAM, {"ngram": False}, batch_cells={4: grid})
    assert isinstance(cost.verify["per_context"], float)
    slope = cost.batch[4]["per_context"]
    assert slope.xs == [1.0, 2.0, 5.0] and slope.ys == pytest.approx([b[1], b[2], b[5]], rel=1e-6)
    for n, intercept in a.items():
        for c in (64, 300, 700):
            assert cost.verify_time(n - 1, c, 4) == pytest.approx(intercept + b[n] * c, rel=1e-6)
    lo, hi = cost.batch[4]["tokens"].lo, cost.batch[4]["tokens"].hi
    assert all(low <= a[n] <= high for low, n, high in zip(lo, sorted(a), hi))  # intervals of the curve, slope held
    cost.to_json(tmp_path / "cost.json")
    again = CostModel.from_json(tmp_path / "cost.json")
    assert again == cost and again.verify_time(4, 300, 4) == cost.verify_time(4, 300, 4)


def test_fitted_verify_cost_keeps_a_decrease_beyond_noise(caplog):
    base = {1: 0.010, 2: 0.006, 5: 0.012}
    with caplog.at_level(logging.WARNING, logger="sacpolicy.profiling"):
        cost = fit_cost_model("cpu", cells(base), NGRAM, {"ngram": False})
    assert cost.verify["tokens"].ys == pytest.approx([0.010, 0.006, 0.012], abs=1e-9)
    assert "falls from 1 to 2 tokens fed beyond noise" in caplog.text
    # two repeats cannot tell it from noise: pooled
    cost = fit_cost_model("cpu", cells(base, offsets=OFFSETS[[0, -1]]), NGRAM, {"ngram": False})
    assert np.all(np.diff(cost.verify["tokens"].ys) >= 0)


def test_static_k1_that_gains_nothing_no_longer_beats_autoregressive():
    """The smoke run's bug: a profile that put 2 tokens fed just below 1 made static-k1 (1.0 tokens per target call)
    simulate faster than autoregressive decoding."""
    rows = synthetic_traces(4, length=16, drafters=("ngram",))
    for r in rows:  # a drafter that always proposes and is never accepted
        r.update(match=False, run_len=0, proposal_len=8)
    grouped = group_traces(rows)
    measured = {1: 0.010, 2: 0.00995, 5: 0.012}

    def rates(cost):
        ar = simulate(Autoregressive(), grouped, cost, vocab_size=1000)
        k1 = simulate(Static(1, "ngram"), grouped, cost, vocab_size=1000)
        assert (k1.tokens, k1.target_calls) == (ar.tokens, ar.target_calls)  # 1.0 tokens per target call
        assert k1.drafted == k1.target_calls - 2 * len(grouped) > 0 and k1.accepted == 0  # not the prefill or last
        return k1.tokens_per_s, ar.tokens_per_s

    raw = CostModel("cpu", {"tokens": PiecewiseLinear(list(measured), list(measured.values())), "per_context": 1e-6},
                    {"ngram": PiecewiseLinear([0.0], [1e-6])}, {"ngram": False})
    k1, ar = rates(raw)
    assert k1 > ar  # the unrepaired profile: drafting a token that is never accepted "pays"
    k1, ar = rates(fit_cost_model("cpu", cells(measured), NGRAM, {"ngram": False}))
    assert k1 < ar


# ---------------------------------------------------------------------- profiling real models
@pytest.fixture(scope="module")
def profiled(tiny_target, tiny_draft):
    drafters = [ModelDrafter(tiny_draft.model, name="draft"), NgramDrafter()]
    return profile(tiny_target.model, drafters, ks=(0, 1, 4), context_lens=(16, 64), repeats=2, warmup=1)


def test_profile_gives_a_well_formed_model(profiled):
    assert profiled.device == "cpu"
    assert profiled.verify["tokens"].xs == [1.0, 2.0, 5.0]  # knots at tokens fed = k + 1
    assert profiled.per_token_draft == {"draft": True, "ngram": False}
    assert profiled.meta["context_lens"] == [16, 64] and profiled.meta["dtype"] == "torch.float32"
    tokens = profiled.verify["tokens"]
    assert len(tokens.lo) == len(tokens.hi) == 3 and all(lo <= hi for lo, hi in zip(tokens.lo, tokens.hi))
    assert tokens.ys == sorted(tokens.ys)  # repeats=2 cannot show a fall beyond noise: non-decreasing
    assert all(c.lo is not None for c in profiled.draft.values())
    assert profiled.prefill.xs == [16.0, 64.0] and profiled.prefill_time(40) > 0  # the prompts' pass, measured
    for ctx in (0, 16, 40, 64, 500):
        for k in (0, 1, 3, 4, 8):
            for drafter in (None, "draft", "ngram"):
                t = profiled.step_time(drafter, k, ctx)
                assert math.isfinite(t) and t > 0
                assert profiled.draft_time(drafter, k, ctx) >= 0
        assert math.isfinite(profiled.expected_tokens_per_s("draft", 4, ctx, [0.7] * 4))
        assert 0 <= profiled.best_k("draft", ctx, [0.7] * 4, k_max=4)[0] <= 4


def test_profiled_json_round_trip_predicts_identically(profiled, tmp_path):
    profiled.to_json(tmp_path / "cost.json")
    again = CostModel.from_json(tmp_path / "cost.json")
    for ctx in (16, 33, 64, 1000):
        for k in (0, 1, 4, 7):
            for drafter in (None, "draft", "ngram"):
                assert again.step_time(drafter, k, ctx) == profiled.step_time(drafter, k, ctx)
    assert again.meta == profiled.meta


def test_profile_accepts_a_mapping_and_skips_contexts_beyond_the_window(tiny_target, caplog):
    with caplog.at_level(logging.WARNING, logger="sacpolicy.profiling"):
        cost = profile(tiny_target, {"lookup": NgramDrafter(name="lookup")}, ks=(0, 2), context_lens=(8, 4096),
                       repeats=1, warmup=0)
    assert "skipping context 4096" in caplog.text
    assert cost.meta["context_lens"] == [8]
    assert cost.verify["per_context"] == 0.0  # one context length cannot separate the per-token cost
    assert cost.draft_time("lookup", 3, 8) > 0


def test_profile_rejects_contexts_that_all_exceed_the_window(tiny_target):
    with pytest.raises(ValueError, match="exceeds the target's context window"):
        profile(tiny_target.model, [], ks=(0,), context_lens=(4096,), repeats=1, warmup=0)


def test_profile_prices_rows_of_a_model_drafter_drafting_together(tiny_target, tiny_draft):
    """A model drafter's rows are timed drafting together as the decoder drafts them (their caches stacked, one
    forward of every row per drafted token): each cell's run drafts all its rows in one forward per token, its undo
    puts every row back on c cached tokens, and the profile keeps a row's share (``draft_batch``) for it alone."""
    import torch

    from sacpolicy.profiling.measure import _model_cells

    drafter = ModelDrafter(tiny_draft.model, name="draft")
    states = {}
    cells = _model_cells(tiny_target.model, drafter, 12, [1, 3], (1, 2), "cpu", torch.Generator().manual_seed(0),
                         states)
    widths = []
    hook = tiny_draft.model.register_forward_hook(lambda m, args, kwargs, out: widths.append(kwargs["input_ids"].shape),
                                                  with_kwargs=True)
    try:
        run, undo = cells[(3, 2)]
        run()
        first = [st.cache.get_seq_length() for st in states[3]]
        undo()
        assert [st.valid for st in states[3]] == [12] * 3
        assert [st.cache.get_seq_length() for st in states[3]] == [12] * 3
        run()
    finally:
        hook.remove()
    # two drafted tokens, every row in each forward; between the runs each row's c tokens are cached again
    assert widths == [(3, 1), (3, 1), *[(1, 12)] * 3, (3, 1), (3, 1)]
    assert first == [st.cache.get_seq_length() for st in states[3]] == [14] * 3  # c + the token + 1 draft

    cost = profile(tiny_target.model, [drafter, NgramDrafter()], ks=(0, 2), context_lens=(16, 32), repeats=3,
                   warmup=1, batch_sizes=(1, 2, 4))
    share = cost.draft_batch["draft"]
    assert set(cost.draft_batch) == {"draft"}
    assert share.xs == [1.0, 2.0, 4.0] and share.ys[0] == 1.0 and min(share.ys) > 0
    assert all(lo <= hi for lo, hi in zip(share.lo, share.hi))
    assert cost.draft_time("draft", 2, 24, rows=4) == pytest.approx(share.ys[2] * cost.draft_time("draft", 2, 24))


def test_profile_times_the_decoders_own_work_at_the_sampling_settings(tiny_target, tiny_draft):
    """With ``sampling``, the real decoder decodes each drafter and k: the cost model gets ``step_base`` and a
    ``step_draft`` curve for each drafter that drafted, and records the settings they were timed at. The loop prompt
    repeats, so the n-gram drafter finds a match at its end (a real target continues the repetition; this random
    one does not, so only the model drafter is sure to draft here)."""
    import torch

    from sacpolicy.decoding.sampling import SamplingConfig
    from sacpolicy.profiling.loop import loop_prompt

    prompt = loop_prompt(1000, 64, torch.Generator().manual_seed(0))
    assert prompt.shape == (64,) and NgramDrafter().peek(None, prompt) is not None

    drafters = [ModelDrafter(tiny_draft.model, name="draft"), NgramDrafter()]
    cost = profile(tiny_target.model, drafters, ks=(0, 2), context_lens=(16, 32), repeats=2, warmup=1,
                   sampling=SamplingConfig(temperature=0.7, top_p=0.9), loop_tokens=6)
    assert cost.meta["overhead_sampling"]["temperature"] == 0.7 and cost.meta["overhead_sampling"]["top_p"] == 0.9
    assert cost.meta["overhead_steps"]["autoregressive"] > 0
    assert "draft" in cost.step_draft and set(cost.step_draft) <= {"draft", "ngram"}
    assert all(1.0 <= x <= 2.0 for curve in cost.step_draft.values() for x in curve.xs)
    assert math.isfinite(cost.step_base) and all(math.isfinite(y) for c in cost.step_draft.values() for y in c.ys)
    assert "step_base" not in profile(tiny_target.model, drafters, ks=(0, 2), context_lens=(16,), repeats=1,
                                      warmup=0).to_dict()  # without sampling: not timed


def test_profile_interleaves_cells_so_a_drifting_machine_tilts_no_curve(monkeypatch):
    """Cells are timed round-robin, each round starting one cell later: on a machine whose every call gets slower
    (a shared CPU under a neighbour's growing load), each cell sees the same drift, where timing one cell's repeats
    after another's would make the cost fall or rise along the order they were timed in."""
    from sacpolicy.profiling import measure as profiling

    clock, calls = [0.0], []
    monkeypatch.setattr(profiling.time, "perf_counter", lambda: clock[0])

    def cell(name):
        def run():
            calls.append(name)
            clock[0] += 1.0 + 0.1 * len(calls)  # every cell costs the same; the machine drifts
        return run, lambda: None

    times = profiling._interleaved_times({n: cell(n) for n in "abcd"}, profiling.torch.device("cpu"),
                                         repeats=8, warmup=1)
    assert calls[:8] == list("abcdbcda")  # one of each per round, the next round one cell later
    assert all(len(t) == 8 for t in times.values())
    means = [t.mean() for t in times.values()]
    assert max(means) - min(means) <= 0.1 * 3  # at most the drift across one round; timed cell after cell, 2.7 s


def test_a_lookup_drafter_is_timed_as_a_live_row_between_steps(tiny_target):
    """A suffix drafter's row indexes its context once, then the few tokens each step commits: the profile times a
    proposal on a row that has seen all but the last step's tokens (not one that indexes the whole context, which
    priced a lookup at ~13x what live steps pay), on a copy of the drafter whose global index it leaves alone."""
    from sacpolicy.decoding import SuffixDrafter

    syncs = []

    class Spy(SuffixDrafter):
        def _sync(self, state, context, output_start=None):
            syncs.append((state.seen, int(context.shape[0])))
            return super()._sync(state, context, output_start)

    spy = Spy()
    profile(tiny_target.model, [spy], ks=(0, 2), context_lens=(16, 32), repeats=2, warmup=1)
    timed = [(seen, n) for seen, n in syncs if n in (16, 32)]
    assert len(timed) >= 2 * 3 and all(seen == n - 2 for seen, n in timed), timed
    assert spy.index.num_nodes == 0  # the profile's random contexts never reach the drafter's global index
