"""The suffix drafter (SuffixDecoding): the matcher counts what a brute-force count over its sequences gives, proposes
the most frequent continuation with a length that follows the match, learns across requests through a global index
whose memory stays under its stated bound (LRU by request); the drafter is lossless through the real decoder (greedy
identical to autoregressive decoding, single and batched; sampled at T = 0.7 with the target's distribution),
teacher-forces what it proposes live, and round-trips through its spec."""

import random

import numpy as np
import pytest
import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf
from scipy.stats import chisquare
from toys import Markov, propose_one

from sacpolicy.build import build_drafter
from sacpolicy.decoding import (
    DecoderConfig,
    DraftRow,
    NgramDrafter,
    Peekable,
    RequestInfo,
    SamplingConfig,
    SpeculativeDecoder,
    SuffixDrafter,
)
from sacpolicy.policy import Confidence, Static
from sacpolicy.runtime.spec import DrafterSpec, SpecError
from sacpolicy.runtime.suffix import SuffixIndex

CONF = __import__("pathlib").Path(__file__).resolve().parents[1] / "conf"


def brute_count(seqs, path, depth):
    """Occurrences of ``path`` in ``seqs`` (suffixes cut at ``depth``: a path longer than it never occurs)."""
    n = len(path)
    if n > depth:
        return 0
    return sum(1 for s in seqs for i in range(len(s) - n + 1) if s[i : i + n] == path)


def index_of(*seqs, depth=8, **bounds):
    ix = SuffixIndex(depth, **bounds)
    for s in seqs:
        ix.extend(ix.add_sequence(), s)
    return ix


# ---------------------------------------------------------------------- the matcher
def test_counts_equal_a_brute_force_count_before_and_after_removal():
    rng = random.Random(0)
    seqs = [[rng.randrange(4) for _ in range(rng.randrange(5, 40))] for _ in range(6)]
    ix = SuffixIndex(5)
    ids = [ix.add_sequence() for _ in seqs]
    for i, s in zip(ids, seqs):
        ix.extend(i, s[:7])
    for i, s in zip(ids, seqs):  # interleaved growth, as rows of a batch grow
        ix.extend(i, s[7:])
    paths = {tuple(s[a : a + n]) for s in seqs for a in range(len(s)) for n in range(1, 7)}
    for p in paths:
        assert ix.count(p) == brute_count(seqs, list(p), 5), p
    ix.remove(ids[2])
    ix.remove(ids[4])
    held = [s for j, s in enumerate(seqs) if j not in (2, 4)]
    for p in paths:
        assert ix.count(p) == brute_count(held, list(p), 5), p
    for i in ids:
        if i in ix.sequences:
            ix.remove(i)
    assert ix.num_nodes == 0 and ix.num_tokens == 0


def test_proposes_the_most_frequent_continuation_ties_to_the_most_recent():
    ix = index_of([1, 2, 3, 9, 1, 2, 4, 9, 1, 2, 3, 9, 1, 2])
    d = ix.speculate([7, 1, 2], max_tokens=1)
    assert d.tokens == [3] and d.match_len == 2 and d.probs == [pytest.approx(2 / 3)]
    top1, entropy, margin = d.confidence[0]
    # one escape count: 3 continuations seen (3, 4, 3) -> 3 of 4 + 1
    assert top1 == pytest.approx(2 / 4) and margin == pytest.approx(1 / 4) and entropy > 0
    assert index_of([5, 6, 5, 7]).speculate([5], 1).tokens == [7]  # 6 and 7 once each: the later one
    assert index_of([5, 6, 5, 7, 5, 6]).speculate([5], 1).tokens == [6]


def test_proposal_length_follows_the_match_length():
    seq = list(range(20))  # each token once: a match of m tokens proposes at most spec_factor * m tokens
    ix = index_of(seq, depth=24)
    for m in (1, 2, 5):
        d = ix.speculate([99] + seq[5 - m : 5], max_tokens=16)
        assert d.match_len == m and d.tokens == seq[5 : 5 + m]
    assert ix.speculate(seq[2:5], 16, spec_factor=2.0).tokens == seq[5:11]
    assert ix.speculate(seq[:5], 3).tokens == seq[5:8]  # capped by max_tokens
    assert ix.speculate([99], 16).tokens == []  # no match
    # match + proposal <= max_depth: 5 matched leave 3 tokens, 4 matched leave 4 (the higher score)
    d = index_of(seq, depth=8).speculate(seq[:5], 16)
    assert (d.match_len, d.tokens) == (4, seq[5:9])


