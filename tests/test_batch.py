"""The batched decoder (``SpeculativeDecoder.generate_batch``): every row of every batch is exactly what decoding that
prompt alone gives (greedy), sampled rows follow the target's distribution, rows join and leave a running batch, a
failing drafter costs only its own row, and bad input is refused."""

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from scipy.stats import chisquare
from toys import Markov, decide_one, markov_pair, mixed_prompts, policy_rows, propose_one

from sacpolicy.decoding import (
    DecoderConfig,
    DraftRow,
    LayerSkipDrafter,
    ModelDrafter,
    NgramDrafter,
    RequestInfo,
    SamplingConfig,
    SpeculativeDecoder,
)
from sacpolicy.decoding.ragged import RaggedCache
from sacpolicy.policy import Autoregressive, Confidence, Heuristic, SeedRule, Static


@pytest.fixture(scope="module")
def prompts():
    return mixed_prompts((5, 23, 1, 37, 12), seed=0, repeats=6)


@pytest.fixture(scope="module")
def reference(tiny_target, prompts):
    """Each prompt decoded alone, autoregressively: what every batched row must reproduce."""
    dec = SpeculativeDecoder(tiny_target.model, stop_token_ids=[])
    return [dec.generate(p, 20).tokens for p in prompts]


def drafters(target, draft):
    return [ModelDrafter(draft.model, name="draft"), LayerSkipDrafter(target.model, 2), NgramDrafter()]


@pytest.mark.parametrize("policy", [Autoregressive(), Static(3, "ngram"), Static(4, "draft"), Static(5, "layerskip-2"),
                                    Heuristic(k0=2, drafter="draft"), Confidence(0.3, k=6, drafter="layerskip-2"),
                                    SeedRule(k_short=4, k_long=1, load_weight=0.5, drafter="draft")], ids=repr)
@pytest.mark.parametrize("batch_k", ["row", "shared"])
def test_every_row_equals_the_prompt_decoded_alone(tiny_target, tiny_draft, prompts, reference, policy, batch_k):
    dec = SpeculativeDecoder(tiny_target.model, drafters(tiny_target, tiny_draft), policy, stop_token_ids=[],
                             config=DecoderConfig(max_batch=3, batch_k=batch_k))
    results = dec.generate_batch(prompts, 20)
    assert [r.tokens for r in results] == reference
    sizes = {s.batch_size for r in results for s in r.steps}
    assert max(sizes) == 3 and min(sizes) >= 1  # rows joined a running batch as others finished
    if policy.name != "ar":
        assert sum(s.drafted for r in results for s in r.steps) > 0


def test_model_drafters_draft_the_rows_together(tiny_target, tiny_draft, prompts, reference):
    """A model drafter's rows share one forward per drafted token (their caches stacked, then split back), with
    per-row k and stops, and every row stays exact."""
    seen = []
    hook = tiny_draft.model.register_forward_pre_hook(lambda m, a, kw: seen.append(kw["input_ids"].shape[0]),
                                                      with_kwargs=True)
    try:
        for policy in (Static(4, "draft"), Confidence(0.3, k=6, drafter="draft"), Heuristic(k0=3, drafter="draft")):
            seen.clear()
            dec = SpeculativeDecoder(tiny_target.model, drafters(tiny_target, tiny_draft), policy, stop_token_ids=[],
                                     config=DecoderConfig(max_batch=6))
            assert [r.tokens for r in dec.generate_batch(prompts, 20)] == reference
            assert max(seen) > 1, policy  # rows drafted together
    finally:
        hook.remove()


def test_feature_drafter_rows_get_their_own_hidden_states(tiny_target, prompts, reference, tmp_path):
    from conftest import tiny_head_dir

    from sacpolicy.decoding.feature import load_feature_drafter

    head = load_feature_drafter(tiny_target, tiny_head_dir(tiny_target, tmp_path))
    widths = []
    hook = head.head.lm_head.register_forward_pre_hook(lambda m, a: widths.append(a[0].shape[0]))
    dec = SpeculativeDecoder(tiny_target.model, [head], Static(3), stop_token_ids=[],
                             config=DecoderConfig(max_batch=4))
    results = dec.generate_batch(prompts, 20)
    hook.remove()
    assert [r.tokens for r in results] == reference
    assert sum(s.drafted for r in results for s in r.steps) > 0 and not any(r.dropped_drafters for r in results)
    assert max(widths) > 1  # the rows' draft logits came from one projection (FeatureDrafter.propose)


def test_arrivals_queue_requests_and_results_keep_input_order(tiny_target, prompts, reference):
    dec = SpeculativeDecoder(tiny_target.model, [NgramDrafter()], Static(3), stop_token_ids=[])
    arrivals = [0.0, 0.0, 0.05, 0.3, 0.3, 0.31]
    results = dec.generate_batch(prompts, 20, arrivals=arrivals, max_batch=2)
    assert [r.tokens for r in results] == reference
    assert all(r.queued_s >= 0 and r.latency_s >= r.total_s for r in results)
    assert max(r.queued_s for r in results[3:]) > 0  # two rows for three simultaneous arrivals: one waited


def test_a_failing_drafter_costs_only_its_row(tiny_target, prompts, reference, caplog):
    class Flaky(NgramDrafter):
        """Fails on the repetitive prompt's row only (its context starts 5, 6, 7, 8)."""

        def propose(self, rows):
            if any(row.context[:4].tolist() == [5, 6, 7, 8] for row in rows):
                raise RuntimeError("draft server went away")
            return super().propose(rows)

    dec = SpeculativeDecoder(tiny_target.model, [Flaky(name="flaky")], Static(3), stop_token_ids=[],
                             config=DecoderConfig(max_batch=6))
    with caplog.at_level(logging.WARNING):
        results = dec.generate_batch(prompts, 20)
    assert [r.tokens for r in results] == reference
    assert results[-1].dropped_drafters == ["flaky"] and not any(r.dropped_drafters for r in results[:-1])
    assert all(s.drafter is None for s in results[-1].steps)


