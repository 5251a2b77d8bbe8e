"""The expected-value replay of sampled traces: what ``traces.simulate`` replays for a prompt recorded with sampling.

With sampling, a drafted token is accepted with a probability (beta = sum_x min(p, q) for a token drawn from the
draft's q; p(x) for a copied token x), not when it equals the target's token. So a sampled prompt is replayed
``draws`` times (``group_traces(..., draws=)``, default ``DRAWS``), each draw the greedy replay of a copy of its traces
whose ``run_len`` is drawn: the j-th token of a block drafted at generated position g is accepted with probability
a[g, j] (``accept_probs``), one seeded Bernoulli draw per (draw, prompt, drafter, g, j), and the run ends at the first
rejection. A block of k drafted at g thus accepts its first j tokens with probability prod_{i<j} a[g, i], whatever k
the policy chose, and emits the target's token after them, as live decoding does. Everything else is the greedy
replay's: the decoder loop, the policies' feature rows and acceptance history (from the drawn outcomes, as they would
be live), the stop rule's draft confidence (the recorded top1 / entropy / margin of each drafted position), the cost
model's seconds. The draws are seeded by prompt, drafter and draw index, so every replay of a prompt sees the same
ones (common random numbers: policies and settings are compared on the same luck) and a prompt replays alike alone or
among others.

Assumption: acceptance along the recorded path stands for acceptance along the path the decoder would have taken.
The recorded tokens are the target's samples. Live, after a rejection the target's token is drawn from the residual,
after an acceptance the draft's token is kept; either way the text is a sample of the target's distribution, so the
recorded continuation stands for it, and a[g, j] is read on the recorded prefix. What is lost is the correlation
between which token came out and whether the draft was accepted: blocks are accepted as often as beta says, on average.

a[g, j]: a drafter that drafts token by token (``proposal`` False) drafts its j-th token on prefix g + j, where the
traces recorded beta[g + j]. A one-proposal drafter (n-gram) copies one span at g: its first token's acceptance is
beta[g]; while the span matches the recorded tokens (j < run_len[g]) its j-th token is the recorded one, accepted with
the target's probability of it, p_target[g + j]; past the match, beta[g + j] (the span copied from there), an
approximation. A chained model drafter (a feature head, whose later tokens read its own features) records beta for a
block's first token only, so beta[g + j] stands for its later tokens: an approximation that favours it.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, replace

import numpy as np

from sacpolicy.decoding import GenerationResult, SamplingConfig
from sacpolicy.policy import Policy

DRAWS = 4  # seeded draws per sampled prompt; the Monte-Carlo error of a rate falls as 1 / sqrt(draws * blocks)
_SEED = 0x5AC  # the draws' root seed: replays of the same traces draw the same outcomes in every process


def is_sampled(p: dict) -> bool:
    """Whether a prompt of ``group_traces`` was recorded with sampling (its stamp; unstamped ones count as greedy)."""
    return p.get("temperature", 0.0) > 0.0


def replay_kind(grouped: dict) -> str:
    """How ``simulate`` replays ``grouped``, in words (for tuning tables and evaluation metadata)."""
    sampled = [p for p in grouped.values() if is_sampled(p)]
    if not sampled:
        return "exact (greedy traces)"
    temps = sorted({p["temperature"] for p in sampled})
    n = sampled[0].get("draws") or DRAWS
    return (f"expected (sampled traces, temperature {temps[0] if len(temps) == 1 else temps}: {n} seeded draws of "
            "every prompt's acceptances from the recorded beta, traces.draws)")


def accept_probs(cols: dict) -> np.ndarray:
    """[G, K] a[g, j]: the probability that the j-th token of a block drafted at generated position g is accepted
    given the first j were (0 past the sequence's end), from a drafter's columns of ``group_traces``; K: its longest
    proposal. See the module's docstring."""
    beta = np.clip(np.asarray(cols["beta"], dtype=np.float64), 0.0, 1.0)  # float32 rounding
    G, K = len(beta), max(max(cols["proposal_len"], default=0), 1)
    a = np.zeros((G, K))
    for j in range(min(K, G)):
        a[: G - j, j] = beta[j:]
    if any(cols["proposal"]):  # one copied span per block: its matched tokens are the recorded ones
        p_target = np.clip(np.asarray(cols["p_target"], dtype=np.float64), 0.0, 1.0)
        run = np.asarray(cols["run_len"])
        for j in range(1, min(K, G)):
            matched = run[: G - j] > j
            a[: G - j, j] = np.where(matched, p_target[j:], a[: G - j, j])
    return a


def drawn_runs(a: np.ndarray, rng: np.random.Generator) -> list[int]:
    """One draw of every position's accepted run: leading successes of Bernoulli(a[g, j]) along j."""
    accepted = rng.random(a.shape) < a
    return np.cumprod(accepted, axis=1).sum(axis=1).tolist()


def draws_of(pid: str, p: dict) -> list[dict]:
    """What ``simulate`` replays for prompt ``pid``: ``p`` itself when greedy; when sampled, ``p["draws"]`` copies of
    it, each with every drafter's ``run_len`` drawn (``drawn_runs``), seeded by (draw, prompt, drafter), and its
    ``accept_prob`` (``accept_probs``: the beta labels of training examples)."""
    if not is_sampled(p):
        return [p]
    probs = {name: accept_probs(cols) for name, cols in p["drafters"].items()}
    out = []
    for r in range(p.get("draws") or DRAWS):
        drafters = {}
        for name, cols in p["drafters"].items():
            rng = np.random.default_rng([_SEED, r, zlib.crc32(pid.encode()), zlib.crc32(name.encode())])
            drafters[name] = {**cols, "run_len": drawn_runs(probs[name], rng), "accept_prob": probs[name]}
        out.append({**p, "drafters": drafters})
    return out


@dataclass
class DrawnResult(GenerationResult):
    """One sampled prompt's draws as one result, so a row's per-prompt figures and bootstrap intervals count prompts,
    not draws: every draw's tokens, steps and predicted seconds, and one prefill per draw."""

    draws: int = 1

    @property
    def target_calls(self) -> int:
        return len(self.steps) + self.draws


def merge_draws(results: list[GenerationResult]) -> DrawnResult:
    """The replays of one prompt's draws (``draws_of``) as one ``DrawnResult``."""
    first = results[0]
    return DrawnResult([t for r in results for t in r.tokens], [s for r in results for s in r.steps],
                       first.prompt_len, sum(r.prefill_s for r in results), sum(r.total_s for r in results),
                       first.finish_reason, draws=len(results))


class AtTracesSampling(Policy):
    """Forwards to ``inner``, telling it in ``start`` the sampling settings the traces were decoded with: the replay
    itself verifies greedily (a draft is accepted as the draws say), the policy is told what it would decode at live
    (``LearnedPolicy`` checks it against the temperature it was fitted for)."""

    def __init__(self, inner: Policy, temperature: float, top_p: float = 1.0):
        self.inner, self.sampling = inner, SamplingConfig(temperature=temperature, top_p=top_p)
        self.name, self.needs_token_feedback, self.uses_peeks = inner.name, inner.needs_token_feedback, inner.uses_peeks

    def validate(self, drafters, k_max):
        self.inner.validate(drafters, k_max)

    def start(self, request):
        return self.inner.start(replace(request, sampling=self.sampling))

    def decide(self, rows):
        return self.inner.decide(rows)

    def should_stop(self, row, token):
        return self.inner.should_stop(row, token)

    def observe(self, row, record):
        self.inner.observe(row, record)

    def __repr__(self) -> str:
        return repr(self.inner)
