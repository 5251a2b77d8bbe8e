"""Offline replay of any policy over teacher-forced traces (exact if greedy, in expectation if sampled), the oracle.

The replay runs the real ``SpeculativeDecoder`` loop (so policies, fallback and bookkeeping are the live ones) with a
``ReplayTarget`` that reproduces the target's recorded tokens and ``ReplayDrafter``s that propose what each drafter
would have proposed: the recorded tokens while they are accepted, a wrong token at the first rejection. For greedy
traces a token is accepted when it matches, so target calls and accepted tokens equal the live decoder's for any
policy; times come from the cost model.

With sampling a drafted token is accepted with probability beta, not when it equals the recorded token: a prompt of
sampled traces (``group_traces(rows, meta)`` stamps each prompt with the traces' temperature) is replayed in
expectation, over seeded draws of its acceptances from the recorded beta (``traces.draws``: the method and its
assumption). ``simulate``, ``best_static``, the oracle and rule tuning take both kinds; ``simulate_batch`` replays
greedy traces only (``SampledTracesError``). ``expected_tokens_per_s`` and ``expected_best_static`` give static-k
rates in closed form from the recorded beta.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from dataclasses import dataclass, field, replace

import torch
from torch import nn

from sacpolicy.decoding import (
    DecoderConfig,
    DraftBlock,
    Drafter,
    DraftRow,
    Peekable,
    RequestInfo,
    SpeculativeDecoder,
)
from sacpolicy.decoding.controller import room
from sacpolicy.policy import Decision, Policy, Static
from sacpolicy.runtime.cost import CostModel
from sacpolicy.runtime.features import Peek
from sacpolicy.traces.draws import DRAWS, AtTracesSampling, draws_of, is_sampled, merge_draws
from sacpolicy.traces.schema import trace_sampling

logger = logging.getLogger(__name__)


class SampledTracesError(ValueError):
    """Raised when a replay exact for greedy traces only (``simulate_batch``) is asked to replay sampled ones."""


def check_greedy(grouped: dict, what: str) -> None:
    """Raise ``SampledTracesError`` if any prompt of ``grouped`` was recorded with sampling."""
    temps = {p["temperature"] for p in grouped.values() if is_sampled(p)}
    if temps:
        raise SampledTracesError(
            f"{what} replays greedy traces only, but these were recorded with sampling (temperature {sorted(temps)}): "
            "a sampled draft is accepted with probability beta, not when it equals the recorded token. Fix: replay "
            "them one request at a time with simulate (in expectation over seeded draws), or collect greedy traces "
            "(sampling.temperature=0)")


class VirtualClock:
    """A decoder clock (``SpeculativeDecoder.clock``) whose time is what the cost model predicts: the replay target
    and drafters advance it by each pass's and each proposal's predicted seconds. ``drafted``: the tokens drafted
    since the last pass, which a pass priced by the tokens it feeds (``CostModel.verify_pass == "total"``) counts."""

    def __init__(self):
        self.t = 0.0
        self.drafted = 0

    def now(self) -> float:
        return self.t

    def sleep(self, seconds: float) -> None:
        self.t += seconds


class ReplayTarget(nn.Module):
    """A stand-in target whose greedy choice at every position is the recorded token of its sequence. Several
    sequences can be decoded together (a batched replay): sequence i's prompt is the token i repeated, and each row
    of the cache carries i + 1 in its entries, so rows are told apart as they join, leave and are compacted. With a
    ``clock`` and ``cost``, every pass advances the clock by the cost model's seconds for it (at its batch size; a
    prefill of rows admitted together, left-padded to the longest prompt, as one pass of that many rows; a verify
    pass as the cost model's host shapes it: padded to the longest block, or its rows' own tokens, ``verify_pass``)."""

    def __init__(self, sequences, vocab_size: int, max_context: int | None = None, clock: VirtualClock | None = None,
                 cost: CostModel | None = None):
        super().__init__()
        from transformers import GenerationConfig, LlamaConfig

        sequences = [sequences] if sequences and isinstance(sequences[0], int) else list(sequences)
        if len(sequences) > vocab_size:
            raise ValueError(f"a replay of {len(sequences)} sequences needs a vocabulary at least that large")
        width = max(len(q) for q in sequences) + 1  # a pad past the end: never emitted (the loop stops before)
        self.seqs = torch.zeros(len(sequences), width, dtype=torch.long)
        for i, q in enumerate(sequences):
            self.seqs[i, : len(q)] = torch.tensor(q)
        self.clock, self.cost = clock, cost
        self.head = nn.Linear(1, vocab_size, bias=False)
        self.config = LlamaConfig(vocab_size=vocab_size, num_hidden_layers=1,
                                  max_position_embeddings=max_context or width + 64)
        self.generation_config = GenerationConfig()

    def get_output_embeddings(self):
        return self.head

    def forward(self, input_ids, cache=None, use_cache=True, logits_to_keep=1, position_ids=None,
                attention_mask=None):
        B, T = input_ids.shape
        start = cache.get_seq_length()
        ids = input_ids[:, 0] if start == 0 else cache.layers[0].keys[:, 0, :, 0].amax(-1).long() - 1
        mark = (ids + 1).float().view(B, 1, 1, 1).expand(B, 1, T, 1)
        cache.update(mark, mark, 0)  # track positions and rows; crops and the batch's masks roll back
        pos = position_ids if position_ids is not None else (start + torch.arange(T)).expand(B, T)
        keep = pos[:, T - logits_to_keep :]
        logits = torch.zeros(B, logits_to_keep, self.head.out_features)
        nxt = self.seqs[ids[:, None], (keep + 1).clamp(max=self.seqs.shape[1] - 1)]
        logits.scatter_(-1, nxt.unsqueeze(-1), 1.0)
        if self.clock is not None:
            ctx = float((pos[:, 0] + 1).float().mean())
            if start == 0:
                self.clock.t += self.cost.prefill_time(T, B)
            elif self.cost.verify_pass == "total":  # a flattened pass (vLLM's): the rows' own tokens, no pads
                self.clock.t += self.cost.verify_total_time(B + self.clock.drafted, ctx, B)
            else:
                self.clock.t += self.cost.verify_time(T - 1, ctx, B)
            self.clock.drafted = 0

        class Out:
            pass

        Out.logits = logits
        return Out


class ReplayDrafter(Drafter):
    """Proposes what a drafter proposed from the target's prefix, with its recorded confidence. ``rows`` /
    ``prompt_len``: of one sequence, or {sequence index: ...} for a batched replay (the context's first token names
    the sequence, see ``ReplayTarget``). With a ``clock`` and ``cost``, each proposal advances it."""

    vocab_size = None

    def __init__(self, name: str, rows: dict, prompt_len, vocab_size: int, clock: VirtualClock | None = None,
                 cost: CostModel | None = None):
        self.name, self.V, self.clock, self.cost = name, vocab_size, clock, cost
        self.by_seq = rows if isinstance(prompt_len, dict) else {0: rows}
        self.lens = prompt_len if isinstance(prompt_len, dict) else {0: prompt_len}

    @staticmethod
    def of(name: str, rows: dict, prompt_len, vocab_size: int, clock: VirtualClock | None = None,
           cost: CostModel | None = None) -> ReplayDrafter:
        """The replay of drafter ``name``'s traces: one that peeks (``PeekableReplayDrafter``) when they are of a
        one-proposal drafter (n-gram), whose live counterpart peeks too."""
        first = next(iter(rows.values())) if isinstance(prompt_len, dict) else rows
        cls = PeekableReplayDrafter if first["proposal"][0] else ReplayDrafter
        return cls(name, rows, prompt_len, vocab_size, clock, cost)

    def _rows(self, context):
        i = int(context[0]) if len(self.by_seq) > 1 else next(iter(self.by_seq))
        return self.by_seq[i], context.shape[0] - self.lens[i]  # rows, generated tokens so far

    def propose(self, rows: list[DraftRow]) -> list[DraftBlock]:
        """Every row's proposal, drafted together as the decoder drafts a batch's rows: with a clock, each row that
        drafts pays its share of that many rows drafting together (``CostModel.draft_batch``)."""
        blocks = [self._propose(row.context, row.k, row.stop) for row in rows]
        if self.clock is not None:
            n = sum(1 for b in blocks if b.k)
            self.clock.drafted += sum(b.k for b in blocks)
            self.clock.t += sum(self.cost.draft_time(self.name, b.k, row.context.shape[0], max(n, 1))
                                for b, row in zip(blocks, rows))
        return blocks

    def _propose(self, context, k, stop) -> DraftBlock:
        rows, g = self._rows(context)  # g: the position predicted next
        G = len(rows["target_token"])
        k = min(k, rows["proposal_len"][g], G - g)
        run = rows["run_len"][g]
        tokens, conf = [], []
        for j in range(k):
            t = rows["target_token"][g + j]
            tokens.append(t if j < run else (t + 1) % self.V)  # a wrong token from the first mismatch on
            conf.append(confidence(rows, g, j))
            if stop is not None and j + 1 < k and stop(j, torch.tensor(conf[-1])):
                break
        if not tokens:
            return DraftBlock(torch.empty(0, dtype=torch.long), None)
        return DraftBlock(torch.tensor(tokens, dtype=torch.long), None, torch.tensor(conf))


class PeekableReplayDrafter(ReplayDrafter, Peekable):
    """The replay of a one-proposal drafter (n-gram, suffix): it peeks at its recorded proposal, as the live drafter
    does (``Peek``: each recorded token's confidence, as many as the recorded proposal holds, and its recorded first
    token, which the replayed block's tokens stand in for when it was not accepted)."""

    def peek(self, state, context):
        rows, g = self._rows(context)
        if g >= len(rows["proposal_len"]) or rows["proposal_len"][g] == 0:
            return None
        return Peek((confidence(rows, g, j) for j in range(rows["proposal_len"][g])), rows["draft_token"][g])


def confidence(rows: dict, g: int, j: int) -> list[float]:
    """(top-1, entropy, margin) of the j-th token of a block drafted from position g: its own row's for a model
    drafter; for a one-proposal drafter the token's own in the recorded proposal when its tokens have their own (the
    suffix drafter), else the block's first row's (the n-gram drafter copies one span at one confidence)."""
    if not rows["proposal"][g]:
        g += j
    else:
        own = rows.get("proposal_confidence")  # absent from hand-built rows
        own = own[g] if own else None
        if own and j < len(own):
            return list(own[j])
    return [rows["top1"][g], rows["entropy"][g], rows["margin"][g]]


def group_traces(traces, meta: dict | None = None, *, draws: int | None = None) -> dict:
    """Teacher-forced rows -> {prompt_id: {"prompt_len", "category", "temperature", "top_p", "draws", "drafters":
    {name: {column: [...]}}}}, drafters in collection order (the order the live decoder held them in, which the
    drafter-index feature depends on). ``meta``: the trace directory's (``schema.read_meta``), whose sampling settings
    each prompt carries, so that replays of sampled traces run in expectation; without it the rows are taken as
    greedy. ``draws``: seeded draws per prompt of that replay (default ``traces.draws.DRAWS``)."""
    sampling = {"temperature": 0.0, "top_p": 1.0} if meta is None else trace_sampling(meta)
    temperature, top_p = sampling["temperature"], sampling["top_p"]
    if temperature > 0.0 and meta.get("beta") != "processed":
        logger.warning("these sampled traces record beta from temperature-1 distributions (collected by an older "
                       "sacpolicy), not from the processed ones decoding at temperature %s verifies with; collect "
                       "them again for acceptance labels and replays that match it", temperature)
    out: dict = {}
    for r in sorted(traces, key=lambda r: (r["prompt_id"], r["position"])):  # stable: keeps the drafter order
        p = out.setdefault(r["prompt_id"], {"prompt_len": r["prompt_len"], "category": r["category"],
                                            "temperature": temperature, "top_p": top_p, "draws": draws or DRAWS,
                                            "drafters": {}})
        cols = p["drafters"].setdefault(r["drafter"], defaultdict(list))
        for c in ("target_token", "draft_token", "top1", "entropy", "margin", "run_len", "proposal_len", "beta",
                  "p_target", "proposal"):
            cols[c].append(r[c])
        cols["proposal_confidence"].append(r.get("proposal_confidence"))
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
    cost model's seconds in place of wall times (prefill, every step's draft and verify, the total).

    Greedy traces replay exactly, one result per prompt. A prompt of sampled traces replays once per draw of its
    acceptances (``traces.draws``), its draws merged into one result (``DrawnResult``: every draw's tokens, steps and
    seconds), so rates are expectations over the draws, and the policy is told the traces' temperature."""
    res = SimResult()
    for pid, p in grouped.items():
        names = drafters or list(p["drafters"])
        outs = [_replay(policy, q, names, cost, vocab_size, config) for q in draws_of(pid, p)]
        out = merge_draws(outs) if is_sampled(p) else outs[0]
        res.tokens += len(out.tokens)
        res.target_calls += out.target_calls
        res.accepted += sum(s.accepted for s in out.steps)
        res.drafted += sum(s.drafted for s in out.steps)
        res.predicted_s += out.total_s
        res.per_prompt[pid] = (out.target_calls, [s.accepted for s in out.steps])
        res.results.append((p["category"], out))
    return res