def test_min_token_prob_stops_a_doubtful_continuation():
    ix = index_of([1, 2, 3, 1, 2, 4, 1, 2, 5, 1, 2, 6, 0, 1, 2])
    assert ix.speculate([0, 1, 2], 4, min_token_prob=0.3).tokens == []  # four continuations of "1 2", a quarter each
    d = ix.speculate([0, 1, 2], 4, min_token_prob=0.2)  # ties: the most recent, then "1 2 6" went on with 0 always
    assert d.tokens == [6, 0] and d.probs == pytest.approx([0.25, 0.25])


def test_global_index_bound_holds_and_evicts_least_recently_extended():
    rng = random.Random(1)
    ix = SuffixIndex(8, max_nodes=600, max_requests=5)
    seqs = {}
    for r in range(60):  # far more than the bound holds
        seq = ix.add_sequence()
        seqs[seq] = [rng.randrange(50) for _ in range(rng.randrange(10, 60))]
        for a in range(0, len(seqs[seq]), 7):
            ix.extend(seq, seqs[seq][a : a + 7])
            assert ix.num_nodes <= 600 and ix.num_tokens <= 600 and len(ix.sequences) <= 5
    held = ix.sequences
    assert held[-1] == max(seqs) and len(held) < 60
    for seq, toks in seqs.items():  # evicted requests' counts are gone: every count is the held sequences' alone
        for a in range(0, len(toks) - 3, 5):
            assert ix.count(toks[a : a + 3]) == brute_count([seqs[s] for s in held], toks[a : a + 3], 8)
    # LRU, not FIFO: the oldest held request, extended again, outlives the next ones
    oldest = held[0]
    ix.extend(oldest, [1, 2, 3])
    for _ in range(len(held) - 1):
        ix.extend(ix.add_sequence(), [7])
    assert oldest in ix.sequences


def test_a_request_longer_than_the_bound_evicts_itself_and_is_ignored_after():
    ix = SuffixIndex(4, max_nodes=40)
    seq = ix.add_sequence()
    ix.extend(seq, list(range(100)))
    assert seq not in ix.sequences and ix.num_nodes <= 40
    ix.extend(seq, [1, 2])  # an evicted request's later tokens are ignored
    assert ix.num_nodes <= 40 and seq not in ix.sequences
    with pytest.raises(KeyError, match="add_sequence"):
        ix.extend(99, [1])


# ---------------------------------------------------------------------- the drafter, without a target
def feed(drafter, ids, start, k=8):
    """A live row over ``ids``: proposals on every prefix ids[:g], g = start + 1 .. len(ids) - 1 (the decoder first
    shows a row prompt + first token)."""
    state, blocks = drafter.new_state(), []
    for g in range(start + 1, len(ids)):
        blocks.append(drafter.propose([DraftRow(state, torch.tensor(ids[:g]), k)])[0])
    return blocks


def test_global_index_helps_a_repeated_request():
    rng = random.Random(2)
    answer = rng.sample(range(10, 1000), 40)  # no token twice: the request alone predicts nothing
    with_global, without = SuffixDrafter(), SuffixDrafter(max_requests=0)
    for d in (with_global, without):
        feed(d, [3, 4, 5] + answer, 3)
    # another prompt, the same answer: only earlier requests' outputs can predict it
    ids = [6, 7, 8, 9] + answer
    hits = [sum(b.k for b in feed(d, ids, 4)) for d in (with_global, without)]
    assert hits[1] == 0 and hits[0] >= len(answer) // 2
    block = feed(with_global, [1, 2] + answer[:10], 2)[-1]  # proposed on [1, 2] + answer[:9]
    assert block.tokens.tolist() == answer[9:17]
    state = with_global.new_state()
    with_global.propose([DraftRow(state, torch.tensor(ids[:6]), 8)])
    with_global.reset()  # forgets earlier requests: the answer is unpredictable again
    assert with_global.index.num_nodes == 0 and sum(b.k for b in feed(with_global, ids, 4)) == 0
    with_global.propose([DraftRow(state, torch.tensor(ids[:9]), 8)])  # a row from before the reset goes on alone
    assert with_global.index.num_tokens == len(answer) - 1