def test_rejected_columns_are_masked_then_compacted(tiny_target):
    """A ragged cache masks what rows rejected, crops what they all rejected, and compaction keeps each row's
    committed columns in order (the forward after it gives the same logits as before it)."""
    model = tiny_target.model
    from transformers import DynamicCache

    from sacpolicy.decoding.compat import with_cache

    g = torch.Generator().manual_seed(1)
    rows = []
    for L in (6, 3):
        c = DynamicCache(config=model.config)
        model(input_ids=torch.randint(3, 1000, (1, L), generator=g), **with_cache(model, c), use_cache=True)
        rows.append(RaggedCache(c, L, torch.device("cpu"), slack=10.0))  # no automatic compaction
    cache = rows[0]
    cache.join(rows[1])
    assert cache.width == 6 and cache.counts == [6, 3] and cache.valid.sum().item() == 9
    x = torch.randint(3, 1000, (2, 4), generator=g)
    model(input_ids=x, **with_cache(model, cache.cache), use_cache=True, **cache.inputs(4, torch.float32))
    cache.commit([2, 3], 4)  # one column of garbage every row shares is cropped at once
    assert cache.width == 9 and cache.counts == [8, 6] and cache.cache.get_seq_length() == 9
    probe = torch.randint(3, 1000, (2, 2), generator=g)

    def logits():
        out = model(input_ids=probe, **with_cache(model, cache.cache), use_cache=True, logits_to_keep=2,
                    **cache.inputs(2, torch.float32)).logits
        cache.cache.crop(-2)
        return out

    before = logits()
    cache.compact()
    assert cache.width == 8 and cache.counts == [8, 6] and cache.compactions == 1
    torch.testing.assert_close(logits(), before, rtol=1e-4, atol=1e-4)


def test_rows_leave_and_join_inside_the_growing_buffer_with_the_same_logits(tiny_target):
    """Four rows joined in one call (blocks of different widths), two verify passes, rows 1 and 3 leaving, a row
    joining, two more passes: the growing cache gives the same logits as transformers' ``DynamicCache`` after the same
    calls, and rows leave inside the buffer (the pass after the select writes where the passes before it did)."""
    from transformers import DynamicCache

    from sacpolicy.decoding.compat import with_cache
    from sacpolicy.decoding.ragged import new_cache

    model = tiny_target.model
    g = torch.Generator().manual_seed(5)
    xs = [torch.randint(3, 1000, (1, L), generator=g) for L in (5, 9, 3, 6, 4)]

    def run(make):
        rows = []
        for x in xs:
            c = make()
            model(input_ids=x, **with_cache(model, c), use_cache=True)
            rows.append(RaggedCache(c, x.shape[1], torch.device("cpu"), slack=10.0))
        cache, outs, ptrs = rows[0], [], []
        cache.join(*rows[1:4])
        assert cache.counts == [5, 9, 3, 6] and cache.width == 9

        def step(T, kept, seed):
            x = torch.randint(3, 1000, (cache.rows, T), generator=torch.Generator().manual_seed(seed))
            outs.append(model(input_ids=x, **with_cache(model, cache.cache), use_cache=True, logits_to_keep=T,
                              **cache.inputs(T, torch.float32)).logits)
            ptrs.append(cache.cache.layers[0].keys.data_ptr())
            cache.commit(kept, T)

        step(3, [1, 3, 2, 1], 1)
        step(2, [2, 1, 1, 2], 2)
        cache.select([0, 2])
        assert cache.counts == [8, 6]
        step(2, [1, 2], 3)
        cache.join(rows[4])
        step(3, [3, 1, 2], 4)
        return outs, ptrs

    with torch.inference_mode():
        ours, ptrs = run(lambda: new_cache(model.config))
        theirs, _ = run(lambda: DynamicCache(config=model.config))
    assert ptrs[0] == ptrs[1] == ptrs[2]  # joined once into a buffer; the select moved row 2 inside it
    for a, b in zip(ours, theirs):
        assert torch.equal(a, b)


def test_growing_cache_appends_in_place_and_holds_what_a_dynamic_cache_holds(tiny_target):
    """``new_cache``'s layers write each forward's keys and values into spare room (no copy of the layer), and after
    prefills, verify passes, crops, rows joining and leaving, and compaction the cache holds exactly what
    transformers' own ``DynamicCache`` holds after the same calls; the model's logits on it are the same bits."""
    from transformers import DynamicCache

    from sacpolicy.decoding.compat import with_cache
    from sacpolicy.decoding.ragged import GrowingLayer, new_cache

    model = tiny_target.model
    g = torch.Generator().manual_seed(3)
    xs = {L: torch.randint(3, 1000, (1, L), generator=g) for L in (7, 4)}

    def run(make):
        """Two rows prefilled alone and joined, three ragged verify passes with crops, a row leaving, compaction."""
        rows = []
        for L, x in xs.items():
            c = make()
            model(input_ids=x, **with_cache(model, c), use_cache=True)
            rows.append(RaggedCache(c, L, torch.device("cpu"), slack=10.0))
        cache, outs, ptrs = rows[0], [], []
        cache.join(rows[1])
        for T, kept in ((3, [1, 3]), (2, [2, 2]), (4, [1, 2])):
            x = torch.randint(3, 1000, (cache.rows, T), generator=torch.Generator().manual_seed(T))
            outs.append(model(input_ids=x, **with_cache(model, cache.cache), use_cache=True, logits_to_keep=T,
                              **cache.inputs(T, torch.float32)).logits)
            ptrs.append(cache.cache.layers[0].keys.data_ptr())
            cache.commit(kept, T)
        cache.select([1])
        cache.compact()
        x = torch.randint(3, 1000, (1, 2), generator=torch.Generator().manual_seed(9))
        outs.append(model(input_ids=x, **with_cache(model, cache.cache), use_cache=True, logits_to_keep=2,
                          **cache.inputs(2, torch.float32)).logits)
        return cache, outs, ptrs

    with torch.inference_mode():
        ours, our_logits, ptrs = run(lambda: new_cache(model.config))
        theirs, their_logits, _ = run(lambda: DynamicCache(config=model.config))
    assert all(type(layer) is GrowingLayer for layer in ours.cache.layers)
    assert len(set(ptrs)) == 1  # the first pass after the join copies the rows once; every pass then writes in place
    for a, b in zip(our_logits, their_logits):
        assert torch.equal(a, b)
    for mine, ref in zip(ours.cache.layers, theirs.cache.layers):
        assert torch.equal(mine.keys, ref.keys) and torch.equal(mine.values, ref.values)
    assert ours.valid.equal(theirs.valid) and ours.counts == theirs.counts

    layer = GrowingLayer()  # one layer alone: appends, crops; concatenates for one row and under autograd
    one = [torch.randn(1, 3, n, 4) for n in (5, 1)]
    layer.update(one[0], one[0])
    ptr = layer.keys.data_ptr()
    keys, _ = layer.update(one[1], one[1])
    assert keys.data_ptr() != ptr and keys.is_contiguous() and torch.equal(keys, torch.cat(one, dim=2))
    layer = GrowingLayer()
    k = [torch.randn(2, 3, n, 4) for n in (5, 1, 2)]
    layer.update(k[0], k[0])
    buf = layer.keys.data_ptr()
    layer.update(k[1], k[1])
    layer.crop(-1)
    keys, _ = layer.update(k[2], k[2])
    assert keys.data_ptr() == buf and torch.equal(keys, torch.cat([k[0], k[2]], dim=2))
    grad = torch.randn(2, 3, 1, 4, requires_grad=True)
    keys, _ = layer.update(grad, grad)
    assert keys.requires_grad and torch.equal(keys.detach(), torch.cat([k[0], k[2], grad.detach()], dim=2))