def _replay(policy: Policy, p: dict, names: list[str], cost: CostModel, vocab_size: int, config):
    """One prompt's replay (a greedy one, or one draw of a sampled one): its result in cost-model seconds."""
    any_rows = p["drafters"][names[0]]
    seq = [0] * p["prompt_len"] + list(any_rows["target_token"])
    G = len(any_rows["target_token"])
    replay = [ReplayDrafter.of(n, p["drafters"][n], p["prompt_len"], vocab_size) for n in names]
    if hasattr(policy, "current"):  # policies that read the traces (the oracle, example recorders): this draw's
        policy.current = p
    if is_sampled(p):
        policy = AtTracesSampling(policy, p["temperature"], p.get("top_p", 1.0))
    dec = SpeculativeDecoder(ReplayTarget(seq, vocab_size), replay, policy, config=config or DecoderConfig(),
                             stop_token_ids=[])
    out = dec.generate(seq[: p["prompt_len"]], G, request=RequestInfo(category=p["category"]))
    out.prefill_s = cost.prefill_time(p["prompt_len"])
    for s in out.steps:
        s.draft_s = cost.draft_time(s.drafter, s.drafted, s.context_len)
        s.verify_s = cost.verify_time(s.drafted, s.context_len)
    out.total_s = out.prefill_s + sum(s.draft_s + s.verify_s for s in out.steps)
    return out


