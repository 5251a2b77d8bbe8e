"""Verification math: exact identities (hypothesis) and the distribution of speculative sampling (chi-square)."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import chisquare

from sacpolicy.decoding.sampling import (
    SamplingConfig,
    acceptance_stats,
    copy_acceptance_stats,
    draft_stats,
    probs_from_logits,
    probs_stats,
    residual,
    sample,
    verify,
    verify_greedy,
)

V = 8


def dists(n: int):
    """n random distributions over V tokens, some with exact zeros."""
    return st.lists(
        st.lists(st.floats(0.0, 1.0, allow_nan=False), min_size=V, max_size=V).filter(lambda r: sum(r) > 1e-3),
        min_size=n, max_size=n,
    ).map(lambda rows: torch.tensor(rows, dtype=torch.float32) / torch.tensor(rows).sum(-1, keepdim=True))


@settings(max_examples=200, deadline=None)
@given(dists(2))
def test_residual_is_a_distribution_and_restores_p(pq):
    p, q = pq[0], pq[1]
    r = residual(p, q)
    assert torch.all(r >= 0)
    assert r.sum().item() == pytest.approx(1.0, abs=1e-5)
    # P(emit x) = P(draft x and accept) + P(reject) * r(x) = min(p, q)(x) + (1 - beta) r(x) must equal p(x)
    beta = torch.minimum(p, q).sum()
    torch.testing.assert_close(torch.minimum(p, q) + (1 - beta) * r, p, atol=1e-5, rtol=0)


def test_sample_draws_the_distribution_and_never_a_zero_probability_token():
    """Inverse-CDF sampling: the counts of 40,000 draws match p (chi-square), a zero-probability token (first, inside,
    last) is never drawn, unnormalized rows and leading batch dims are taken as they come."""
    g = torch.Generator().manual_seed(7)
    p = torch.tensor([0.0, 0.3, 0.0, 0.1, 0.25, 0.0, 0.35, 0.0])
    x = sample((p * 3.0).expand(4, 10_000, V), g)  # unnormalized, [4, 10000] draws
    assert x.shape == (4, 10_000) and x.dtype == torch.long
    counts = np.bincount(x.flatten().numpy(), minlength=V).astype(float)
    assert counts[p.numpy() == 0].sum() == 0
    keep = p.numpy() > 0
    _, pval = chisquare(counts[keep], p.numpy()[keep] * counts.sum())
    assert pval > 1e-3
    one = torch.zeros(V)
    one[V - 1] = 1e-30  # a single tiny mass at the end: every draw is that token
    assert (sample(one.expand(1000, V), g) == V - 1).all()
    assert sample(p, g).dim() == 0


@settings(max_examples=50, deadline=None)
@given(dists(1))
def test_residual_defined_when_p_equals_q(p):
    r = residual(p[0], p[0].clone())
    assert torch.isfinite(r).all()
    torch.testing.assert_close(r, p[0])


@settings(max_examples=50, deadline=None)
@given(dists(1), st.integers(0, 2**31 - 1))
def test_k0_is_plain_sampling(p, seed):
    g1, g2 = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed)
    n, tok = verify(p, torch.empty(0, V), torch.empty(0, dtype=torch.long), g1)
    assert n.item() == 0
    assert tok.item() == sample(p[0], g2).item()


@settings(max_examples=100, deadline=None)
@given(dists(4), dists(3), st.integers(0, 2**31 - 1))
def test_verify_outputs_are_well_formed(p, q, seed):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.stack([sample(q[i], g) for i in range(3)])
    n, tok = verify(p, q, tokens, g)
    assert 0 <= n.item() <= 3
    # the emitted token must have positive probability under the distribution it came from
    src = p[3] if n.item() == 3 else residual(p[n.item()], q[n.item()])
    assert src[tok.item()] > 0
    stats = acceptance_stats(p, q, tokens)
    assert torch.all((stats[:, 2] >= 0) & (stats[:, 2] <= 1 + 1e-6))


@settings(max_examples=50, deadline=None)
@given(dists(4), st.lists(st.integers(0, V - 1), min_size=3, max_size=3))
def test_a_copied_blocks_stats_are_those_of_its_one_hot_draft(p, tokens):
    """The decoder's shortcut for deterministic drafts (n-gram copies) records exactly what the general formula does:
    q(x) = 1 and beta = p(x), bit for bit."""
    tokens = torch.tensor(tokens)
    one_hot = torch.nn.functional.one_hot(tokens, V).float()
    assert torch.equal(copy_acceptance_stats(p, tokens), acceptance_stats(p, one_hot, tokens))
    logits = torch.log(p + 1e-3)
    assert torch.equal(probs_stats(probs_from_logits(logits, SamplingConfig(temperature=1.0))), draft_stats(logits))


def test_greedy_verify_accepts_the_matching_prefix():
    logits = torch.full((4, V), -1.0)
    for i, best in enumerate([3, 5, 1, 7]):
        logits[i, best] = 1.0
    n, tok = verify_greedy(logits, torch.tensor([3, 5, 2]))
    assert (n.item(), tok.item()) == (2, 1)
    n, tok = verify_greedy(logits, torch.tensor([3, 5, 1]))
    assert (n.item(), tok.item()) == (3, 7)  # bonus token
    n, tok = verify_greedy(logits[:1], torch.empty(0, dtype=torch.long))
    assert (n.item(), tok.item()) == (0, 3)


def test_top_k_top_p_temperature():
    logits = torch.log(torch.tensor([0.5, 0.25, 0.15, 0.1]))
    p = probs_from_logits(logits, SamplingConfig(temperature=1.0, top_p=0.7))
    torch.testing.assert_close(p, torch.tensor([2 / 3, 1 / 3, 0, 0]))
    p = probs_from_logits(logits, SamplingConfig(temperature=1.0, top_k=3))
    torch.testing.assert_close(p, torch.tensor([0.5, 0.25, 0.15, 0]) / 0.9)
    p = probs_from_logits(logits, SamplingConfig(temperature=0.5))
    torch.testing.assert_close(p, torch.tensor([0.25, 0.0625, 0.0225, 0.01]) / 0.345)
    g = probs_from_logits(logits, SamplingConfig())
    torch.testing.assert_close(g, torch.tensor([1.0, 0, 0, 0]))


@pytest.mark.parametrize("scale", [6.0, 2.0, 0.05], ids=["peaked", "spread", "flat"])  # flat: the full-sort fallback
@pytest.mark.parametrize("top_p", [0.5, 0.9, 0.99])
def test_top_p_over_a_large_vocabulary_keeps_what_a_full_sort_keeps(scale, top_p):
    """top-p ranks only the head of a large vocabulary (a partial sort) when the head holds top_p of the mass; the
    tokens kept and their probabilities are the full sort's, row by row, in batches mixing both cases."""
    from sacpolicy.decoding.sampling import TOP_P_HEAD, top_p_filter

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 49152, generator=g) * scale
    logits[0, 0] = torch.randn(49152, generator=g) * 0.05  # one flat row in the batch: every row falls back together
    for batch in (logits[1:], logits):
        for temperature in (0.7, 1.0):
            p = probs_from_logits(batch, SamplingConfig(temperature=temperature, top_p=top_p))
            ref = top_p_filter(torch.softmax(batch / temperature, -1), top_p, head=0)  # a full sort
            assert torch.equal(p > 0, ref > 0)
            torch.testing.assert_close(p, ref, rtol=1e-5, atol=1e-7)
    head = torch.softmax(logits[1:] / 0.7, -1).topk(TOP_P_HEAD, -1).values.sum(-1)
    assert bool((head >= top_p).all()) == (scale == 6.0 or (scale == 2.0 and top_p < 0.9))