def test_batched_sampling_follows_the_target_distribution():
    """Rows sampled in batches (each with its own seed) have the target's joint distribution of tokens 2, 3; greedy
    rows in the same batches (mixed settings, per request) stay the greedy chain."""
    v = 6
    P, Q = markov_pair(v, seed=5)
    dec = SpeculativeDecoder(Markov(P.log()), [ModelDrafter(Markov(Q.log()), name="q")], Heuristic(k0=2),
                             stop_token_ids=[], config=DecoderConfig(timing=False, max_batch=4))
    greedy = [int(P[0].argmax())]
    for _ in range(2):
        greedy.append(int(P[greedy[-1]].argmax()))
    t1 = SamplingConfig(temperature=1.0)
    draws, counts = 6_000, np.zeros((v, v))
    for i in range(0, draws, 6):
        requests = [RequestInfo(seed=i + j, sampling=t1) for j in range(6)] + [RequestInfo(), RequestInfo()]
        results = dec.generate_batch([[0]] * 8, 3, requests=requests)
        for r in results[:6]:
            counts[r.tokens[1], r.tokens[2]] += 1
        assert [r.tokens for r in results[6:]] == [greedy, greedy]
    expected = ((P[0] @ P)[:, None] * P).double().numpy().ravel()
    _, pval = chisquare(counts.ravel(), expected / expected.sum() * draws)
    assert pval > 1e-3, pval


@pytest.mark.parametrize("call, match", [
    (lambda d, p: d.generate_batch(p, 4, max_batch=0), "max_batch"),
    (lambda d, p: d.generate_batch([], 4), "at least one prompt"),
    (lambda d, p: d.generate_batch([p[0], list(range(3, 3000))], 4), "request 1 .* context"),
    (lambda d, p: d.generate_batch([p[0], []], 4), "empty prompt .request 1"),
    (lambda d, p: d.generate_batch(p[:2], [4]), "as many token budgets"),
    (lambda d, p: d.generate_batch(p[:2], 4, arrivals=[0.0, -1.0]), "arrival"),
    (lambda d, p: DecoderConfig(batch_k="each"), "batch_k"),
    (lambda d, p: d.generate_batch(p[:2], 4, requests=[None, RequestInfo(sampling={"temperature": 1})]),
     "request 1: sampling must be a SamplingConfig"),
])
def test_bad_batch_input_is_refused(tiny_target, prompts, call, match):
    with pytest.raises(ValueError, match=match):
        call(SpeculativeDecoder(tiny_target.model, stop_token_ids=[]), prompts)


# ---------------------------------------------------------------- the cost of a batch, and the learned rule over it
def batch_cost():
    """Drafting is nearly free at B = 1 (a pass of 9 tokens costs 1.2x one token) and dear at B = 8 (5x): what a
    CPU shows once the rows fill its cores."""
    from sacpolicy.runtime.cost import CostModel, PiecewiseLinear

    def curve(t1, t9):
        return {"tokens": PiecewiseLinear([1, 9], [t1, t9]), "per_context": 0.0}

    return CostModel("cpu", curve(0.050, 0.060), {"ngram": PiecewiseLinear([0.0], [1e-4])}, {"ngram": False},
                     batch={4: curve(0.080, 0.140), 8: curve(0.100, 0.500)})


