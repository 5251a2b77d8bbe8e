"""A verification budget the batch shares: where a host's pass costs the tokens it feeds (vLLM flattens the batch),
the rows' k are allocated jointly (``CostModel.allocate_batch_k``), exactly the best k vector; the learned rule plans
with it for such a host, and a batch of one plans as before."""

import itertools
from dataclasses import replace

import numpy as np
import pytest

from sacpolicy.runtime.cost import CostModel, PiecewiseLinear


def curve(xs, ys, per_context=0.0):
    return {"tokens": PiecewiseLinear(xs, ys), "per_context": per_context}


def random_cost(rng: np.random.Generator, verify_pass: str = "total") -> CostModel:
    """A model drafter with a per-proposal cost and batched drafting, an n-gram one paid per proposal, verify curves
    at B = 1, 2, 4 rising with the tokens fed at random slopes (steps included: a GPU's flat-then-steep curve)."""
    def rising(scale):
        ys = np.cumsum(rng.uniform(0.0, 1.0, 4) * scale * rng.choice([0.1, 1.0, 3.0], 4)) + scale
        return curve([1, 3, 6, 9], ys.tolist(), float(rng.uniform(0, 1e-5)))

    return CostModel("cpu", rising(0.02), {"draft": PiecewiseLinear([0.0, 500.0], rng.uniform(1e-3, 2e-2, 2).tolist()),
                                           "ngram": PiecewiseLinear([0.0], [float(rng.uniform(1e-4, 2e-2))])},
                     {"draft": True, "ngram": False}, batch={2: rising(0.03), 4: rising(0.05)},
                     draft_fixed={"draft": PiecewiseLinear([0.0], [float(rng.uniform(0, 2e-2))])},
                     draft_batch={"draft": PiecewiseLinear([1.0, 4.0], [1.0, float(rng.uniform(0.2, 1.0))])},
                     verify_pass=verify_pass)


def random_rows(rng: np.random.Generator, B: int, cap: int):
    rows = []
    for _ in range(B):
        d = rng.choice(["draft", "ngram", None], p=[0.45, 0.45, 0.1])
        n = 0 if d is None else int(rng.integers(1, cap + 1))
        rows.append((None if d is None else str(d), float(rng.uniform(10, 400)), rng.uniform(0, 1, n).tolist()))
    return rows


def total_rate(cost: CostModel, rows, ks) -> float:
    """The batch's expected tokens/s of a flattened pass, written out from the cost model's definitions."""
    B = len(rows)
    ctx = sum(c for _, c, _ in rows) / B
    together = {d: sum(1 for dd, _, a in rows if dd == d and len(a)) for d, _, _ in rows}
    tokens = sum(CostModel.expected_tokens(a[:k]) for (_, _, a), k in zip(rows, ks))
    seconds = cost.verify_total_time(B + sum(ks), ctx, B) + sum(
        cost.draft_time(d, k, c, together[d]) for (d, c, _), k in zip(rows, ks))
    return tokens / seconds


@pytest.mark.parametrize("seed", range(40))
def test_joint_allocation_is_the_brute_force_optimum(seed):
    rng = np.random.default_rng(seed)
    cost = random_cost(rng)
    B = int(rng.integers(1, 5))
    rows = random_rows(rng, B, 3 if B > 2 else 5)
    k_max = int(rng.integers(1, 6))
    ks, tps = cost.allocate_batch_k(rows, k_max)
    caps = [min(k_max, len(a)) if d is not None else 0 for d, _, a in rows]
    best = max(total_rate(cost, rows, v) for v in itertools.product(*(range(c + 1) for c in caps)))
    assert tps == pytest.approx(best, rel=1e-12)
    assert tps == pytest.approx(total_rate(cost, rows, ks), rel=1e-12)
    assert all(0 <= k <= c for k, c in zip(ks, caps))


def test_a_flattened_pass_costs_the_profiled_pass_at_the_mean_width():
    cost = random_cost(np.random.default_rng(0))
    for B in (1, 2, 3, 4):
        for k in range(9):  # every row at one width: the tokens fed are B (k + 1), as profiled
            assert cost.verify_total_time(B * (k + 1), 100.0, B) == pytest.approx(cost.verify_time(k, 100.0, B))
    # between widths, the linear interpolation of the curve: 2 rows drafting 1 and 3 tokens cost a pass at width 3
    assert cost.verify_total_time(6, 100.0, 2) == pytest.approx(cost.verify_time(2, 100.0, 2))
    assert cost.token_seconds(6, 100.0, 2) > 0.0 == replace(cost, verify_pass="padded").token_seconds(6, 100.0, 2)
    with pytest.raises(ValueError, match="at least 4 tokens"):
        cost.verify_total_time(3, 100.0, 4)
    with pytest.raises(ValueError, match="verify_pass must be one of"):
        replace(cost, verify_pass="flat")


