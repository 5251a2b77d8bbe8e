"""Batched prefill: requests admitted to a batch together prefill in ONE target pass over their prompts left-padded to
the longest (``SpeculativeDecoder._prefill``, ``ragged.prefill_inputs``). Checked against the one-by-one prefill it
replaced (``OneByOne``: each request's prompt through the target alone, its cache joined to the others'): the same
greedy outputs for every drafter kind and B = 1..4, the same seeded samples (the random stream is unchanged), the same
logits and the same hidden states handed to feature drafters up to float32 rounding; one target call for k joining
requests; the cost model prices that one pass, and a batched replay's clock advances by it."""

import pytest
import torch
from toys import Markov, mixed_prompts

from sacpolicy.decoding import (
    DecoderConfig,
    LayerSkipDrafter,
    ModelDrafter,
    NgramDrafter,
    RequestInfo,
    SamplingConfig,
    SpeculativeDecoder,
)
from sacpolicy.decoding.compat import with_cache
from sacpolicy.decoding.ragged import RaggedCache, new_cache, prefill_inputs
from sacpolicy.policy import Autoregressive, Static


class OneByOne(SpeculativeDecoder):
    """The decoder as it was before batched prefill: each joining request prefilled alone (a batch of one is the
    unpadded single-sequence pass), the one-row caches joined in order."""

    def prefill(self, rows):
        caches = [super(OneByOne, self).prefill([row]) for row in rows]
        for other in caches[1:]:
            caches[0].join(other)
        return caches[0]


ONE_PASS = float("inf")  # every joining request in one prefill pass, however ragged (prefill_pad_slack)


@pytest.fixture(scope="module")
def prompts():
    """Mixed lengths (1 to 37 tokens) and a repetitive prompt the n-gram drafter finds long blocks in."""
    return mixed_prompts((9, 1, 37, 4, 23), seed=3, repeats=5)


@pytest.fixture(scope="module")
def head(tiny_target, tmp_path_factory):
    from conftest import tiny_head_dir

    from sacpolicy.decoding.feature import load_feature_drafter

    return load_feature_drafter(tiny_target, tiny_head_dir(tiny_target, tmp_path_factory.mktemp("head")))


def _drafters(kind, tiny_target, tiny_draft, head):
    return {"ngram": lambda: [NgramDrafter()],
            "draft": lambda: [ModelDrafter(tiny_draft.model, name="draft")],
            "layerskip": lambda: [LayerSkipDrafter(tiny_target.model, 2)],
            "head": lambda: [head]}[kind]()


def _pair(target, drafters, policy, **kw):
    """(batched prefill, one-by-one prefill) decoders over the same target, drafters and policy."""
    return (SpeculativeDecoder(target, drafters, policy, stop_token_ids=[], **kw),
            OneByOne(target, drafters, policy, stop_token_ids=[], **kw))


def _prefill_calls(model):
    """A list that records (rows, tokens) of every target forward over an empty cache (a prefill), and its hook."""
    calls = []

    def hook(module, args, kwargs):
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        if cache is None or cache.get_seq_length() == 0:
            calls.append(tuple(kwargs["input_ids"].shape))

    return calls, model.register_forward_pre_hook(hook, with_kwargs=True)