def test_batch_cost_interpolates_in_batch_size_and_round_trips(tmp_path):
    from sacpolicy.runtime.cost import CostModel

    cost = batch_cost()
    assert cost.batch_sizes == [1, 4, 8]
    assert cost.verify_time(0, 100, 6) == pytest.approx(0.090)  # halfway between B = 4 and B = 8
    assert cost.verify_time(8, 100, 16) == pytest.approx(0.500 + 2 * (0.500 - 0.140))  # the last segment extends
    cost.to_json(tmp_path / "cost.json")
    assert CostModel.from_json(tmp_path / "cost.json").verify_time(4, 100, 6) == pytest.approx(cost.verify_time(4, 100, 6))
    one = CostModel("cpu", cost.verify, cost.draft, cost.per_token_draft)
    with pytest.raises(ValueError, match="batch_sizes"):
        one.verify_time(0, 100, 2)
    # the batch's best k: at B = 1 a 0.4-acceptance row drafts; eight of them at B = 8 do not
    rows = [("ngram", 100, [0.4] * 8)]
    assert cost.best_batch_k(rows, 8)[0][0] == cost.best_k("ngram", 100, [0.4] * 8, 8)[0] > 0
    assert cost.best_batch_k(rows * 8, 8)[0] == [0] * 8
    # one row that copies well (0.95) carries the batch; per_row lets a row with nothing likely draft less
    ks, _ = cost.best_batch_k([("ngram", 100, [0.95] * 8)] * 7 + [("ngram", 100, [0.01] * 8)], 8)
    assert ks[0] > 0
    # the search over tabulated figures is the brute-force search over every k of every row (3 rows, k <= 3)
    import itertools

    rows = [("ngram", 300, [0.9, 0.7, 0.5]), ("ngram", 500, [0.3, 0.2, 0.1]), (None, 200, [])]
    def rate(ks):
        tokens = sum(cost.expected_tokens(a[:k]) for (_, _, a), k in zip(rows, ks))
        return tokens / (cost.verify_time(max(ks), 1000 / 3, 3) + sum(cost.draft_time(d, k, c)
                                                                      for (d, c, _), k in zip(rows, ks)))
    ks, tps = cost.best_batch_k(rows, 3, per_row=False)
    assert tps == max(rate([K, K, 0]) for K in range(4)) and ks == [ks[0], ks[0], 0]
    ks, tps = cost.best_batch_k(rows, 3)
    assert tps == pytest.approx(rate(ks)) and tps <= max(rate([a, b, 0]) for a, b in itertools.product(range(4), repeat=2))


def test_learned_rule_plans_for_the_live_batch(tiny_target, prompts, reference):
    from sacpolicy.policy.learned import LearnedPolicy
    from sacpolicy.runtime.features import FEATURE_NAMES, feature_spec
    from sacpolicy.runtime.predictors import Predictor
    from sacpolicy.runtime.rule import DecisionRule

    class Some(Predictor):  # every drafted token is accepted with probability 0.4
        def __init__(self):
            n = len(FEATURE_NAMES)
            super().__init__("linear", {"mean": np.zeros(n), "scale": np.ones(n), "coef": np.zeros(n),
                                        "intercept": np.zeros(1)}, {"features": feature_spec()})

        def predict(self, X):
            return np.full(len(X), 0.4)

    rule = DecisionRule(Some(), batch_cost(), ("ngram",), 8, ("ngram", 2), mode="k")
    policy = LearnedPolicy(rule)
    request = RequestInfo(prompt_len=10, max_new_tokens=32, drafters=("ngram",))
    from sacpolicy.decoding import DecodeState

    alone = DecodeState(request, context_len=100, remaining=20, drafters=("ngram",))
    assert decide_one(policy, alone).k > 0
    states = [DecodeState(request, context_len=100, remaining=20, drafters=("ngram",), batch_size=8)
              for _ in range(8)]
    assert [d.k for d in policy.decide(policy_rows(policy, states))] == [0] * 8
    # rows the decoder keeps autoregressive (cooling down) are not asked, but they are in the pass: one row asking in
    # a batch of 8 is planned as one row of 8, not as a row alone
    one_of_eight = DecodeState(request, context_len=100, remaining=20, drafters=("ngram",), batch_size=8)
    assert decide_one(policy, one_of_eight).k == 0
    plans, _ = rule.plan_batch([{"ngram": np.zeros((8, len(FEATURE_NAMES)))}], [100], [8], batch=8)
    ks, _ = rule.cost.best_batch_k([("ngram", 100, [0.4] * 8)] + [(None, 100, [])] * 7, 8)
    assert plans == [("ngram", ks[0]) if ks[0] else (None, 0)]
    # and through the decoder, every row stays exact
    dec = SpeculativeDecoder(tiny_target.model, [NgramDrafter()], LearnedPolicy(rule), stop_token_ids=[],
                             config=DecoderConfig(max_batch=4))
    assert [r.tokens for r in dec.generate_batch(prompts, 20)] == reference


def test_stop_rule_rows_of_a_batch_draft_at_most_the_batch_plan(tiny_target, prompts, reference):
    """Mode "stop": one row alone drafts up to its cap and the stop rule ends the block; a row of a batch drafts at
    most the k the batch plan chose (one row's stop rule weighs its own tokens against a pass every row pays for)."""
    from sacpolicy.decoding import DecodeState
    from sacpolicy.policy.learned import LearnedPolicy
    from sacpolicy.runtime.features import FEATURE_NAMES, feature_spec
    from sacpolicy.runtime.predictors import Predictor
    from sacpolicy.runtime.rule import DecisionRule

    n = len(FEATURE_NAMES)
    pred = Predictor("linear", {"mean": np.zeros(n), "scale": np.ones(n), "coef": np.zeros(n),
                                "intercept": np.array([np.log(0.6 / 0.4)])}, {"features": feature_spec()})
    rule = DecisionRule(pred, batch_cost(), ("ngram",), 8, ("ngram", 2), mode="stop")
    policy = LearnedPolicy(rule)
    request = RequestInfo(prompt_len=10, max_new_tokens=32, drafters=("ngram",))
    assert decide_one(policy, DecodeState(request, context_len=100, remaining=20, drafters=("ngram",))).k == 8
    states = [DecodeState(request, context_len=100, remaining=20, drafters=("ngram",), batch_size=4)
              for _ in range(4)]
    ks, _ = rule.cost.best_batch_k([("ngram", 100, pred.predict(np.zeros((8, n))).tolist())] * 4, 8)
    assert 0 < ks[0] < 8  # the plan drafts, less than the cap
    assert [d.k for d in policy.decide(policy_rows(policy, states))] == ks
    dec = SpeculativeDecoder(tiny_target.model, [NgramDrafter()], LearnedPolicy(rule), stop_token_ids=[],
                             config=DecoderConfig(max_batch=4))
    assert [r.tokens for r in dec.generate_batch(prompts, 20)] == reference