def test_peek_is_each_proposed_tokens_confidence_and_stop_cuts_the_block():
    d = SuffixDrafter()
    ctx = torch.tensor([1, 2, 3, 4, 5, 6, 1, 2, 3, 4, 5, 6, 1, 2, 3])
    state = d.new_state()
    peeked = d.peek(state, ctx)
    block = d.propose([DraftRow(state, ctx, 6)])[0]
    assert block.tokens.tolist() == [4, 5, 6, 1, 2, 3] and block.logits is None
    # the peek is the whole proposal: one confidence per token, equal to what propose reports for each
    assert block.confidence.flatten().tolist() == pytest.approx([x for c in peeked for x in c])
    assert peeked.first == 4  # and its first token (what ``agree`` compares across drafters)
    # the n-gram drafter's peek names the first token of the span it copies, as it proposes it
    ngram = NgramDrafter()
    assert ngram.peek(None, ctx).first == int(propose_one(ngram, ctx, 6).tokens[0]) == 4
    # "1 2 3" went on with 4 three times, "1 2 3 4" with 5 twice and 7 once: each token has its own estimate
    ctx2 = torch.tensor([1, 2, 3, 4, 5, 6, 1, 2, 3, 4, 5, 8, 1, 2, 3, 4, 7, 6, 1, 2, 3])
    d2 = SuffixDrafter(max_depth=4)
    peeked2 = d2.peek(d2.new_state(), ctx2)
    assert [c[0] for c in peeked2] == pytest.approx([3 / 4, 2 / 4]) and propose_one(d2, ctx2, 8).k == 2
    assert torch.equal(propose_one(SuffixDrafter(), ctx, 6).tokens, block.tokens)  # peeking changes nothing
    seen = []
    cut = propose_one(SuffixDrafter(), ctx, 6, stop=lambda i, stats: seen.append(i) or i == 1)
    assert cut.tokens.tolist() == [4, 5] and seen == [0, 1] and cut.confidence.shape == (2, 3)
    assert SuffixDrafter().peek(None, torch.tensor([9, 8, 7])) is None


def test_teacher_force_equals_live_proposals():
    rng = random.Random(3)
    earlier = [rng.randrange(6) for _ in range(50)]
    ids = [rng.randrange(6) for _ in range(70)]
    tf_drafter, live = SuffixDrafter(max_depth=12), SuffixDrafter(max_depth=12)
    tf_drafter.teacher_force(torch.tensor(earlier), 10, 8)  # an earlier request in both global indexes
    feed(live, earlier, 10)
    tf = tf_drafter.teacher_force(torch.tensor(ids), 12, 8)
    blocks = feed(live, ids, 12)
    assert tf.chained and tf.tokens.shape == (len(ids) - 12, 8)
    for g, block in enumerate(blocks, start=1):
        row = tf.tokens[g].tolist()
        assert row[: block.k] == block.tokens.tolist() and all(t == -1 for t in row[block.k :]), g
        want = block.confidence[0].tolist() if block.k else [0.0, 0.0, 0.0]
        assert tf.confidence[g].tolist() == pytest.approx(want)
        each = [x for c in tf.block_confidence[g] for x in c]  # each token's own, as live
        assert each == pytest.approx(block.confidence.flatten().tolist() if block.k else [])
    assert any(b.k for b in blocks)
    assert [tf_drafter.index._seqs[s] for s in tf_drafter.index.sequences] == \
        [live.index._seqs[s] for s in live.index.sequences]


# ---------------------------------------------------------------------- lossless through the real decoder
@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(4)
    out = [torch.randint(3, 49152, (int(n),), generator=g).tolist() for n in (5, 17, 30)]
    return out + [[5, 6, 7, 8] * 6, out[1]]  # a repetitive prompt, and a repeated request (the global index)


