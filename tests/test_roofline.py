"""The roofline cost profile (sacpolicy.profiling.roofline, scripts/roofline.py): its physics, on paper constants."""

from __future__ import annotations

import json

import pytest

from sacpolicy.profiling.roofline import DEVICES, MODELS, Device, pass_time, ridge_tokens, roofline_cost_model
from sacpolicy.runtime.cost import CostModel
from sacpolicy.runtime.curve import PiecewiseLinear

H100, L8B = DEVICES["h100-sxm"], MODELS["llama-3.1-8b"]


@pytest.fixture(scope="module")
def cost() -> CostModel:
    return roofline_cost_model("h100-sxm", "llama-3.1-8b", drafters={"draft": "llama-3.2-1b"})


def test_the_shapes_are_the_published_models():
    assert L8B.params == pytest.approx(8.03e9, rel=0.002)  # Llama-3.1-8B: 8.03B parameters
    assert MODELS["llama-3.2-1b"].params == pytest.approx(1.24e9, rel=0.01)  # Llama-3.2-1B: 1.24B
    assert L8B.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2  # K and V, 32 layers, 8 KV heads of 128, bf16
    assert ridge_tokens(L8B, H100) == pytest.approx(2 * 989.5e12 / (2 * 3.35e12))


def test_a_verify_pass_is_flat_in_k_while_memory_bound(cost):
    # one row: reading 16 GB of weights dominates; feeding 9 tokens instead of 1 costs well under 1% more
    t = [cost.verify_time(k, 512) for k in range(9)]
    assert t[0] == pytest.approx(L8B.linear_params * 2 / 3.35e12, rel=0.03)  # ~ weights read / bandwidth
    assert t[8] / t[0] < 1.01 and t == sorted(t)


def test_once_compute_bound_time_grows_with_batch_times_k(cost):
    # 256 rows: T = 256 (k + 1) tokens per pass, past the ridge (~295) from k = 1: time ~ linear in T there
    t = {k: cost.verify_time(k, 0, 256) for k in (1, 3, 7)}
    assert t[3] / t[1] == pytest.approx(2.0, rel=0.05) and t[7] / t[3] == pytest.approx(2.0, rel=0.05)
    linear_flops = 2 * L8B.linear_params * 256 * 8
    assert t[7] == pytest.approx(linear_flops / 989.5e12, rel=0.05)
    # and the same tokens per pass cost the same, however split into rows and k (context 0: no cache reads)
    assert pass_time(L8B, H100, 128, 8, 0) == pytest.approx(pass_time(L8B, H100, 256, 4, 0), rel=0.01)
    # drafting deep costs more at a large batch than at a small one: k = 8 is free at B = 1, not at B = 256
    assert cost.verify_time(8, 512, 256) / cost.verify_time(0, 512, 256) > 2.5
    assert cost.verify_time(8, 512, 4) / cost.verify_time(0, 512, 4) < 1.01


def test_kv_reads_grow_with_context_and_rows(cost):
    bw = 3.35e12
    for rows in (1, 64):
        extra = cost.verify_time(0, 4096, rows) - cost.verify_time(0, 1024, rows)
        assert extra == pytest.approx(rows * 3072 * L8B.kv_bytes_per_token / bw, rel=0.01)
    # the prefill curve: a long prompt is compute-bound, its cost grows faster than its length
    assert cost.prefill_time(4096) / cost.prefill_time(1024) > 4.0
    assert cost.prefill_time(64) == pytest.approx(cost.verify_time(0, 0), rel=0.05)  # short: still weight-bound


def test_model_drafters_draft_per_token_and_share_their_weight_reads(cost):
    d1 = cost.draft_time("draft", 1, 512)
    assert d1 == pytest.approx(MODELS["llama-3.2-1b"].params * 2 / 3.35e12, rel=0.05)
    assert cost.draft_time("draft", 4, 512) == pytest.approx(4 * d1, rel=0.01)
    # 16 rows drafting together read the weights once: each row's share ~ 1 / 16
    assert cost.draft_time("draft", 1, 512, rows=16) < d1 / 10


def test_the_simulator_reads_it_as_a_cost_json(cost, tmp_path):
    path = tmp_path / "cost.json"
    cost.to_json(path)
    back = CostModel.from_json(path)
    assert back.verify_time(5, 777, 100) == pytest.approx(cost.verify_time(5, 777, 100))
    assert back.meta["source"] == "roofline" and back.meta["simulated"] and "datasheet" in back.meta["device"]["source"]
    # what the policies read from it: deep speculation at one row, shallow at a full batch
    acc = [0.7] * 8
    k1, _ = back.best_k("draft", 512, acc, 8, batch=1)
    k256, _ = back.best_k("draft", 512, acc, 8, batch=256)
    assert k1 > k256


def test_model_free_drafters_come_from_a_measured_profile_and_bad_input_is_refused():
    ngram = PiecewiseLinear([64, 1024], [2e-5, 3e-5])
    cost = roofline_cost_model("h100-sxm", "llama-3.1-8b", model_free={"ngram": ngram})
    assert cost.draft_time("ngram", 5, 64) == pytest.approx(2e-5) and not cost.per_token_draft["ngram"]
    with pytest.raises(ValueError, match="unknown device 'a100'.*h100-sxm"):
        roofline_cost_model("a100", "llama-3.1-8b")
    with pytest.raises(ValueError, match="both as a model and as a model-free"):
        roofline_cost_model("h100-sxm", "llama-3.1-8b", drafters={"ngram": "llama-3.2-1b"}, model_free={"ngram": ngram})
    with pytest.raises(ValueError, match="efficiency in"):
        Device("x", 1e12, 1e14, "made up", efficiency=1.5)
    slow = roofline_cost_model("h100-sxm", "llama-3.1-8b", efficiency=0.5, pass_overhead_s=1e-4)
    assert slow.verify_time(0, 512) == pytest.approx(2 * roofline_cost_model("h100-sxm", "llama-3.1-8b")
                                                     .verify_time(0, 512) + 1e-4, rel=1e-6)


def test_the_script_writes_it_with_a_measured_profiles_model_free_drafters(tmp_path, capsys):
    from toys import load_script

    measured = roofline_cost_model("h100-sxm", "llama-3.1-8b", drafters={"draft": "llama-3.2-1b"},
                                   model_free={"ngram": PiecewiseLinear([64], [4e-5])})
    measured.to_json(tmp_path / "measured.json")
    out = tmp_path / "h100.json"
    rc = load_script("roofline").main(["--draft", "eagle3=eagle3-llama-3.1-8b", "--model-free-from",
                                       str(tmp_path / "measured.json"), "--batch-sizes", "1,8,64", "--out", str(out)])
    assert rc == 0 and "| 64 |" in capsys.readouterr().out
    got = json.loads(out.read_text())
    assert got["per_token_draft"] == {"eagle3": True, "ngram": False} and set(got["batch"]) == {"8", "64"}