def cpu_cost(verify_pass: str) -> CostModel:
    """A CPU-like curve (9 tokens fed cost 1.5x one) and an n-gram lookup of 10 us."""
    return CostModel("cpu", curve([1, 9], [0.050, 0.075]), {"ngram": PiecewiseLinear([0.0], [1e-5])},
                     {"ngram": False}, batch={4: curve([1, 9], [0.080, 0.120])}, verify_pass=verify_pass)


def test_a_row_unlikely_to_be_accepted_drafts_nothing_while_the_others_draft_8():
    """A flattened pass where drafting pays (a CPU-like curve: 9 tokens fed cost 1.5x one): rows that copy well draft
    their cap; a row whose tokens are almost never accepted drafts nothing, where a padded pass's plan, whose width
    the others already pay for, lets it draft (its tokens cost only their lookup)."""
    cost = cpu_cost("total")
    rows = [("ngram", 200.0, [0.95] * 8)] * 3 + [("ngram", 200.0, [0.01] * 8)]
    ks, tps = cost.allocate_batch_k(rows, 8)
    assert ks == [8, 8, 8, 0]
    assert cost.best_batch_k(rows, 8) == (ks, tps)  # best_batch_k allocates jointly for a "total" pass
    padded, _ = replace(cost, verify_pass="padded").best_batch_k(rows, 8)
    assert padded[:3] == [8, 8, 8] and padded[3] > 0
    assert tps > total_rate(cost, rows, padded)  # priced as the flattened pass it is, the padded plan loses


def test_a_batch_of_one_plans_as_a_padded_pass_does():
    rng = np.random.default_rng(1)
    for _ in range(30):
        cost = random_cost(rng)
        rows = random_rows(rng, 1, 8)
        assert cost.best_batch_k(rows, 8) == replace(cost, verify_pass="padded").best_batch_k(rows, 8)


def test_the_shape_round_trips_and_older_files_are_padded(tmp_path):
    cost = random_cost(np.random.default_rng(2))
    cost.to_json(tmp_path / "cost.json")
    assert CostModel.from_json(tmp_path / "cost.json").verify_pass == "total"
    d = replace(cost, verify_pass="padded").to_dict()
    assert "verify_pass" not in d and CostModel.from_dict(d).verify_pass == "padded"


# ---------------------------------------------------------------- the learned rule over a pass that costs its tokens
def column_rule(cost: CostModel, mode: str = "k"):
    """A rule over one n-gram drafter whose predicted acceptance is feature column 0 (each row sets its own)."""
    from sacpolicy.runtime.features import FEATURE_NAMES, feature_spec
    from sacpolicy.runtime.predictors import Predictor
    from sacpolicy.runtime.rule import DecisionRule

    n = len(FEATURE_NAMES)

    class Column(Predictor):
        def predict(self, X):
            return np.clip(X[:, 0], 0.0, 1.0)

    pred = Column("linear", {"mean": np.zeros(n), "scale": np.ones(n), "coef": np.zeros(n), "intercept": np.zeros(1)},
                  {"features": feature_spec()})
    return DecisionRule(pred, cost, ("ngram",), 8, ("ngram", 2), mode=mode), n


def test_the_rule_plans_a_flattened_pass_jointly_and_a_row_alone_as_before():
    rule, n = column_rule(cpu_cost("total"))
    padded = replace(rule, cost=replace(rule.cost, verify_pass="padded"))

    def rows(*accept):
        out = []
        for a in accept:
            X = np.zeros((8, n))
            X[:, 0] = a
            out.append({"ngram": X})
        return out

    batch = rows(0.95, 0.95, 0.95, 0.01)
    plans, rate = rule.plan_batch(batch, [200] * 4, [8] * 4)
    assert plans == [("ngram", 8)] * 3 + [(None, 0)]
    assert rate == pytest.approx(rule.cost.allocate_batch_k([("ngram", 200, [0.95] * 8)] * 3
                                                            + [("ngram", 200, [0.01] * 8)], 8)[1])
    assert padded.plan_batch(batch, [200] * 4, [8] * 4)[0][3][1] > 0
    # a row alone: the same decision whatever the pass's shape, in both modes, at any acceptance
    for mode in ("k", "stop"):
        for a in np.linspace(0.0, 1.0, 11):
            one = [rows(a)[0]]
            assert (replace(rule, mode=mode).plan_batch(one, [200], [8])
                    == replace(padded, mode=mode).plan_batch(one, [200], [8]))


