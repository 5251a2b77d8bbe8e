"""Exact offline replay of any policy over greedy teacher-forced traces, the oracle, and the best static k.

The replay runs the real ``SpeculativeDecoder`` loop (so policies, fallback and bookkeeping are the live ones) with a
``ReplayTarget`` that reproduces the target's recorded greedy tokens and ``ReplayDrafter``s that propose what each
drafter would have proposed: the recorded tokens while they match, a wrong token at the first mismatch. Target calls
and accepted tokens therefore equal the live decoder's for any policy; times come from the cost model. For sampled
traces, ``expected_tokens_per_s`` gives the static-k rate in expectation from the recorded beta.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import torch
from torch import nn

from sacpolicy.decoding import (
    DecoderConfig,
    DraftBlock,
    Drafter,
    RequestInfo,
    SpeculativeDecoder,
)
from sacpolicy.policy import Decision, Policy, Static
from sacpolicy.runtime.cost import CostModel


class ReplayTarget(nn.Module):
    """A stand-in target whose greedy choice at every position is the recorded token."""

    def __init__(self, sequence: list[int], vocab_size: int, max_context: int | None = None):
        super().__init__()
        from transformers import GenerationConfig, LlamaConfig

        self.seq = torch.tensor(sequence + [0])  # a pad past the end: never emitted (the loop stops before)
        self.head = nn.Linear(1, vocab_size, bias=False)
        self.config = LlamaConfig(vocab_size=vocab_size, num_hidden_layers=1,
                                  max_position_embeddings=max_context or len(sequence) + 64)
        self.generation_config = GenerationConfig()

    def get_output_embeddings(self):
        return self.head

    def forward(self, input_ids, cache=None, use_cache=True, logits_to_keep=1):
        start, T = cache.get_seq_length(), input_ids.shape[1]
        cache.update(torch.zeros(1, 1, T, 1), torch.zeros(1, 1, T, 1), 0)  # track positions; crop rolls back
        pos = torch.arange(start + T - logits_to_keep, start + T)
        logits = torch.zeros(logits_to_keep, self.head.out_features)
        logits[torch.arange(logits_to_keep), self.seq[(pos + 1).clamp(max=len(self.seq) - 1)]] = 1.0

        class Out:
            pass

        Out.logits = logits.unsqueeze(0)
        return Out


class ReplayDrafter(Drafter):
    """Proposes what a drafter proposed from the target's prefix, with its recorded confidence."""

    vocab_size = None

    def __init__(self, name: str, rows: dict, prompt_len: int, vocab_size: int):
        self.name, self.rows, self.L, self.V = name, rows, prompt_len, vocab_size
        self.peekable = bool(rows["proposal"][0])  # only one-proposal drafters (n-gram) can peek

    def peek(self, context):
        g = context.shape[0] - self.L
        if g >= len(self.rows["proposal_len"]) or self.rows["proposal_len"][g] == 0:
            return None
        return tuple(confidence(self.rows, g, 0))

    def propose(self, context, k, sampling, generator=None, stop=None) -> DraftBlock:
        g = context.shape[0] - self.L  # generated tokens so far = the position predicted next
        G = len(self.rows["target_token"])
        k = min(k, self.rows["proposal_len"][g], G - g)
        run = self.rows["run_len"][g]
        tokens, conf = [], []
        for j in range(k):
            t = self.rows["target_token"][g + j]
            tokens.append(t if j < run else (t + 1) % self.V)  # a wrong token from the first mismatch on
            conf.append(confidence(self.rows, g, j))
            if stop is not None and j + 1 < k and stop(j, torch.tensor(conf[-1])):
                break
        if not tokens:
            return DraftBlock(torch.empty(0, dtype=torch.long), None)
        return DraftBlock(torch.tensor(tokens, dtype=torch.long), None, torch.tensor(conf))


def confidence(rows: dict, g: int, j: int) -> list[float]:
    """(top-1, entropy, margin) of the j-th token of a block drafted from position g: its own row's for a model
    drafter, the block's first row's for a one-proposal drafter (the n-gram drafter copies one span)."""
    i = g if rows["proposal"][g] else g + j
    return [rows["top1"][i], rows["entropy"][i], rows["margin"][i]]


def group_traces(traces) -> dict:
    """Teacher-forced rows -> {prompt_id: {"prompt_len", "category", "drafters": {name: {column: [...]}}}}, drafters
    in collection order (the order the live decoder held them in, which the drafter-index feature depends on)."""
    out: dict = {}
    for r in sorted(traces, key=lambda r: (r["prompt_id"], r["position"])):  # stable: keeps the drafter order
        p = out.setdefault(r["prompt_id"], {"prompt_len": r["prompt_len"], "category": r["category"], "drafters": {}})
        cols = p["drafters"].setdefault(r["drafter"], defaultdict(list))
        for c in ("target_token", "draft_token", "top1", "entropy", "margin", "run_len", "proposal_len", "beta",
                  "proposal"):
            cols[c].append(r[c])
    return out


