"""The cost model: piecewise-linear fits, expected tokens, choosing k, profiling real (tiny) models, JSON files.

No assertion here depends on how fast this machine is: profiled times are only checked to be positive and finite.
"""

import json
import logging
import math

import numpy as np
import pytest

from sacpolicy.decoding.drafters import ModelDrafter, NgramDrafter
from sacpolicy.profiling import COST_FORMAT, CostModel, PiecewiseLinear, profile

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