def test_in_a_flattened_pass_a_rows_stop_rule_pays_the_pass_for_its_next_token():
    """An n-gram proposal is paid once, so in a padded pass its next token costs nothing and the block never stops
    early; where the pass costs its tokens, the next token costs the pass's seconds per token at the batch's rate."""
    from sacpolicy.runtime.rule import Block

    rule, n = column_rule(cpu_cost("total"), mode="stop")
    row, nxt = np.zeros(n), np.zeros(n)
    row[0], nxt[0] = 0.9, 0.05  # this token likely accepted, the next one not
    token_s = rule.cost.token_seconds(4 + 12, 200.0, 4)
    assert token_s > 0.0
    assert rule.stop(Block("ngram", 200, 8, batch=4, rate=40.0, token_s=token_s), row, nxt)
    assert not rule.stop(Block("ngram", 200, 8, batch=4, rate=40.0, token_s=0.0), row, nxt)
    nxt[0] = 0.95  # a next token likely accepted pays for its place in the pass
    assert not rule.stop(Block("ngram", 200, 8, batch=4, rate=40.0, token_s=token_s), row, nxt)


def test_the_vllm_proposer_prices_its_pass_by_the_tokens_it_feeds(tmp_path):
    from sacpolicy.export.vllm_cost import vllm_cost_model

    base = cpu_cost("padded")
    steps = {0: [0.05], 2: [0.055], 8: [0.07]}
    cost = vllm_cost_model(base, steps, 100.0, batch_steps={4: {0: [0.08], 2: [0.09], 8: [0.12]}})
    assert cost.verify_pass == "total"
    # the proposer serves any rule's cost model priced by the tokens vLLM's pass feeds, and its step still plans
    from types import SimpleNamespace

    from toys import ngram_batch_rule

    from sacpolicy.export.vllm import PolicyProposer
    from sacpolicy.runtime import save_policy

    rule = ngram_batch_rule()
    assert rule.cost.verify_pass == "padded" and rule.cost.batch
    policy_dir = save_policy(tmp_path / "policy", rule, drafters={"ngram": {"kind": "ngram", "max_ngram": 3}},
                             provenance={}, metrics={})
    cfg = SimpleNamespace(speculative_config=SimpleNamespace(num_speculative_tokens=8),
                          model_config=SimpleNamespace(max_model_len=128))
    served = PolicyProposer(cfg, policy_dir).slot.current
    assert served.load_aware and served.rule.cost.verify_pass == "total"
    assert served.policy.rule.cost.verify_pass == "total"


def test_the_batched_replay_prices_a_flattened_pass_by_its_rows_own_tokens():
    """A host whose pass costs its tokens (``verify_pass="total"``): the replay's pass is priced by the tokens its rows
    drafted, no pads; one row is priced the same either way, and a batch whose blocks differ costs less than padded
    (the curve rises with the tokens fed) with every row's steps the same."""
    from toys import synthetic_traces

    from sacpolicy.policy import Static
    from sacpolicy.traces.simulate import group_traces, simulate_batch

    grouped = group_traces(synthetic_traces(n_prompts=8, length=24))
    padded, total = cpu_cost("padded"), cpu_cost("total")
    policy = Static(6, "ngram")  # n-gram proposals end where the match does: blocks of unequal length
    for B, same in ((1, True), (4, False)):
        p = simulate_batch(policy, grouped, padded, vocab_size=1000, max_batch=B)
        t = simulate_batch(policy, grouped, total, vocab_size=1000, max_batch=B)
        assert [[s.drafted for s in r.steps] for r in p.results] == [[s.drafted for s in r.steps] for r in t.results]
        assert (t.makespan_s == pytest.approx(p.makespan_s)) if same else t.makespan_s < p.makespan_s