@pytest.fixture(scope="module")
def reference(tiny_target, prompts):
    dec = SpeculativeDecoder(tiny_target.model, stop_token_ids=[])
    return [dec.generate(p, 24).tokens for p in prompts]


@pytest.mark.parametrize("policy", [Static(3), Static(8), Confidence(0.4, k=6)], ids=repr)
def test_greedy_equals_autoregressive(tiny_target, prompts, reference, policy):
    dec = SpeculativeDecoder(tiny_target.model, [SuffixDrafter()], policy, stop_token_ids=[])
    results = [dec.generate(p, 24) for p in prompts]
    assert [r.tokens for r in results] == reference
    assert sum(s.accepted for r in results for s in r.steps) > 0


@pytest.mark.parametrize("batch_k", ["row", "shared"])
def test_batched_greedy_equals_autoregressive(tiny_target, prompts, reference, batch_k):
    dec = SpeculativeDecoder(tiny_target.model, [SuffixDrafter()], Static(5), stop_token_ids=[],
                             config=DecoderConfig(max_batch=3, batch_k=batch_k))
    results = dec.generate_batch(prompts, 24)
    assert [r.tokens for r in results] == reference
    assert max(s.batch_size for r in results for s in r.steps) == 3


@pytest.fixture
def one_thread():
    """Tensors of a few elements: one thread is fastest, and spares cores that other processes share."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_a_learned_policy_chooses_between_ngram_and_suffix_by_their_peeks(tiny_target, prompts, reference):
    """Both drafters peek before each decision (the confidence of what they would propose, None when nothing): the
    rule reads them per drafter, and a drafter that would propose nothing is no option that step."""
    from dataclasses import replace

    from toys import ngram_rule

    from sacpolicy.policy.learned import LearnedPolicy
    from sacpolicy.runtime.cost import PiecewiseLinear

    base = ngram_rule("k")
    cost = replace(base.cost, draft={"ngram": PiecewiseLinear([0], [2e-4]), "suffix": PiecewiseLinear([0], [2e-4])},
                   per_token_draft={"ngram": False, "suffix": False})
    policy = LearnedPolicy(replace(base, cost=cost, drafters=("ngram", "suffix")))
    peeks = []

    class Recording(SuffixDrafter):
        def peek(self, state, context):
            peeks.append(super().peek(state, context))
            return peeks[-1]

    dec = SpeculativeDecoder(tiny_target.model, [NgramDrafter(), Recording()], policy, stop_token_ids=[])
    results = [dec.generate(p, 24) for p in prompts]
    assert [r.tokens for r in results] == reference
    assert {s.drafter for r in results for s in r.steps} >= {"suffix"}
    assert None in peeks and any(p is not None for p in peeks)


def test_what_a_peeking_policy_reads_live_equals_its_replay_from_traces(tiny_target, prompts):
    """The rows a learned rule reads before drafting, for the suffix drafter (each proposed token's own confidence, as
    many rows as the proposal reaches) and the n-gram drafter beside it (whether the other drafter's peeked proposal
    starts with the same token: ``agree``), and the drafted tokens' confidence the stop rule reads are the same live
    and in the replay of teacher-forced traces collected in request order (the global index grown alike): the
    predictor is trained on what it reads live."""
    from test_traces import cost_model

    from sacpolicy.policy.features import FEATURE_NAMES, token_features
    from sacpolicy.traces.collect import teacher_forced_rows
    from sacpolicy.traces.simulate import group_traces, simulate

    class Recording(Static):
        uses_peeks = True

        def __init__(self):
            super().__init__(6, "suffix")
            self.log = []

        def decide(self, rows):
            for row in rows:
                for name in ("suffix", "ngram"):
                    peek = row.state.peeks.get(name)
                    self.log.append([token_features(row.state, None, None, drafter=name, position=j)
                                     for j in range(min(8, len(peek)) if peek else 0)])
            return super().decide(rows)

    stats = DecoderConfig(step_stats=True)
    live_pol, live = Recording(), []
    dec = SpeculativeDecoder(tiny_target.model, [NgramDrafter(), SuffixDrafter()], live_pol, config=stats,
                             stop_token_ids=[])
    traces, collectors = [], [NgramDrafter(), SuffixDrafter()]
    for i, p in enumerate(prompts):
        live.append(dec.generate(p, 24, request=RequestInfo(category="c")))
        traces += teacher_forced_rows(tiny_target, collectors, {"prompt_id": f"p{i}", "category": "c",
                                                                "input_ids": p}, live[-1].tokens, 8)
    sim_pol = Recording()
    V = tiny_target.model.config.vocab_size
    sim = simulate(sim_pol, group_traces(traces), cost_model(["ngram", "suffix"]), vocab_size=V, config=stats)
    assert [r.target_calls for _, r in sim.results] == [r.target_calls for r in live]
    assert len(sim_pol.log) == len(live_pol.log)
    for a, b in zip(live_pol.log, sim_pol.log):
        assert np.array(a).shape == np.array(b).shape
        assert np.allclose(np.array(a, dtype=float), np.array(b, dtype=float), rtol=1e-5, equal_nan=True)
    flat = [[t for s in r.steps for t in s.top1] for r in live]
    assert flat == [pytest.approx([t for s in r.steps for t in s.top1]) for _, r in sim.results]
    assert sum(len(rows) for rows in live_pol.log) > 20
    assert len({round(t, 4) for f in flat for t in f}) > 2  # the drafted tokens' estimates differ
    agree = {rows[0][FEATURE_NAMES.index("agree")] for rows in live_pol.log if rows}
    assert {-1.0, 1.0} <= agree  # the two drafters' proposals start alike at some steps, not at others


def markov(v=4, seed=5):
    g = torch.Generator().manual_seed(seed)
    P = torch.rand(v, v, generator=g) ** 2 + 0.05
    return P / P.sum(-1, keepdim=True)


def expected_pair(P, last, i, temperature):
    """P(t_i = a, t_{i+1} = b) of an order-1 chain sampled at ``temperature`` after token ``last``."""
    PT = torch.softmax(P.log() / temperature, -1).double()
    dist = torch.nn.functional.one_hot(torch.tensor(last), P.shape[0]).double()
    for _ in range(i + 1):
        dist = dist @ PT
    return (dist[:, None] * PT).numpy().ravel()


def chi_square_pvalue(results, P, prompt, i=4):
    counts = np.zeros((P.shape[0], P.shape[0]))
    for r in results:
        counts[r.tokens[i], r.tokens[i + 1]] += 1
    expected = expected_pair(P, prompt[-1], i, 0.7)
    return chisquare(counts.ravel(), expected / expected.sum() * len(results))[1]


def test_sampling_at_t07_follows_the_target_distribution(one_thread):
    P, prompt, t07 = markov(), [0, 1, 2, 3, 0, 1, 2, 3, 0], SamplingConfig(temperature=0.7)
    drafter = SuffixDrafter(max_nodes=400)  # the global index fills and evicts while sampling
    dec = SpeculativeDecoder(Markov(P.log()), [drafter], Static(4), sampling=t07,
                             config=DecoderConfig(timing=False), stop_token_ids=[])
    results = [dec.generate(prompt, 7, request=RequestInfo(seed=i)) for i in range(3000)]
    steps = [s for r in results for s in r.steps]
    assert sum(s.accepted for s in steps) > 0 and sum(s.drafted - s.accepted for s in steps) > 0
    assert drafter.index.num_nodes <= 400
    assert chi_square_pvalue(results, P, prompt) > 1e-3


def test_batched_sampling_at_t07_follows_the_target_distribution(one_thread):
    P, prompt, t07 = markov(seed=6), [2, 3, 1, 2, 3, 1, 0], SamplingConfig(temperature=0.7)
    dec = SpeculativeDecoder(Markov(P.log()), [SuffixDrafter()], Static(4), stop_token_ids=[],
                             config=DecoderConfig(timing=False, max_batch=4))
    results = []
    for i in range(0, 3000, 8):
        results += dec.generate_batch([prompt] * 8, 7, requests=[RequestInfo(seed=i + j, sampling=t07)
                                                                  for j in range(8)])
    steps = [s for r in results for s in r.steps]
    assert max(s.batch_size for s in steps) == 4 and sum(s.drafted - s.accepted for s in steps) > 0
    assert chi_square_pvalue(results, P, prompt) > 1e-3


def test_each_policy_evaluated_live_starts_from_an_empty_global_index(tiny_target, prompts):
    """The pipeline builds its drafters once: collection and every live evaluation on the same held-out prompts use
    one suffix drafter. Each policy's live run must not read from its global index the answers that collection or the
    policies decoded before it gave (greedy: the same answers, accepted whole): every policy accepts what a fresh
    drafter accepts."""
    from types import SimpleNamespace

    from sacpolicy.evaluation.evaluate import EvalSettings, live_rows

    rows = [{"input_ids": p, "category": "c"} for p in prompts[:3]]

    def decode(drafter):
        dec = SpeculativeDecoder(tiny_target.model, [drafter], Static(4, "suffix"), stop_token_ids=[])
        res = [dec.generate(r["input_ids"], 24) for r in rows]
        return sum(len(r.tokens) for r in res) / sum(r.target_calls for r in res)

    shared = SuffixDrafter()
    fresh = decode(shared)  # as collection would: the prompts' answers are in the global index from now on
    assert decode(shared) > fresh  # the leak this guards against: a second run on them accepts more
    settings = EvalSettings(ks=(4,), k_max=4, live_prompts=None, max_new_tokens=24, price_per_hour=1.0,
                            confidence_grid=(0.5,), live_policies=("static-k4", "best-static"), speed_probe_every=0)
    chosen = {"best_static": {"drafter": "suffix", "k": 4}, "confidence_threshold": 0.5}
    live = live_rows(settings, chosen, None, {}, SimpleNamespace(model=tiny_target.model, eos_token_ids=[]), [shared],
                     rows, progress=False)
    assert [r["name"] for r in live] == ["static-k4", "best-static"]
    assert [r["tokens_per_call"] for r in live] == [pytest.approx(fresh)] * 2
    shared.reset()
    assert decode(shared) == pytest.approx(fresh)


# ---------------------------------------------------------------------- spec and config
def test_spec_round_trip_builds_the_drafter(tiny_target):
    spec = DrafterSpec(kind="suffix", name="sfx", max_depth=16, spec_factor=2.0, min_token_prob=0.2, max_nodes=5000,
                       max_requests=7)
    d = spec.to_dict()
    assert d == {"kind": "suffix", "max_depth": 16, "spec_factor": 2.0, "min_token_prob": 0.2, "max_nodes": 5000,
                 "max_requests": 7}
    assert DrafterSpec.from_dict("sfx", d) == spec
    drafter = build_drafter(spec, tiny_target)
    assert isinstance(drafter, SuffixDrafter) and drafter.name == "sfx" and isinstance(drafter, Peekable)
    assert (drafter.max_depth, drafter.spec_factor, drafter.min_token_prob) == (16, 2.0, 0.2)
    assert (drafter.index.max_nodes, drafter.index.max_requests) == (5000, 7)
    assert build_drafter(DrafterSpec(kind="suffix", name="s", max_requests=0), tiny_target).index is None
    shipped = instantiate(OmegaConf.load(CONF / "draft" / "suffix.yaml").suffix)
    assert shipped == DrafterSpec(kind="suffix", name="suffix")


@pytest.mark.parametrize("bad, match", [
    ({"max_depth": 0}, "max_depth >= 1"), ({"spec_factor": 0.0}, "spec_factor > 0"),
    ({"min_token_prob": 1.5}, "min_token_prob"), ({"max_nodes": 3}, "max_nodes >= max_depth"),
    ({"max_requests": -1}, "max_requests >= 0"),
])
def test_bad_suffix_spec_names_the_setting(bad, match):
    with pytest.raises(SpecError, match=match):
        DrafterSpec(kind="suffix", name="s", **bad)


def test_suffix_spec_rejects_another_kinds_keys():
    with pytest.raises(SpecError, match="may have"):
        DrafterSpec.from_dict("s", {"kind": "suffix", "max_ngram": 3})