@dataclass
class SimResult:
    tokens: int = 0
    target_calls: int = 0
    accepted: int = 0
    drafted: int = 0
    predicted_s: float = 0.0
    per_prompt: dict = field(default_factory=dict)  # prompt_id -> (target_calls, [accepted per step])
    results: list = field(default_factory=list)  # (category, GenerationResult with predicted seconds) per prompt

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.predicted_s if self.predicted_s else 0.0


def simulate(policy: Policy, grouped: dict, cost: CostModel, *, vocab_size: int,
             config: DecoderConfig | None = None, drafters: list[str] | None = None) -> SimResult:
    """Replay ``policy`` over every prompt of ``grouped`` (from ``group_traces``). Each replayed result carries the
    cost model's seconds in place of wall times (prefill, every step's draft and verify, the total)."""
    res = SimResult()
    for pid, p in grouped.items():
        names = drafters or list(p["drafters"])
        any_rows = p["drafters"][names[0]]
        seq = [0] * p["prompt_len"] + list(any_rows["target_token"])
        G = len(any_rows["target_token"])
        replay = [ReplayDrafter(n, p["drafters"][n], p["prompt_len"], vocab_size) for n in names]
        if hasattr(policy, "current"):  # policies that read the traces (the oracle, example recorders)
            policy.current = p
        dec = SpeculativeDecoder(ReplayTarget(seq, vocab_size), replay, policy, config=config or DecoderConfig(),
                                 stop_token_ids=[])
        out = dec.generate(seq[: p["prompt_len"]], G, request=RequestInfo(category=p["category"]))
        out.prefill_s = cost.verify_time(p["prompt_len"] - 1, 0)
        for s in out.steps:
            s.draft_s = cost.draft_time(s.drafter, s.drafted, s.context_len)
            s.verify_s = cost.verify_time(s.drafted, s.context_len)
        out.total_s = out.prefill_s + sum(s.draft_s + s.verify_s for s in out.steps)
        res.tokens += len(out.tokens)
        res.target_calls += out.target_calls
        res.accepted += sum(s.accepted for s in out.steps)
        res.drafted += sum(s.drafted for s in out.steps)
        res.predicted_s += out.total_s
        res.per_prompt[pid] = (out.target_calls, [s.accepted for s in out.steps])
        res.results.append((p["category"], out))
    return res


class Oracle(Policy):
    """Knows the future: drafts exactly the run that will be accepted, with the drafter that makes the step
    fastest under the cost model (or none, when no run pays for its draft)."""

    name = "oracle"

    def __init__(self, cost: CostModel, k_max: int = 16):
        self.cost, self.k_max, self.current = cost, k_max, None

    def decide(self, state) -> Decision:
        g = state.generated
        best = (1.0 / self.cost.step_time(None, 0, state.context_len), None, 0)
        for name in state.drafters:
            rows = self.current["drafters"][name]
            r = min(rows["run_len"][g], rows["proposal_len"][g], self.k_max, state.remaining - 1)
            if r > 0:
                rate = (r + 1) / self.cost.step_time(name, r, state.context_len)
                best = max(best, (rate, name, r))
        return Decision(best[1], best[2]) if best[1] else Decision.autoregressive()


def best_static(grouped: dict, cost: CostModel, *, vocab_size: int, k_max: int = 8, by_category: bool = False) -> dict:
    """The static (drafter, k) with the highest predicted tokens/s, over all prompts or per category."""
    groups = {"all": grouped}
    if by_category:
        groups = defaultdict(dict)
        for pid, p in grouped.items():
            groups[p["category"]][pid] = p
    out = {}
    for cat, g in groups.items():
        drafters = list(next(iter(g.values()))["drafters"])
        scores = {(d, k): simulate(Static(k, d), g, cost, vocab_size=vocab_size, drafters=[d]).tokens_per_s
                  for d in drafters for k in range(1, k_max + 1)}
        (d, k), tps = max(scores.items(), key=lambda kv: kv[1])
        out[cat] = {"drafter": d, "k": k, "tokens_per_s": tps}
    return out


def expected_tokens_per_s(grouped: dict, cost: CostModel, drafter: str, k: int) -> float:
    """Sampled traces, static k, in expectation: a step starting at any position emits
    1 + sum_j prod_{i<=j} beta_i tokens on average and costs step_time."""
    tokens = seconds = 0.0
    for p in grouped.values():
        beta = p["drafters"][drafter]["beta"]
        for g in range(1, len(beta)):
            tokens += cost.expected_tokens(beta[g : g + k])
            seconds += cost.step_time(drafter, min(k, len(beta) - g), p["prompt_len"] + g)
    return tokens / seconds if seconds else 0.0