@dataclass
class BatchSimResult:
    """A batched replay: every request's result (cost-model seconds: ``queued_s``, ``total_s``) and the makespan."""

    results: list  # GenerationResult per prompt, in grouped order
    makespan_s: float

    @property
    def tokens(self) -> int:
        return sum(len(r.tokens) for r in self.results)

    @property
    def target_calls(self) -> int:
        return sum(r.target_calls for r in self.results)

    @property
    def accepted(self) -> int:
        return sum(s.accepted for r in self.results for s in r.steps)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.makespan_s if self.makespan_s else 0.0

    def latency_percentile(self, q: float) -> float:
        import numpy as np

        return float(np.percentile([r.latency_s for r in self.results], q))


def simulate_batch(policy: Policy, grouped: dict, cost: CostModel, *, vocab_size: int, max_batch: int,
                   arrivals: list[float] | None = None, config: DecoderConfig | None = None,
                   drafters: list[str] | None = None, load_batch: int | None = None) -> BatchSimResult:
    """Replay ``policy`` over the prompts of ``grouped`` decoded ``max_batch`` at a time by the batched decoder
    (continuous batching; ``arrivals``: seconds at which each prompt arrives), on a virtual clock that the cost model
    advances per pass (its verify curve at the live batch size) and per proposal. Greedy traces make every row exact,
    as in ``simulate``: acceptance does not depend on the batch, the pass's cost does (the cost model needs batch
    curves for max_batch > 1: ``profile(..., batch_sizes=...)``). ``load_batch``: the batch size the live load is
    measured against (rows / load_batch; default max_batch)."""
    check_greedy(grouped, "simulate_batch")
    if hasattr(policy, "current"):
        raise ValueError(f"{policy!r} reads the traces of the request it decides for; the batched replay cannot hand "
                         "it each row's: replay it with simulate (one request at a time)")
    cost.check_batch(max_batch)
    pids = list(grouped)
    names = drafters or list(grouped[pids[0]]["drafters"])
    clock = VirtualClock()
    seqs = [[i] * grouped[pid]["prompt_len"] + list(grouped[pid]["drafters"][names[0]]["target_token"])
            for i, pid in enumerate(pids)]
    replay = [ReplayDrafter.of(n, {i: grouped[pid]["drafters"][n] for i, pid in enumerate(pids)},
                            {i: grouped[pid]["prompt_len"] for i, pid in enumerate(pids)}, vocab_size, clock, cost)
              for n in names]
    cfg = replace(config or DecoderConfig(), max_batch=load_batch or max_batch, timing=False)
    dec = SpeculativeDecoder(ReplayTarget(seqs, vocab_size, clock=clock, cost=cost), replay, policy, config=cfg,
                             stop_token_ids=[])
    dec.clock = clock
    lens = [grouped[pid]["prompt_len"] for pid in pids]
    out = dec.generate_batch([q[:L] for q, L in zip(seqs, lens)], [len(q) - L for q, L in zip(seqs, lens)],
                             requests=[RequestInfo(category=grouped[pid]["category"]) for pid in pids],
                             arrivals=arrivals, max_batch=max_batch)
    return BatchSimResult(out, clock.t)