@pytest.mark.parametrize(
    "kwargs",
    [dict(temperature=-0.1), dict(temperature=float("nan")), dict(top_p=0.0), dict(top_p=1.5), dict(top_k=-1)],
)
def test_bad_sampling_settings(kwargs):
    with pytest.raises(ValueError, match="temperature|top_p|top_k"):
        SamplingConfig(**kwargs)


def _speculative_pairs(P, Q, cfg, k, draws, seed):
    """Markov-chain target P and draft Q (rows = previous token). ``draws`` independent chains, batched: emit tokens
    by draft-k + verify blocks starting after token 0 until two tokens exist; return the counts of the first emitted
    pair and their exact distribution."""
    g = torch.Generator().manual_seed(seed)
    Pp, Qp = probs_from_logits(P.log(), cfg), probs_from_logits(Q.log(), cfg)

    def block(prev):  # [B] -> emitted [B, k + 1] (the first n + 1 are real), n [B]
        tokens, t = [], prev
        for _ in range(k):
            t = sample(Qp[t], g)
            tokens.append(t)
        tokens = torch.stack(tokens, -1)
        ctx = torch.cat([prev[:, None], tokens], -1)
        n, nxt = verify(Pp[ctx], Qp[ctx[:, :-1]], tokens, g)
        emitted = torch.cat([tokens, torch.zeros_like(prev)[:, None]], -1)
        emitted[torch.arange(len(prev)), n] = nxt
        return emitted, n

    first_block, n = block(torch.zeros(draws, dtype=torch.long))
    first, second = first_block[:, 0], first_block[:, 1].clone()
    short = n == 0  # one token emitted: the next block, after it, gives the second
    second[short] = block(first[short])[0][:, 0]
    counts = np.zeros((V, V))
    np.add.at(counts, (first.numpy(), second.numpy()), 1)
    expected = Pp[0][:, None] * Pp  # P(a | 0) P(b | a)
    return counts, expected.double().numpy()