@pytest.mark.parametrize("kind", ["ngram", "draft", "layerskip", "head"])
@pytest.mark.parametrize("B", [1, 2, 3, 4])
def test_batched_prefill_gives_the_one_by_one_outputs(tiny_target, tiny_draft, head, prompts, kind, B):
    drafters = _drafters(kind, tiny_target, tiny_draft, head)
    name = drafters[0].name
    batched, alone = _pair(tiny_target.model, drafters, Static(3, name), config=DecoderConfig(prefill_pad_slack=ONE_PASS, max_batch=B))
    calls, hook = _prefill_calls(tiny_target.model)
    try:
        got = batched.generate_batch(prompts, 12, keep_logits=True)
        passes = list(calls)
        calls.clear()
        ref = alone.generate_batch(prompts, 12, keep_logits=True)
    finally:
        hook.remove()
    assert [r.tokens for r in got] == [r.tokens for r in ref]
    assert [[(s.drafted, s.accepted) for s in r.steps] for r in got] == [[(s.drafted, s.accepted) for s in r.steps]
                                                                         for r in ref]
    assert sum(s.drafted for r in got for s in r.steps) > 0 and not any(r.dropped_drafters for r in got)
    for a, b in zip(got, ref):  # every new token's logits, the prefill's first
        torch.testing.assert_close(a.logits, b.logits, rtol=1e-4, atol=1e-4)
    # the first B requests arrive together: one pass of B rows, padded to the longest of them
    assert passes[0] == (B, max(len(p) for p in prompts[:B]))
    assert len(calls) == len(prompts) and all(rows == 1 for rows, _ in calls)
    assert len(passes) < len(prompts) or B == 1


def test_k_joining_requests_make_one_target_call(tiny_target, prompts):
    """Four requests arriving together into four free rows: one target call prefills them all, and every later call
    is a step of the batch (one per step of its longest-running row)."""
    seen = []
    hook = tiny_target.model.register_forward_pre_hook(lambda m, a, kw: seen.append(tuple(kw["input_ids"].shape)),
                                                       with_kwargs=True)
    try:
        results = SpeculativeDecoder(tiny_target.model, stop_token_ids=[], config=DecoderConfig(
            prefill_pad_slack=ONE_PASS)).generate_batch(prompts[:4], 6, max_batch=4)
    finally:
        hook.remove()
    assert seen[0] == (4, 37) and all(rows <= 4 and tokens == 1 for rows, tokens in seen[1:])
    assert len(seen) == 1 + max(len(r.steps) for r in results)
    # each row's share of the one pass: their prefill seconds add up to it
    assert len({r.prefill_s for r in results}) == 1 and all(r.prefill_s > 0 for r in results)


def test_prefill_logits_and_cache_equal_each_prompt_prefilled_alone(tiny_target, prompts):
    """The padded pass's last-token logits and each row's valid cache columns are the prompt's own pass's."""
    model = tiny_target.model
    dtype = next(model.parameters()).dtype
    lengths = [len(p) for p in prompts]
    W = max(lengths)
    ids = torch.stack([torch.tensor([p[0]] * (W - len(p)) + p) for p in prompts])
    cache = new_cache(model.config)
    with torch.inference_mode():
        logits = model(input_ids=ids, **with_cache(model, cache), use_cache=True, logits_to_keep=1,
                       **prefill_inputs(lengths, torch.device("cpu"), dtype)).logits[:, -1]
        batch = RaggedCache.prefilled(cache, lengths, torch.device("cpu"))
        for i, p in enumerate(prompts):
            own = new_cache(model.config)
            ref = model(input_ids=torch.tensor([p]), **with_cache(model, own), use_cache=True, logits_to_keep=1).logits
            torch.testing.assert_close(logits[i], ref[0, -1], rtol=1e-4, atol=1e-4)
            row = batch.row_cache(i, model.config)
            for mine, theirs in zip(row.layers, own.layers):
                torch.testing.assert_close(mine.keys, theirs.keys, rtol=1e-4, atol=1e-4)
                torch.testing.assert_close(mine.values, theirs.values, rtol=1e-4, atol=1e-4)
    assert batch.counts == lengths and batch.valid.sum(1).tolist() == lengths
    assert prefill_inputs([5, 5], torch.device("cpu"), dtype) == {}  # equal lengths: the plain causal pass
    inputs = prefill_inputs([2, 4], torch.device("cpu"), torch.bfloat16)
    assert inputs["position_ids"].tolist() == [[0, 0, 0, 1], [0, 1, 2, 3]]
    allowed = inputs["attention_mask"][:, 0] == 0
    assert allowed[0].tolist() == [[True, False, False, False], [False, True, False, False],
                                   [False, False, True, False], [False, False, True, True]]  # pads: themselves only
    assert allowed[1].tolist() == torch.ones(4, 4, dtype=torch.bool).tril().tolist()