def test_stop_rule_in_a_batch_weighs_a_rows_own_draft_time_at_the_batch_rate():
    """A row of a batch drafts into a pass already as wide as the plan's longest block: one more token costs only its
    own draft time, paid at the plan's rate. A per-token drafter stops exactly when optimism * P(all so far accepted)
    * a(next) <= rate * draft time of a token; a drafter paying once per proposal never stops before the plan's k
    (and asks the predictor nothing); alone, the rule is the single-row test it always was."""
    from sacpolicy.runtime.cost import CostModel, PiecewiseLinear
    from sacpolicy.runtime.features import FEATURE_NAMES, feature_spec
    from sacpolicy.runtime.predictors import Predictor
    from sacpolicy.runtime.rule import Block, DecisionRule

    n = len(FEATURE_NAMES)

    class Counted(Predictor):  # every token accepted with probability 0.8, calls counted
        calls = 0

        def predict(self, X):
            Counted.calls += 1
            return np.full(len(X), 0.8)

    pred = Counted("linear", {"mean": np.zeros(n), "scale": np.ones(n), "coef": np.zeros(n),
                              "intercept": np.zeros(1)}, {"features": feature_spec()})
    base = batch_cost()
    cost = CostModel("cpu", base.verify, {"ngram": base.draft["ngram"], "draft": PiecewiseLinear([0.0], [0.004])},
                     {"ngram": False, "draft": True}, batch=base.batch)
    rule = DecisionRule(pred, cost, ("ngram", "draft"), 8, ("ngram", 2), mode="stop", optimism=1.0)
    row = np.zeros(n)
    for rate in (20.0, 60.0, 150.0):
        block, stops = Block("draft", 100, 8, batch=4, rate=rate), []
        while not (stops and stops[-1]):
            stops.append(rule.stop(block, row, row))
        # the token after n drafted ones is drafted while 0.8 ** n * 0.8 > rate * 0.004
        expect = next(m for m in range(1, 9) if not 0.8 ** (m + 1) > rate * 0.004 or m == 8)
        assert len(stops) == expect, rate
    assert len(stops) < 8  # at 150 tokens/s the rate ends the block early
    Counted.calls = 0
    block = Block("ngram", 100, 5, batch=4, rate=150.0)
    assert [rule.stop(block, row, row) for _ in range(5)] == [False] * 4 + [True]
    assert Counted.calls == 0
    alone, stops = Block("draft", 100, 8), []  # alone: E/T(n) against the next token's gain, as before
    while not (stops and stops[-1]):
        stops.append(rule.stop(alone, row, row))
    E, S, m = 1.0, 1.0, 0
    while m < 8:
        m, S = m + 1, S * 0.8
        E += S
        if m == 8 or not (E + S * 0.8) / cost.step_time("draft", m + 1, 100) > E / cost.step_time("draft", m, 100):
            break
    assert len(stops) == m


def test_the_batch_plan_prices_a_drafter_at_the_rows_drafting_with_it():
    """A model drafter that is dear for one row (50 ms a token) but cheap per row when eight rows draft with it
    together (``draft_batch``: a tenth each) loses to the n-gram drafter alone and wins in a batch of eight, where the
    plan prices each of its rows at its share; the rows' stop rule gets that count (``Block.rows``)."""
    from dataclasses import replace

    from sacpolicy.decoding import DecodeState
    from sacpolicy.policy.learned import LearnedPolicy
    from sacpolicy.runtime.cost import CostModel, PiecewiseLinear
    from sacpolicy.runtime.features import FEATURE_NAMES, feature_spec
    from sacpolicy.runtime.predictors import DRAFTER_INDEX, Predictor
    from sacpolicy.runtime.rule import DecisionRule

    n = len(FEATURE_NAMES)

    class ByDrafter(Predictor):  # the model drafter's tokens accepted with probability 0.8, the n-gram's 0.3
        def predict(self, X):
            return np.where(X[:, DRAFTER_INDEX] == 0, 0.8, 0.3)

    pred = ByDrafter("linear", {"mean": np.zeros(n), "scale": np.ones(n), "coef": np.zeros(n),
                                "intercept": np.zeros(1)}, {"features": feature_spec()})

    def curve(t1, t9):
        return {"tokens": PiecewiseLinear([1, 9], [t1, t9]), "per_context": 0.0}

    cost = CostModel("cpu", curve(0.050, 0.060), {"draft": PiecewiseLinear([0.0], [0.050]),
                                                  "ngram": PiecewiseLinear([0.0], [1e-4])},
                     {"draft": True, "ngram": False}, batch={8: curve(0.100, 0.140)},
                     draft_batch={"draft": PiecewiseLinear([1.0, 8.0], [1.0, 0.1])})
    rule = DecisionRule(pred, cost, ("draft", "ngram"), 4, ("ngram", 2), mode="k")
    rows = [{d: np.zeros((4, n)) for d in ("draft", "ngram")} for _ in range(8)]
    for r in rows:
        r["draft"][:, DRAFTER_INDEX], r["ngram"][:, DRAFTER_INDEX] = 0, 1
    alone, _ = rule.plan_batch(rows[:1], [100], [4])
    assert alone[0][0] == "ngram"
    together, _ = rule.plan_batch(rows, [100] * 8, [4] * 8)
    assert all(name == "draft" and k > 0 for name, k in together)
    unshared, _ = replace(rule, cost=replace(cost, draft_batch={})).plan_batch(rows, [100] * 8, [4] * 8)
    assert all(name != "draft" for name, _ in unshared)
    request = RequestInfo(prompt_len=10, max_new_tokens=32, drafters=("draft", "ngram"))
    states = [DecodeState(request, context_len=100, remaining=20, drafters=("draft", "ngram"), batch_size=8)
              for _ in range(8)]
    policy = LearnedPolicy(rule)
    rows = policy_rows(policy, states)
    assert [d.drafter for d in policy.decide(rows)] == ["draft"] * 8
    assert [r.memory.block.rows for r in rows] == [8] * 8