@pytest.mark.parametrize(
    "cfg", [SamplingConfig(temperature=1.0), SamplingConfig(temperature=0.8, top_k=6, top_p=0.9)], ids=["t1", "topk-topp"]
)
def test_speculative_sampling_matches_target_distribution(cfg):
    gen = torch.Generator().manual_seed(1234)
    P = torch.rand(V, V, generator=gen) ** 3 + 1e-3
    Q = torch.rand(V, V, generator=gen) ** 3 + 1e-3
    P, Q = P / P.sum(-1, keepdim=True), Q / Q.sum(-1, keepdim=True)
    draws = 200_000
    counts, expected = _speculative_pairs(P, Q, cfg, k=3, draws=draws, seed=7)
    first = counts.sum(1)
    mask = expected.sum(1) > 0
    exp_first = expected.sum(1)[mask]
    _, p_first = chisquare(first[mask], exp_first * first[mask].sum() / exp_first.sum())
    cells = expected.ravel() * draws > 5  # cells with zero mass (top-k / top-p) must stay empty
    assert counts.ravel()[expected.ravel() == 0].sum() == 0
    obs, exp = counts.ravel()[cells], expected.ravel()[cells] * draws
    _, p_pair = chisquare(obs, exp * obs.sum() / exp.sum())
    assert p_first > 1e-3 and p_pair > 1e-3, (p_first, p_pair)


def test_wrong_draft_probabilities_are_detected():
    """The chi-square test has power: verifying with q that is not the draft's real distribution is caught."""
    gen = torch.Generator().manual_seed(1234)
    P = torch.rand(V, V, generator=gen) ** 3 + 1e-3
    Q = torch.rand(V, V, generator=gen) ** 3 + 1e-3
    P, Q = P / P.sum(-1, keepdim=True), Q / Q.sum(-1, keepdim=True)
    g = torch.Generator().manual_seed(3)
    x = sample(Q[0].expand(20_000, V), g)
    # bug on purpose: claim the draft was uniform
    n, nxt = verify(P[torch.stack([torch.zeros_like(x), x], -1)], torch.full((len(x), 1, V), 1 / V), x[:, None], g)
    counts = np.bincount(torch.where(n > 0, x, nxt).numpy(), minlength=V).astype(float)
    exp = P[0].double().numpy()
    _, pval = chisquare(counts, exp / exp.sum() * counts.sum())
    assert pval < 1e-6