def test_several_rows_prefilled_together_need_caches_that_keep_every_token():
    """A sliding-window target's rows batch in the decoder's caches (``new_cache`` keeps a sliding layer's every token;
    the window is the mask's, tests/test_architectures.py). transformers' own sliding-window cache, which drops the
    tokens past the window, cannot hold a ragged batch: refused, naming the fix (one row is fine)."""
    from transformers import DynamicCache, MistralConfig

    config = MistralConfig(num_hidden_layers=2, sliding_window=4, hidden_size=16, num_attention_heads=2,
                           num_key_value_heads=1, intermediate_size=16, vocab_size=32)
    assert RaggedCache.prefilled(new_cache(config), [3, 5], torch.device("cpu")).counts == [3, 5]
    with pytest.raises(ValueError, match="DynamicSlidingWindowLayer.*Fix: build it with .*new_cache"):
        RaggedCache.prefilled(DynamicCache(config=config), [3, 5], torch.device("cpu"))
    assert RaggedCache.prefilled(DynamicCache(config=config), [3], torch.device("cpu")).counts == [3]


def test_feature_drafters_get_each_prompts_hidden_states(tiny_target, head, prompts):
    """A feature drafter's rows receive, after a batched prefill, the hidden states of their prompt's positions (not
    of the pads), the same calls with the same shapes as after one-by-one prefills, equal up to float32 rounding."""
    from sacpolicy.decoding.feature import FeatureDrafter

    class Recording(FeatureDrafter):
        def __init__(self, head, log):
            super().__init__(head.head, head.name)
            self.log = log

        def extend_features(self, state, aux):
            self.log.append(aux.clone())
            super().extend_features(state, aux)

    logs = {}
    for cls in (SpeculativeDecoder, OneByOne):
        log = logs[cls] = []
        dec = cls(tiny_target.model, [Recording(head, log)], Autoregressive(), stop_token_ids=[],
                  config=DecoderConfig(prefill_pad_slack=ONE_PASS, max_batch=4))
        dec.generate_batch(prompts[:4], 1)  # one new token each: the prefill's, so only the prefill hands states
    got, ref = logs[SpeculativeDecoder], logs[OneByOne]
    assert [a.shape[0] for a in got] == [len(p) for p in prompts[:4]] == [b.shape[0] for b in ref]
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("seeded", [True, False])
def test_sampled_rows_draw_the_same_tokens_as_one_by_one(seeded):
    """Sampling: the first tokens are drawn after the pass in request order, from each request's own generator or the
    decoder's, so the random stream, and every sampled token, is the one-by-one prefill's (an order-1 Markov target
    makes the logits exact, whatever the padding)."""
    v = 7
    g = torch.Generator().manual_seed(5)
    P, Q = torch.rand(v, v, generator=g) + 0.05, torch.rand(v, v, generator=g) + 0.05
    settings = [(1.0, 0), (0.5, 0), (1.0, 4), (0.0, 0), (1.0, 0), (0.7, 0)]
    requests = [RequestInfo(seed=100 + i if seeded else None, sampling=SamplingConfig(temperature=t, top_k=k))
                for i, (t, k) in enumerate(settings)]
    prompts = [[i % v] * (1 + 3 * i) for i in range(6)]  # lengths 1 .. 16: padded passes
    outs = []
    for cls in (SpeculativeDecoder, OneByOne):
        dec = cls(Markov(P.log()), [ModelDrafter(Markov(Q.log()), name="q")], Static(3, "q"), stop_token_ids=[],
                  sampling=SamplingConfig(temperature=1.0, seed=9), config=DecoderConfig(timing=False, prefill_pad_slack=ONE_PASS, max_batch=4))
        outs.append([r.tokens for r in dec.generate_batch(prompts, [9, 4, 12, 7, 10, 6], requests=requests)])
    assert outs[0] == outs[1]
    assert len({t for row in outs[0] for t in row}) > 2  # sampled, not a constant