class Oracle(Policy):
    """Knows the future: drafts exactly the run that will be accepted, with the drafter that makes the step
    fastest under the cost model (or none, when no run pays for its draft). On sampled traces it knows each draw's
    outcomes (``simulate`` hands it the drawn runs): a bound on what any policy gets from those draws."""

    name = "oracle"

    def __init__(self, cost: CostModel, k_max: int = 16):
        self.cost, self.k_max, self.current = cost, k_max, None

    def decide(self, rows) -> list[Decision]:
        return [self._decide(row.state) for row in rows]

    def _decide(self, state) -> Decision:
        g = state.generated
        best = (1.0 / self.cost.step_time(None, 0, state.context_len), None, 0)
        for name in state.drafters:
            rows = self.current["drafters"][name]
            r = min(rows["run_len"][g], rows["proposal_len"][g], room(state.remaining, self.k_max))
            if r > 0:
                rate = (r + 1) / self.cost.step_time(name, r, state.context_len)
                best = max(best, (rate, name, r))
        return Decision(best[1], best[2]) if best[1] else Decision.autoregressive()


def _by_category(grouped: dict, by_category: bool) -> dict:
    if not by_category:
        return {"all": grouped}
    groups: dict = defaultdict(dict)
    for pid, p in grouped.items():
        groups[p["category"]][pid] = p
    return groups