def test_k_by_batch_map_is_vllms_schedule():
    from sacpolicy.export import k_by_batch
    from sacpolicy.runtime.cost import CostModel
    from sacpolicy.runtime.features import FEATURE_NAMES, feature_spec
    from sacpolicy.runtime.predictors import Predictor
    from sacpolicy.runtime.rule import DecisionRule

    n = len(FEATURE_NAMES)
    pred = Predictor("linear", {"mean": np.zeros(n), "scale": np.ones(n), "coef": np.zeros(n),
                                "intercept": np.array([np.log(0.4 / 0.6)])}, {"features": feature_spec()})
    rule = DecisionRule(pred, batch_cost(), ("ngram",), 8, ("ngram", 2), mode="k")
    schedule = k_by_batch(rule, "ngram")
    assert schedule[0][0] == 1 and schedule[-1][1] == 8  # every batch size up to the profiled maximum, in order
    assert all(a[1] + 1 == b[0] for a, b in zip(schedule, schedule[1:]))
    assert schedule[0][2] > 0 and schedule[-1][2] == 0  # speculate alone, not in a full batch
    assert schedule[0][2] == rule.cost.best_k("ngram", 256, [0.4] * 8, 8)[0]
    flat = CostModel("cpu", rule.cost.verify, rule.cost.draft, rule.cost.per_token_draft)
    from dataclasses import replace

    assert k_by_batch(replace(rule, cost=flat), "ngram") is None  # profiled at B = 1 only: no map


def test_profile_times_the_batched_pass(tiny_target, tmp_path):
    from sacpolicy.profiling import profile
    from sacpolicy.runtime.cost import CostModel

    cost = profile(tiny_target, [NgramDrafter()], ks=(0, 2), context_lens=(16, 32), repeats=2, warmup=1,
                   batch_sizes=(1, 4))
    assert cost.batch_sizes == [1, 4] and cost.meta["batch_sizes"] == [1, 4]
    assert cost.verify_time(2, 24, 4) > 0 and cost.verify_time(2, 24, 2) > 0  # interpolated between 1 and 4
    # the rows a batch is timed on spread like prompts do (the cache as wide as the longest), their mean the context
    from sacpolicy.profiling import ROW_SPREAD, batch_row_lengths

    assert cost.meta["batch_row_spread"] == list(ROW_SPREAD)
    assert batch_row_lengths(1, 32) == [32]
    lens = batch_row_lengths(4, 100)
    assert lens == sorted(lens) and lens[0] == 40 and lens[-1] == 160 and sum(lens) / 4 == 100
    cost.to_json(tmp_path / "cost.json")
    assert CostModel.from_json(tmp_path / "cost.json").batch_sizes == [1, 4]
    with pytest.raises(ValueError, match="batch_sizes must hold 1"):
        profile(tiny_target, [NgramDrafter()], ks=(0,), context_lens=(16,), repeats=1, batch_sizes=(2,))


def test_profile_prices_batch_sizes_alike_on_a_machine_that_slows_down(tiny_target, monkeypatch):
    """A shared machine's speed drifts while it is profiled. Every batch size's cells are timed in the same rounds, so
    a steady slowdown moves them alike and the cost of a pass of 4 rows relative to 1 row stays what it is. (Timed one
    batch size after the other, the later one absorbed the slowdown: here 2x too dear.) The clock is virtual: each
    target forward of b rows of n tokens advances it by (10 ms * b + 1 ms * n) times a factor growing with every
    forward."""
    from sacpolicy.profiling import measure as profiling

    clock = {"t": 0.0, "calls": 0}

    def forward(module, args, kwargs):
        b, n = kwargs["input_ids"].shape if "input_ids" in kwargs else args[0].shape
        clock["calls"] += 1
        clock["t"] += (0.010 * b + 0.001 * n) * (1 + clock["calls"] / 20)

    hook = tiny_target.model.register_forward_pre_hook(forward, with_kwargs=True)
    monkeypatch.setattr(profiling.time, "perf_counter", lambda: clock["t"])
    try:
        cost = profiling.profile(tiny_target, [NgramDrafter()], ks=(0, 2), context_lens=(16, 32), repeats=5,
                                 warmup=1, batch_sizes=(1, 4))
    finally:
        hook.remove()
    for k in (0, 2):
        true = (0.040 + 0.001 * (k + 1)) / (0.010 + 0.001 * (k + 1))
        assert cost.verify_time(k, 24, 4) / cost.verify_time(k, 24) == pytest.approx(true, rel=0.15), k


def test_batched_replay_is_exact_and_prices_the_batch():
    """simulate_batch at B = 1 is simulate; at B = 4 every prompt gets the same steps (acceptance does not depend on
    the batch) and the makespan is what the cost model says of the batched passes."""
    from toys import synthetic_traces

    from sacpolicy.runtime.cost import PiecewiseLinear
    from sacpolicy.traces.simulate import group_traces, simulate, simulate_batch

    grouped = dict(list(group_traces(synthetic_traces(n_prompts=8, length=24)).items()))
    cost = batch_cost()
    cost.draft["draft"], cost.per_token_draft["draft"] = PiecewiseLinear([0.0, 512.0], [0.004, 0.005]), True
    for policy in (Static(3, "draft"), Static(4, "ngram"), Autoregressive()):
        one = simulate(policy, grouped, cost, vocab_size=1000)
        b1 = simulate_batch(policy, grouped, cost, vocab_size=1000, max_batch=1)
        assert (b1.tokens, b1.target_calls, b1.accepted) == (one.tokens, one.target_calls, one.accepted)
        assert b1.makespan_s == pytest.approx(one.predicted_s)
        b4 = simulate_batch(policy, grouped, cost, vocab_size=1000, max_batch=4)
        assert [[s.accepted for s in r.steps] for r in b4.results] == [a for _, a in one.per_prompt.values()]
        assert max(s.batch_size for r in b4.results for s in r.steps) == 4
        assert b4.tokens_per_s > b1.tokens_per_s  # four rows per pass cost less than four passes here
    with pytest.raises(ValueError, match="batch_sizes"):
        from sacpolicy.runtime.cost import CostModel

        simulate_batch(Static(2, "ngram"), grouped, CostModel("cpu", cost.verify, cost.draft, cost.per_token_draft),
                       vocab_size=1000, max_batch=2)
    # rows drafting together pay their share (``draft_batch``): a replayed batch's proposals advance the clock by
    # each drafting row's share at that many rows, and a proposal alone by its one-row time
    from sacpolicy.traces.simulate import ReplayDrafter, VirtualClock

    cost.draft_batch = {"draft": PiecewiseLinear([1.0, 4.0], [1.0, 0.4])}
    pids = list(grouped)[:3]
    clock = VirtualClock()
    replay = ReplayDrafter("draft", {i: grouped[p]["drafters"]["draft"] for i, p in enumerate(pids)},
                           {i: grouped[p]["prompt_len"] for i, p in enumerate(pids)}, 1000, clock, cost)
    contexts = [torch.tensor([i] + [0] * (grouped[p]["prompt_len"] + 2)) for i, p in enumerate(pids)]
    blocks = replay.propose([DraftRow(None, c, 3) for c in contexts])
    assert [b.k for b in blocks] == [3, 3, 3]
    assert clock.t == pytest.approx(sum(cost.draft_time("draft", 3, c.shape[0], 3) for c in contexts))
    assert cost.draft_time("draft", 3, 100, 3) == pytest.approx(0.6 * cost.draft_time("draft", 3, 100))
    t = clock.t
    assert propose_one(replay, contexts[0], 3).k == 3
    assert clock.t - t == pytest.approx(cost.draft_time("draft", 3, contexts[0].shape[0]))