def test_sampled_rows_on_a_real_target_follow_the_one_by_one_draws(tiny_target, prompts):
    """Seeded sampling through the tiny Llama: batched and one-by-one prefills give the same tokens."""
    requests = [RequestInfo(seed=7 + i, sampling=SamplingConfig(temperature=0.8)) for i in range(len(prompts))]
    outs = []
    for cls in (SpeculativeDecoder, OneByOne):
        dec = cls(tiny_target.model, [NgramDrafter()], Static(3, "ngram"), stop_token_ids=[],
                  config=DecoderConfig(prefill_pad_slack=ONE_PASS, max_batch=3))
        outs.append([r.tokens for r in dec.generate_batch(prompts, 10, requests=requests)])
    assert outs[0] == outs[1]


def test_cost_model_prices_one_padded_pass_and_the_replay_clock_pays_it():
    from sacpolicy.runtime.cost import CostModel, PiecewiseLinear
    from sacpolicy.traces.simulate import ReplayTarget, VirtualClock

    cost = CostModel("cpu", {"tokens": PiecewiseLinear([1, 9], [0.01, 0.02]), "per_context": 1e-5},
                     {"ngram": PiecewiseLinear([0], [1e-4])}, {"ngram": False},
                     batch={4: {"tokens": PiecewiseLinear([1, 9], [0.02, 0.05]), "per_context": 1e-5}},
                     prefill=PiecewiseLinear([16.0, 256.0], [0.02, 0.2]))
    assert cost.prefill_time(30, 4) == pytest.approx(cost.prefill_time(120))
    assert cost.prefill_time(30, 4) < 4 * cost.prefill_time(30)  # the pass's fixed cost paid once
    with pytest.raises(ValueError, match="at least one row"):
        cost.prefill_time(30, 0)
    # four requests arriving together, each ending at its prefill's token: the clock pays one pass of 4 rows
    lengths = [12, 30, 5, 20]
    seqs = [[i] * n + [50 + i, 60] for i, n in enumerate(lengths)]
    clock = VirtualClock()
    dec = SpeculativeDecoder(ReplayTarget(seqs, 100, clock=clock, cost=cost), stop_token_ids=[],
                             config=DecoderConfig(timing=False, prefill_pad_slack=ONE_PASS, max_batch=4))
    dec.clock = clock
    out = dec.generate_batch([q[:n] for q, n in zip(seqs, lengths)], 1)
    assert [r.tokens for r in out] == [[50 + i] for i in range(4)]  # each row read its own sequence past its pads
    assert clock.t == pytest.approx(cost.prefill_time(30, 4))
    assert sum(r.prefill_s for r in out) == pytest.approx(clock.t)


def test_ragged_joiners_prefill_in_groups_that_waste_little_padding(tiny_target):
    """The default ``prefill_pad_slack``: requests join the current group in order while padding stays within 25% of
    their tokens; a pass over a long prompt's pads for short ones would cost more than it saves."""
    from sacpolicy.decoding.rows import Row
    from sacpolicy.decoding.scheduler import prefill_groups

    dec = SpeculativeDecoder(tiny_target.model, [], Autoregressive(), stop_token_ids=[])

    def runs(*lengths):
        out = []
        for n in lengths:
            r = Row.__new__(Row)
            r.n = n
            out.append(r)
        return out

    groups = prefill_groups(runs(10, 11, 12, 40, 38, 5), dec.config.prefill_pad_slack)
    assert [[r.n for r in g] for g in groups] == [[10, 11, 12], [40, 38], [5]]
    one = SpeculativeDecoder(tiny_target.model, [], Autoregressive(), stop_token_ids=[],
                             config=DecoderConfig(prefill_pad_slack=ONE_PASS))
    assert len(prefill_groups(runs(10, 40, 5), one.config.prefill_pad_slack)) == 1
    with pytest.raises(ValueError, match="prefill_pad_slack"):
        DecoderConfig(prefill_pad_slack=-1)