def best_static(grouped: dict, cost: CostModel, *, vocab_size: int, k_max: int = 8, by_category: bool = False) -> dict:
    """The static (drafter, k) with the highest replayed tokens/s, over all prompts or per category (exact on greedy
    traces, in expectation on sampled ones: ``simulate``)."""
    out = {}
    for cat, g in _by_category(grouped, by_category).items():
        drafters = list(next(iter(g.values()))["drafters"])
        scores = {(d, k): simulate(Static(k, d), g, cost, vocab_size=vocab_size, drafters=[d]).tokens_per_s
                  for d in drafters for k in range(1, k_max + 1)}
        (d, k), tps = max(scores.items(), key=lambda kv: kv[1])
        out[cat] = {"drafter": d, "k": k, "tokens_per_s": tps}
    return out


def expected_tokens_per_s(grouped: dict, cost: CostModel, drafter: str, k: int) -> float:
    """Static k in expectation, for sampled traces (greedy ones too): a step from generated position g drafts
    k_g = min(k, proposal_len[g], tokens left) tokens and emits 1 + sum_j prod_{i<=j} beta[g + i] on average (no
    draft: one token at the autoregressive step's cost). Ratio of sums over every position a step can start from.
    A one-proposal drafter (n-gram) records beta for the first token of its span only; later tokens of the span use
    the beta of the span proposed from their own position, an approximation."""
    tokens = seconds = 0.0
    for p in grouped.values():
        rows = p["drafters"][drafter]
        beta, plen = rows["beta"], rows["proposal_len"]
        for g in range(1, len(beta)):  # position 0 is the prefill's token
            kg, ctx = min(k, plen[g], len(beta) - g), p["prompt_len"] + g
            tokens += cost.expected_tokens([min(max(b, 0.0), 1.0) for b in beta[g: g + kg]])  # float32 rounding
            seconds += cost.step_time(drafter if kg else None, kg, ctx)
    return tokens / seconds if seconds else 0.0


def expected_best_static(grouped: dict, cost: CostModel, *, k_max: int = 8, by_category: bool = False) -> dict:
    """``best_static`` for sampled traces: the static (drafter, k) with the highest ``expected_tokens_per_s``, in the
    same format plus ``"estimate": "expected"``."""
    out = {}
    for cat, g in _by_category(grouped, by_category).items():
        drafters = list(next(iter(g.values()))["drafters"])
        scores = {(d, k): expected_tokens_per_s(g, cost, d, k) for d in drafters for k in range(1, k_max + 1)}
        (d, k), tps = max(scores.items(), key=lambda kv: kv[1])
        out[cat] = {"drafter": d, "k": k, "tokens_per_s": tps, "estimate": "expected"}
    return out