def test_evaluation_has_a_section_under_load(tmp_path):
    from toys import synthetic_traces

    from sacpolicy.evaluation.evaluate import LOAD_RATES, EvalSettings, load_rows
    from sacpolicy.evaluation.report import write_eval
    from sacpolicy.runtime.cost import PiecewiseLinear
    from sacpolicy.traces.simulate import group_traces

    grouped = group_traces(synthetic_traces(n_prompts=8, length=24))
    cost = batch_cost()
    cost.draft["draft"], cost.per_token_draft["draft"] = PiecewiseLinear([0.0, 512.0], [0.004, 0.005]), True
    settings = EvalSettings(ks=(1, 2), k_max=4, live_prompts=0, max_new_tokens=24, price_per_hour=1.0,
                            confidence_grid=(0.4,))
    chosen = {"best_static": {"drafter": "ngram", "k": 2}, "confidence_threshold": 0.4}
    rows = load_rows(settings, chosen, cost, {}, grouped, vocab_size=1000)
    loads = list(dict.fromkeys(r["load"] for r in rows))
    assert loads == ["B=1", "B=4", "B=8"] + [f"poisson {f:g}x" for f in LOAD_RATES]
    assert {r["policy"] for r in rows} == {"ar", "static-k1", "static-k2", "best-static", "heuristic", "seed-rule"}
    assert all(r["vs_ar"] == 1.0 for r in rows if r["policy"] == "ar")
    assert all(r["p50_s"] <= r["p90_s"] <= r["p99_s"] for r in rows)
    write_eval(tmp_path, [], {"load": rows})
    assert "## Under load" in (tmp_path / "eval.md").read_text()
    from sacpolicy.runtime.cost import CostModel

    assert load_rows(settings, chosen, CostModel("cpu", cost.verify, cost.draft, cost.per_token_draft), {}, grouped,
                     vocab_size=1000) == []  # no batch curves, no section


def test_masked_grouped_query_attention_is_transformers_sdpa_bit_for_bit():
    """The decoder switches a CPU target from transformers' sdpa attention to one that skips the key/value copies of
    grouped-query attention under a mask (verification, batches): the logits stay bit-identical."""
    from transformers import DynamicCache

    from sacpolicy.decoding.compat import MASKED_GQA, use_masked_gqa, with_cache
    from sacpolicy.models import load_model

    model = load_model("tiny:llama-4l", device="cpu", dtype="float32", seed=3).model
    assert model.config._attn_implementation == "sdpa"
    assert model.config.num_key_value_heads < model.config.num_attention_heads  # grouped-query attention

    ids = torch.randint(1000, (3, 24), generator=torch.Generator().manual_seed(0))
    pad = torch.ones(3, 24, dtype=torch.long)
    pad[1, :5], pad[2, :11] = 0, 0  # left padding: a mask on every pass

    def logits():
        cache = DynamicCache(config=model.config)
        first = model(input_ids=ids[:, :20], attention_mask=pad[:, :20], **with_cache(model, cache), use_cache=True)
        block = model(input_ids=ids[:, 20:], attention_mask=pad, **with_cache(model, cache), use_cache=True)
        return first.logits, block.logits  # a 4-token block on a cache, as verification feeds it

    with torch.inference_mode():
        before = logits()
        use_masked_gqa(model)
        assert model.config._attn_implementation == MASKED_GQA
        use_masked_gqa(model)  # idempotent
        after = logits()
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    eager = load_model("tiny:llama-1l", device="cpu", dtype="float32", seed=3).model
    eager.set_attn_implementation("eager")
    use_masked_gqa(eager)
    assert eager.config._attn_implementation == "eager"  # other implementations are left alone


def test_cpu_linear_is_torch_linear_up_to_rounding_and_the_decoder_uses_it(monkeypatch):
    """``CpuLinear`` (the fastest of torch's linear, a weight-on-left GEMM and oneDNN, timed per shape and row count
    on first use) gives torch's ``linear`` results up to float rounding with every candidate kernel at every row count
    and input layout, records the kernel it chose for each, keeps torch's own path (bit for bit) under autograd and,
    without oneDNN, for long feeds, and the decoder runs the target's and a model drafter's linears on it while it
    decodes, without touching their parameters, and gives the models back as they were."""
    from sacpolicy.decoding.compat import _GEMM_MAX_ROWS, CpuLinear, use_cpu_kernels
    from sacpolicy.models import load_model

    torch.manual_seed(0)
    plain = torch.nn.Linear(64, 300)
    fast = torch.nn.Linear(64, 300)
    fast.load_state_dict(plain.state_dict())
    use_cpu_kernels(torch.nn.Sequential(fast))
    assert type(fast) is CpuLinear
    fast.eval()  # in training mode every call is torch's own
    shapes = [(64,), (1, 64), (1, 1, 64), (2, 64), (1, 3, 64), (4, 5, 64), (_GEMM_MAX_ROWS, 64), (300, 64)]
    monkeypatch.setattr(CpuLinear, "choices", {})
    for onednn in (CpuLinear.onednn, None):
        monkeypatch.setattr(CpuLinear, "onednn", onednn)
        with torch.inference_mode():
            for shape in shapes:
                x = torch.randn(*shape)
                flat, rows = x.reshape(-1, 64), x.numel() // 64
                kernels = fast.kernels(rows, x.dtype)
                assert ("gemm" in kernels) == (rows <= _GEMM_MAX_ROWS) and ("onednn" in kernels) == (onednn is not None)
                for kernel in kernels:
                    torch.testing.assert_close(fast.KERNELS[kernel](fast, flat), plain(flat), rtol=1e-5, atol=1e-5)
                torch.testing.assert_close(fast(x), plain(x), rtol=1e-5, atol=1e-5)
                assert fast(x).shape == plain(x).shape
                chosen = [v for k, v in CpuLinear.choices.items() if k[5] == (rows if rows <= 8 else
                                                                              1 << (rows - 1).bit_length())
                          and k[6] == (onednn is not None)]
                assert len(chosen) == 1 and chosen[0] in kernels
            x = torch.randn(64, 7).t()  # 7 rows, not contiguous
            torch.testing.assert_close(fast(x), plain(x), rtol=1e-5, atol=1e-5)
            if onednn is None:
                x = torch.randn(300, 64)
                assert torch.equal(fast(x), plain(x))  # a long feed keeps torch's path
    x = torch.randn(2, 64, requires_grad=True)
    assert torch.equal(fast(x), plain(x))  # autograd: torch's path
    fast(x).sum().backward()
    assert fast.weight.grad is not None

    target = load_model("tiny:llama-4l", device="cpu", dtype="float32", seed=3).model
    draft = load_model("tiny:llama-1l", device="cpu", dtype="float32", seed=3).model
    keys = (list(target.state_dict()), list(draft.state_dict()))
    attn = target.config._attn_implementation

    def kernels():
        return {type(m) for model in (target, draft) for m in model.modules() if isinstance(m, torch.nn.Linear)}

    seen = []
    hook = target.register_forward_pre_hook(lambda m, a: seen.append((kernels(), m.config._attn_implementation)))
    dec = SpeculativeDecoder(target, [ModelDrafter(draft, name="draft")], Static(2))
    assert kernels() == {torch.nn.Linear}  # building a decoder changes nothing
    plain_out = SpeculativeDecoder(target, [ModelDrafter(draft, name="draft")], Static(2),
                                   config=DecoderConfig(cpu_kernels=False)).generate([5, 6, 7], 8).tokens
    assert seen and all(k == {torch.nn.Linear} and a == attn for k, a in seen)  # cpu_kernels=False: torch's own
    seen.clear()
    assert dec.generate([5, 6, 7], 8).tokens == plain_out
    assert seen and all(k == {CpuLinear} for k, _ in seen)  # while decoding: every linear on CpuLinear
    assert kernels() == {torch.nn.Linear} and target.config._attn_implementation == attn  # given back as it was
    hook.remove()
    assert (list(target.state_dict()), list(draft.state_dict())) == keys


def test_bench_verify_times_both_caches_on_a_batched_step(tmp_path):
    """scripts/bench_verify.py --rows: the batched AR step on transformers' cache and on ours, both timed; --top-p:
    a sampled block's probabilities with the vocabulary's head ranked and with a full sort."""
    root = Path(__file__).resolve().parents[1]
    res = subprocess.run([sys.executable, str(root / "scripts/bench_verify.py"), "--target", "tiny:llama-4l",
                          "--tokens", "1,2", "--threads", "1", "--repeats", "1", "--context", "24", "--rows", "1,3",
                          "--steps", "2", "--top-p", "0.9", "--out", str(tmp_path / "v.json")], capture_output=True,
                         text=True, timeout=300, cwd=root, env={**os.environ, "OMP_NUM_THREADS": "1"}, check=False)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads((tmp_path / "v.json").read_text())
    assert [c["rows"] for c in out["caches"]] == [1, 3]
    for c in out["caches"]:
        assert c["dynamic_ms"] > 0 and c["in_place_ms"] > 0
        assert c["speedup"] == c["dynamic_ms"] / c["in_place_ms"]
    assert "| 3 |" in res.stdout and "new_cache (in place)" in res.stdout
    (t,) = out["top_p"]
    assert t["top_p"] == 0.9 and t["positions"] > 5 and 0 <= t["head_share"] <= 1
    assert t["partial_ms"] > 0 and t["speedup"] == t["full_sort_ms"] / t["partial_ms"] and "full sort" in res.stdout


def test_seeded_rows_sample_the_same_in_a_batch_as_alone():
    """Rows with their own seeds, temperatures and block lengths, verified together (blocks padded, one
    verification per sampling setting), sample exactly the tokens each samples decoded alone."""
    v = 7
    g = torch.Generator().manual_seed(11)
    P, Q = torch.rand(v, v, generator=g) + 0.05, torch.rand(v, v, generator=g) + 0.05
    dec = SpeculativeDecoder(Markov(P.log()), [ModelDrafter(Markov(Q.log()), name="q")], Heuristic(k0=3),
                             stop_token_ids=[], config=DecoderConfig(timing=False, max_batch=6))
    requests = [RequestInfo(seed=100 + i, sampling=SamplingConfig(temperature=t, top_k=k))
                for i, (t, k) in enumerate([(1.0, 0), (0.5, 0), (1.0, 4), (0.0, 0), (1.0, 0), (0.5, 0)])]
    prompts = [[i % v] for i in range(6)]
    budgets = [9, 4, 12, 7, 10, 6]
    together = dec.generate_batch(prompts, budgets, requests=requests)
    alone = [dec.generate(p, m, request=r) for p, m, r in zip(prompts, budgets, requests)]
    assert [r.tokens for r in together] == [r.tokens for r in alone]
    assert len({s.drafted for r in together for s in r.steps}) > 1  # the blocks did differ in length
