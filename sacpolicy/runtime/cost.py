"""The cost model: how long a speculative step takes on one device, and the tokens/s it is expected to buy.

One definition serves the policies (choose k), the simulator (replay traces at a profiled device's speed) and the
exported runtime, so this module needs numpy only; ``sacpolicy.profiling.profile`` measures a device and returns one:

    cost = profile(target.model, [ModelDrafter(draft.model, name="draft"), NgramDrafter()])
    cost.to_json("cost.json")
    k, tokens_per_s = CostModel.from_json("cost.json").best_k("draft", 300, accept_probs=[0.8] * 8, k_max=8)

Model of a step drafting k tokens on top of `context` committed tokens:
    verify = a(k + 1) + b * context         a: piecewise linear in tokens fed, b: seconds per cached token
    draft  = k * d(context + (k - 1) / 2)   model drafters: one forward per drafted token
             + f(context)                   plus, where profiled (``draft_fixed``), a once-per-proposal cost: a feature
                                            head feeds the rows committed since its last proposal before drafting
    draft  = d(context)                     n-gram (and other model-free) drafters: one lookup per proposal

Prefill: a prompt of n tokens fed at once, where profiled (``prefill``, a line over the profiled contexts):
    prefill = f_p(n)                        else the verify curve at n tokens fed (older files: an extrapolation)
Requests admitted to a batch together prefill in one pass over their prompts left-padded to the longest (n tokens):
    prefill = f_p(rows * n)                 a prompt's pass is compute-bound, so the pass costs the tokens it feeds,
                                            pads included, and its fixed cost once (profiled at one row only)

Batches: a target pass verifying B rows of k + 1 tokens each costs a_B(k + 1) + b_B * context (context: the rows'
mean), profiled at a few batch sizes (``batch``) and interpolated linearly in B between them; each row drafts its own
block, so a batch's draft time is the sum of its rows'. A model profiled at B = 1 only refuses a larger B. Rows that
draft with the same model drafter draft together (one forward per token over all of them), so each row's share costs
less: where profiled (``draft_batch``), a row's draft time is its one-row time times g(r), the per-row share of r rows
drafting together (g(1) = 1; interpolated between the profiled r, the last one's beyond them).

The decoder's own work: where profiled with a sampling setting (``step_base``, ``step_draft``), the real decoder was
run for a few steps of every drafter and k, one row, and timed against the passes above; what its steps took beyond
them is added to a one-row step:
    + step_base                             every step: choosing or drawing the next token, committing it, the
                                            loop's own work; less what the passes above over-price inside the loop
                                            (it can be negative) (``verify_time`` at batch size 1)
    + step_draft[drafter](k)                a step drafting k tokens with that drafter: the draft tokens'
                                            probabilities and draws, verification, the step's statistics, and what
                                            the drafter's passes cost inside the loop beyond their isolated timing
                                            (``draft_time`` of a row drafting alone)
Both depend on the sampling setting (``meta["overhead_sampling"]``: greedy verification reads argmaxes, sampled
verification builds probabilities for every drafted and verified position). Batches are priced by their passes
alone: what one row's loop costs beyond its passes does not say what B rows' loop does.

How a host's pass is shaped (``verify_pass``): our batched decoder pads every row's block to the longest
(``"padded"``: the pass costs B rows of the widest block, the batch curves as profiled); vLLM flattens the batch's
tokens into one sequence (``"total"``: the pass costs the sum of the rows' k_i + 1 tokens fed). A batch profiled with
every row at one width w fed B * w tokens, so a flattened pass of T tokens over B rows is priced as the profiled
B-row pass at the mean width T / B (between profiled widths, the curve's linear interpolation): exact at every
profiled point, and no constant beyond the profile (``verify_total_time``).

A profiled curve keeps each knot's 95% interval (``lo``, ``hi``) beside its value; ``profiling`` makes the verify curve
non-decreasing in tokens fed unless the intervals show a decrease beyond noise. Files without intervals still load.
"""

from __future__ import annotations

import bisect
import json
import logging
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from sacpolicy.runtime.curve import PiecewiseLinear

logger = logging.getLogger(__name__)

VERIFY_PASSES = ("padded", "total")  # how a host's target pass is shaped (module docstring)
COST_FORMAT = 1  # intervals (lo, hi), per-batch-size curves (batch), per-proposal draft costs (draft_fixed), the
# prefill curve (prefill), batched drafting (draft_batch), the decoder's own work (step_base, step_draft) and the
# pass's shape (verify_pass: padded when absent) are optional: older files load unchanged
# Floor on every predicted time: a noisy fit extrapolated far from its knots may cross zero, and tokens/s must stay
# finite and positive.
_MIN_S = 1e-7


@dataclass
class CostModel:
    device: str
    # {"tokens": PiecewiseLinear over tokens fed (k + 1), "per_context": seconds per cached token, one number or a
    # PiecewiseLinear over tokens fed (profiled batches: a wide pass reads the cache with more queries)}
    verify: dict
    draft: dict[str, PiecewiseLinear]  # drafter -> seconds of one draft step (or one proposal) vs context length
    per_token_draft: dict[str, bool]  # True: cost per drafted token (model drafters); False: per proposal (n-gram)
    meta: dict = field(default_factory=dict)  # torch version, device name, dtype, when profiled, target
    # batch size B > 1 -> its verify curves ({"tokens", "per_context"}, as ``verify``); B = 1 is ``verify``
    batch: dict[int, dict] = field(default_factory=dict)
    # per-token drafter -> seconds it spends once per proposal on top of k * draft (vs context length)
    draft_fixed: dict[str, PiecewiseLinear] = field(default_factory=dict)
    prefill: PiecewiseLinear | None = None  # seconds of a target forward over a prompt of n tokens, vs n
    # drafter -> g(r): its per-row draft time when r rows draft together, as a fraction of one row's (g(1) = 1)
    draft_batch: dict[str, PiecewiseLinear] = field(default_factory=dict)
    step_base: float = 0.0  # seconds of the decoder's own work per step and row beyond the passes (module docstring)
    # drafter -> seconds of the decoder's own work per step and row drafting k tokens, vs k (on top of step_base)
    step_draft: dict[str, PiecewiseLinear] = field(default_factory=dict)
    # how the host's target pass is shaped: "padded" (blocks padded to the longest: our decoder) or "total" (the
    # batch's tokens flattened: vLLM); module docstring
    verify_pass: str = "padded"

    def __post_init__(self) -> None:
        if self.verify_pass not in VERIFY_PASSES:
            raise ValueError(f"verify_pass must be one of {list(VERIFY_PASSES)} (how the host's target pass is "
                             f"shaped), got {self.verify_pass!r}")
        for b, curves in [(1, self.verify), *self.batch.items()]:
            if set(curves) != {"tokens", "per_context"}:
                raise ValueError(f"verify curves (batch {b}) must have keys 'tokens' and 'per_context', "
                                 f"got {sorted(curves)}")
        self.batch = {int(b): v for b, v in sorted(self.batch.items(), key=lambda kv: int(kv[0]))}
        if any(b < 2 for b in self.batch):
            raise ValueError(f"batch verify curves are for batch sizes >= 2 (B = 1 is `verify`), got {list(self.batch)}")
        if set(self.draft) != set(self.per_token_draft):
            raise ValueError(f"draft curves {sorted(self.draft)} and per_token_draft {sorted(self.per_token_draft)} "
                             "must name the same drafters")
        once = [name for name in self.draft_fixed if not self.per_token_draft.get(name, False)]
        if once:
            raise ValueError(f"draft_fixed is a per-proposal cost on top of a per-token one, but {once} "
                             f"{'is' if len(once) == 1 else 'are'} not per-token drafters of this model "
                             f"(per_token_draft: {self.per_token_draft})")
        for name, g in self.draft_batch.items():
            if name not in self.draft:
                raise ValueError(f"draft_batch names drafter {name!r}, which has no draft curve; profiled: "
                                 f"{sorted(self.draft)}")
            if g.xs[0] != 1.0 or g.ys[0] != 1.0 or min(g.ys) <= 0.0:
                raise ValueError(f"draft_batch[{name!r}] must start at 1 row with share 1 and stay positive, got xs "
                                 f"{g.xs} and ys {g.ys}. Fix: re-profile with sacpolicy.profiling.profile")
        unknown = sorted(set(self.step_draft) - set(self.draft))
        if unknown:
            raise ValueError(f"step_draft names drafters {unknown} with no draft curve; profiled: {sorted(self.draft)}")
        self.step_base = float(self.step_base)

    @property
    def batch_sizes(self) -> list[int]:
        """The batch sizes this model was profiled at."""
        return [1, *self.batch]

    def verify_time(self, k: int, context_len: float, batch: int = 1) -> float:
        """Seconds of one target pass verifying ``batch`` rows of k drafted tokens (+ the last committed one) each."""
        return self._verify_at(self._segment(batch), k, context_len)

    def verify_table(self, k_max: int, context_len: float, batch: int = 1) -> list[float]:
        """``verify_time(k, context_len, batch)`` for k = 0 .. k_max (the batch sizes' segment found once)."""
        segment = self._segment(batch)
        return [self._verify_at(segment, k, context_len) for k in range(k_max + 1)]

    def verify_total_time(self, tokens: float, context_len: float, batch: int = 1) -> float:
        """Seconds of one target pass feeding ``tokens`` tokens in all over ``batch`` rows flattened into one sequence
        (vLLM's pass): the profiled ``batch``-row pass at the mean width tokens / batch (module docstring). One row:
        ``verify_time(tokens - 1, ...)``."""
        if tokens < batch:
            raise ValueError(f"a pass over {batch} rows feeds at least {batch} tokens (each row's last one), "
                             f"got {tokens}")
        return self._total_at(self._segment(batch), tokens, batch, context_len)

    def _total_at(self, segment: tuple, tokens: float, batch: int, context_len: float) -> float:
        """``verify_total_time`` on a ``segment`` already found: the ``batch``-row pass at the mean width."""
        return self._verify_at(segment, tokens / batch - 1, context_len)

    def token_seconds(self, tokens: float, context_len: float, batch: int) -> float:
        """Seconds one more drafted token adds to a batch's pass that feeds ``tokens`` tokens: for a ``"total"``
        pass the slope of ``verify_total_time`` there; 0 for a ``"padded"`` one (it is as wide as the plan's longest
        block whatever one row drafts). What a row's stop rule adds to its own draft time."""
        if self.verify_pass == "padded":
            return 0.0
        return max(0.0, self.verify_total_time(tokens + 1, context_len, batch)
                   - self.verify_total_time(tokens, context_len, batch))

    def _segment(self, batch: int) -> tuple:
        """(curves of the profiled batch size at or below ``batch``, curves above, those two sizes, batch): the
        segment ``verify_time`` interpolates along; B = 1 alone is (verify, None, 1, 1, 1)."""
        if batch == 1:
            return self.verify, None, 1, 1, 1
        self.check_batch(batch)
        sizes = self.batch_sizes
        i = min(max(bisect.bisect_right(sizes, batch) - 1, 0), len(sizes) - 2)  # outer segment extends beyond
        lo, hi = sizes[i], sizes[i + 1]
        return self.verify if lo == 1 else self.batch[lo], self.batch[hi], lo, hi, batch

    def _verify_at(self, segment: tuple, k: int, context_len: float) -> float:
        low, high, lo, hi, batch = segment
        own = self.step_base if batch == 1 else 0.0  # the decoder's own work, timed for one row (module docstring)
        t_lo = self._verify(low, k, context_len)
        if high is None:
            return max(_MIN_S, t_lo + own)
        t_hi = self._verify(high, k, context_len)
        return max(_MIN_S, t_lo + (t_hi - t_lo) * (batch - lo) / (hi - lo) + own)

    def check_batch(self, batch: int) -> None:
        """Raise unless this model can time a pass of ``batch`` rows."""
        if batch < 1:
            raise ValueError(f"batch size must be >= 1, got {batch}")
        if batch > 1 and not self.batch:
            raise ValueError(f"this cost model was profiled at batch size 1 only and cannot time a batch of {batch}. "
                             "Fix: re-profile with sacpolicy.profiling.profile(..., batch_sizes=[1, 2, 4, 8, 16])")

    @staticmethod
    def _verify(curves: dict, k: int, context_len: float) -> float:
        per = curves["per_context"]
        return max(_MIN_S, curves["tokens"](k + 1) + (per(k + 1) if callable(per) else per) * context_len)

    def prefill_time(self, prompt_len: int, rows: int = 1) -> float:
        """Seconds of the target's pass over a prompt of ``prompt_len`` tokens (no cache), or over ``rows`` prompts
        prefilled together, left-padded to ``prompt_len`` tokens (the longest): priced as one prompt of
        rows * prompt_len tokens (module docstring). A model without a profiled prefill curve extends its verify curve
        to that many tokens fed, which a noisy last knot can make far too steep: re-profile for a measured one."""
        if rows < 1:
            raise ValueError(f"a prefill pass has at least one row, got rows={rows}")
        tokens = rows * prompt_len
        if self.prefill is None:
            return self.verify_time(tokens - 1, 0)
        return max(_MIN_S, self.prefill(tokens))

    def draft_time(self, drafter: str | None, k: int, context_len: int, rows: int = 1) -> float:
        """Seconds one row spends drafting k tokens on ``context_len`` committed ones, ``rows`` rows drafting with this
        drafter together (its share of their batched drafting, where ``draft_batch`` has the drafter)."""
        if drafter is None or k <= 0:
            return 0.0
        # the decoder's own work, timed for one row drafting alone (module docstring)
        own = self.step_draft[drafter](k) if drafter in self.step_draft and rows == 1 else 0.0
        if rows > 1 and drafter in self.draft_batch:
            g = self.draft_batch[drafter]
            return max(_MIN_S, g(min(rows, g.xs[-1])) * self._draft_passes(drafter, k, context_len) + own)
        return max(_MIN_S, self._draft_passes(drafter, k, context_len) + own)

    def _draft_passes(self, drafter: str, k: int, context_len: int) -> float:
        """One row's drafting of k tokens alone, as its passes were timed."""
        if drafter not in self.draft:
            raise ValueError(f"no draft cost for drafter {drafter!r}; profiled: {sorted(self.draft)}. "
                             "Fix: re-run profile() with this drafter, or pick a profiled one")
        if not self.per_token_draft[drafter]:
            return max(_MIN_S, self.draft[drafter](context_len))
        # draft step i runs on context_len + i cached tokens; the curve is near-linear, so use the block's middle
        fixed = self.draft_fixed.get(drafter)
        once = max(0.0, fixed(context_len)) if fixed is not None else 0.0
        return once + k * max(_MIN_S, self.draft[drafter](context_len + (k - 1) / 2))

    def step_time(self, drafter: str | None, k: int, context_len: int, batch: int = 1, rows: int = 1) -> float:
        """One row's draft (``rows`` rows drafting with it together) plus the target pass (of ``batch`` rows of
        k + 1 tokens)."""
        return self.draft_time(drafter, k, context_len, rows) + self.verify_time(k, context_len, batch)

    @staticmethod
    def expected_tokens(accept_probs: Sequence[float]) -> float:
        """accept_probs[i] = P(drafted token i accepted | all before it accepted). The step emits the accepted tokens
        plus one (the correction or bonus token): 1 + sum_j P(first j+1 accepted) = 1 + sum_j prod_{i<=j} a_i."""
        total, alive = 1.0, 1.0
        for a in accept_probs:
            if not 0.0 <= a <= 1.0:
                raise ValueError(f"acceptance probabilities must lie in [0, 1], got {a}")
            alive *= a
            total += alive
        return total

    @staticmethod
    def expected_tokens_table(accept_probs: Sequence[float]) -> list[float]:
        """``expected_tokens(accept_probs[:k])`` for k = 0 .. len(accept_probs), in one pass (the same sums)."""
        total, alive, out = 1.0, 1.0, [1.0]
        for a in accept_probs:
            if not 0.0 <= a <= 1.0:
                raise ValueError(f"acceptance probabilities must lie in [0, 1], got {a}")
            alive *= a
            total += alive
            out.append(total)
        return out

    def draft_table(self, drafter: str | None, k_max: int, context_len: int, rows: int = 1) -> list[float]:
        """``draft_time(drafter, k, context_len, rows)`` for k = 0 .. k_max."""
        return [self.draft_time(drafter, k, context_len, rows) for k in range(k_max + 1)]

    def expected_tokens_per_s(self, drafter: str | None, k: int, context_len: int,
                              accept_probs: Sequence[float], batch: int = 1) -> float:
        """One row's expected tokens per second of a step (the step's target pass verifying ``batch`` rows)."""
        if k < 0:
            raise ValueError(f"k must be >= 0, got {k}")
        if drafter is None or k == 0:
            return 1.0 / self.verify_time(0, context_len, batch)
        if len(accept_probs) < k:
            raise ValueError(f"k={k} drafted tokens need {k} acceptance probabilities, got {len(accept_probs)}; "
                             "pass one per position up to k_max")
        return self.expected_tokens(accept_probs[:k]) / self.step_time(drafter, k, context_len, batch)

    def tokens_per_s_table(self, drafter: str, context_len: int, accept_probs: Sequence[float],
                           batch: int = 1, verify: Sequence[float] | None = None, rows: int = 1) -> list[float]:
        """``expected_tokens_per_s(drafter, k, ...)`` for k = 1 .. len(accept_probs), in one pass, ``rows`` rows
        drafting with this drafter together. ``verify``: ``verify_table(len(accept_probs), context_len, batch)`` when
        the caller has it already."""
        tokens = self.expected_tokens_table(accept_probs)
        if verify is None:
            verify = self.verify_table(len(tokens) - 1, context_len, batch)
        draft = self.draft_table(drafter, len(tokens) - 1, context_len, rows)
        return [tokens[k] / (draft[k] + verify[k]) for k in range(1, len(tokens))]

    def best_k(self, drafter: str | None, context_len: int, accept_probs: Sequence[float],
               k_max: int, batch: int = 1) -> tuple[int, float]:
        """(k, expected tokens/s) maximising tokens/s over k in 0..k_max; ties go to the smaller k."""
        best = (0, self.expected_tokens_per_s(None, 0, context_len, (), batch))
        for k in range(1, k_max + 1 if drafter is not None else 1):
            tps = self.expected_tokens_per_s(drafter, k, context_len, accept_probs, batch)
            if tps > best[1]:
                best = (k, tps)
        return best

    def best_batch_k(self, rows: Sequence[tuple[str | None, float, Sequence[float]]], k_max: int,
                     per_row: bool = True) -> tuple[list[int], float]:
        """k for every row of a batch maximising the batch's expected tokens/s. rows: (drafter or None, context
        length, acceptance probabilities of positions 0..cap-1: the row drafts at most cap tokens).

        A ``"padded"`` pass (``verify_pass``) costs what its longest block costs, so the search is over that length K
        (0..k_max): every row drafts up to K. With ``per_row``, each row then keeps only the tokens that pay for their
        own draft time at the batch's rate (max over k <= K of E_i(k) - rate * draft_i(k)): a row whose drafter is
        slow or unlikely to be accepted drafts less, or nothing. Ties go to the smaller K. A row's draft time is its
        share of its drafter's rows drafting together (``draft_batch``). One row: ``best_k``.

        A ``"total"`` pass costs the tokens it feeds: with ``per_row`` (B > 1) the rows' k are allocated jointly
        (``allocate_batch_k``); without, the one K of the drafting rows is searched, the pass priced by its tokens."""
        B = len(rows)
        if B == 0:
            raise ValueError("best_batch_k needs at least one row")
        total = self.verify_pass == "total" and B > 1
        if total and per_row:
            return self.allocate_batch_k(rows, k_max)
        ctx = sum(c for _, c, _ in rows) / B
        together = Counter(d for d, _, a in rows if d is not None and len(a))
        # per row, k = 0 .. cap: expected tokens and draft seconds (tabulated once: the search reads them O(B K^2) times)
        tokens_of = [self.expected_tokens_table(a) for _, _, a in rows]
        draft_of = [self.draft_table(d, len(a), c, together[d]) for d, c, a in rows]
        verify = self.verify_table(k_max, ctx, B)

        def rate(ks: list[int]) -> float:
            tokens = sum(t[k] for t, k in zip(tokens_of, ks))
            seconds = (self.verify_total_time(B + sum(ks), ctx, B) if total else verify[max(ks)]) + sum(
                s[k] for s, k in zip(draft_of, ks))
            return tokens / seconds

        best = ([0] * B, rate([0] * B))
        for K in range(1, k_max + 1):
            ks = [min(K, len(a)) if d is not None else 0 for d, _, a in rows]
            if max(ks) < K:
                break  # no row can draft K tokens: larger K is the same batch
            tps = rate(ks)
            if per_row and B > 1:
                ks = [max(range(k + 1), key=lambda j, t=t, s=s: t[j] - tps * s[j])
                      for t, s, k in zip(tokens_of, draft_of, ks)]
                tps = rate(ks)
            if tps > best[1]:
                best = (ks, tps)
        return best

    def allocate_batch_k(self, rows: Sequence[tuple[str | None, float, Sequence[float]]],
                         k_max: int) -> tuple[list[int], float]:
        """Draft slots allocated jointly over the rows of a pass priced by the tokens it feeds (``"total"``, vLLM's
        flattened pass): each row's k (0 allowed) and the batch's expected tokens/s, the maximum over every k vector
        with k_i <= min(k_max, cap_i). rows: as ``best_batch_k``'s.

        Slot j of row i (its (j + 1)-th drafted token) adds its survival s_ij = prod_{l<=j} a_il to the batch's
        expected tokens, one token to the pass and its draft seconds; a row's slots are taken in order. The rate is
        sum_i E_i(k_i) / (V(B + sum_i k_i) + sum_i D_i(k_i)), V the flattened pass (``verify_total_time`` at this
        batch size and the rows' mean context), D_i the row's share of its drafter's batched drafting. Were every
        slot's draft seconds alike, the best S slots would be the S of highest survival and the answer the best
        prefix of that ranking; a drafter's per-proposal cost (n-gram, a head's first pass) and drafters of
        different speeds break the ranking, so the search is exact instead (Dinkelbach's method for a ratio): at the
        current rate R, the k vector maximising sum_i [E_i(k_i) - R D_i(k_i)] - R V(B + S) is found by one pass over
        the rows (a max-plus convolution: for every total S, the best split of S slots among the rows), and its rate
        becomes R, until no k vector beats R. Each round strictly raises R over a finite set; a few rounds suffice.
        A row whose slots do not pay gets k = 0 as readily as another gets k_max. Ties go to fewer slots."""
        B = len(rows)
        if B == 0:
            raise ValueError("allocate_batch_k needs at least one row")
        ctx = sum(c for _, c, _ in rows) / B
        caps = [min(k_max, len(a)) if d is not None else 0 for d, _, a in rows]
        together = Counter(d for (d, _, _), cap in zip(rows, caps) if cap > 0)
        tokens_of = [np.array(self.expected_tokens_table(a[:cap])) for (_, _, a), cap in zip(rows, caps)]
        draft_of = [np.array(self.draft_table(d, cap, c, together[d])) for (d, c, _), cap in zip(rows, caps)]
        segment = self._segment(B)
        verify = np.array([self._total_at(segment, B + s, B, ctx) for s in range(sum(caps) + 1)])
        drafting = [i for i, cap in enumerate(caps) if cap > 0]

        def rate(ks: list[int]) -> float:
            tokens = sum(t[k] for t, k in zip(tokens_of, ks))
            return float(tokens / (verify[sum(ks)] + sum(s[k] for s, k in zip(draft_of, ks))))

        ks = [0] * B
        best = rate(ks)
        while drafting:
            # h[S]: the best sum over drafting rows of E_i(k_i) - R D_i(k_i) with S slots in all; arg: each row's k
            h, args = np.zeros(1), []
            for i in drafting:
                g = tokens_of[i] - best * draft_of[i]
                cand = np.full((len(g), len(h) + len(g) - 1), -np.inf)
                for k, gk in enumerate(g):
                    cand[k, k : k + len(h)] = h + gk
                arg = cand.argmax(axis=0)  # the fewest slots among ties
                h = cand[arg, np.arange(cand.shape[1])]
                args.append(arg)
            S = int((h - best * verify).argmax())
            new = [0] * B
            for i, arg in zip(reversed(drafting), reversed(args)):
                new[i] = int(arg[S])
                S -= new[i]
            r = rate(new)
            if not r > best:  # no k vector beats the current rate: it is the maximum
                break
            ks, best = new, r
        return ks, best

    # ------------------------------------------------------------------ token trees
    def tree_step_time(self, drafter: str | None, depth: int, nodes: int, context_len: int, batch: int = 1,
                       width: int = 1) -> float:
        """One row's step drafting a token tree of ``nodes`` nodes and depth ``depth`` (``decoding.tree``), ``width``
        nodes expanded per depth, verified in a pass of ``batch`` rows. The pass feeds nodes + 1 tokens and is priced
        as a chain block of that length (the tree mask changes which fed tokens a token sees, not how many are fed);
        the draft as ``depth`` passes over ``width`` entries each, i.e. ``width`` rows drafting together (their
        batched share where ``draft_batch`` has the drafter, else ``width`` one-row passes: an upper bound, as is
        paying a per-proposal cost once per entry). ``nodes`` = 0: a chain of ``depth`` (``step_time``)."""
        if nodes <= 0:
            return self.step_time(drafter, depth, context_len, batch)
        return width * self.draft_time(drafter, depth, context_len, width) + self.verify_time(nodes, context_len,
                                                                                              batch)

    @staticmethod
    def expected_tree_tokens(node_probs: Sequence[float]) -> float:
        """node_probs[j] = P(tree node j is accepted): the probability that the target's continuation runs along the
        node's path (e.g. the product of the draft's calibrated acceptance along it; EAGLE-2 ranks nodes by the
        draft's own cumulative probability). At most one node per depth is accepted, so the expected accepted length
        is their sum; the step emits one token more (the target's own)."""
        if any(not 0.0 <= a <= 1.0 for a in node_probs):
            raise ValueError(f"node acceptance probabilities must lie in [0, 1], got {list(node_probs)}")
        return 1.0 + float(sum(node_probs))

    def best_tree_budget(self, drafter: str, depth: int, context_len: int, node_probs: Sequence[float],
                         budgets: Sequence[int], batch: int = 1, width: int = 1) -> tuple[int, float]:
        """(budget, expected tokens/s) maximising tokens/s over ``budgets`` (node counts >= 1) for a tree that keeps
        its most likely nodes (``decoding.tree.grow_tree`` keeps the best ``budget``): budget n expects
        ``expected_tree_tokens`` of the n largest ``node_probs`` (the candidates' acceptance probabilities, more
        than the largest budget when the tree may grow that far). Ties go to the smaller budget. A chain's rate is
        ``expected_tokens_per_s``, to compare with."""
        if not budgets or min(budgets) < 1:
            raise ValueError(f"tree budgets must be node counts >= 1, got {list(budgets)}")
        ranked = sorted(node_probs, reverse=True)
        best = (0, -1.0)
        for n in sorted(budgets):
            tps = (self.expected_tree_tokens(ranked[:n])
                   / self.tree_step_time(drafter, depth, min(n, len(ranked)), context_len, batch, width))
            if tps > best[1]:
                best = (n, tps)
        return best

    # ------------------------------------------------------------------ files
    def to_dict(self) -> dict:
        d = {"format": COST_FORMAT, "device": self.device, "verify": _curves_to_dict(self.verify),
             "draft": {name: curve.to_dict() for name, curve in self.draft.items()},
             "per_token_draft": dict(self.per_token_draft), "meta": dict(self.meta)}
        if self.prefill is not None:
            d["prefill"] = self.prefill.to_dict()
        if self.draft_fixed:
            d["draft_fixed"] = {name: curve.to_dict() for name, curve in self.draft_fixed.items()}
        if self.draft_batch:
            d["draft_batch"] = {name: curve.to_dict() for name, curve in self.draft_batch.items()}
        if self.step_base or self.step_draft:
            d["step_base"] = self.step_base
            d["step_draft"] = {name: curve.to_dict() for name, curve in self.step_draft.items()}
        if self.verify_pass != "padded":
            d["verify_pass"] = self.verify_pass
        return {**d, "batch": {str(b): _curves_to_dict(v) for b, v in self.batch.items()}} if self.batch else d

    @classmethod
    def from_dict(cls, d: Mapping, source: str = "cost model") -> CostModel:
        found = d.get("format") if isinstance(d, Mapping) else None
        if found != COST_FORMAT:
            raise ValueError(f"{source} has cost format {found!r} but this sacpolicy reads cost format {COST_FORMAT}. "
                             "Fix: re-profile this device with sacpolicy.profiling.profile() and save it again")
        verify = _curves_from_dict(d["verify"])
        tokens = verify["tokens"]
        drops = [(a, b) for a, b, ya, yb in zip(tokens.xs, tokens.xs[1:], tokens.ys, tokens.ys[1:]) if yb < ya]
        if drops and tokens.lo is None:
            logger.warning("%s: the verify cost falls from %s to %s tokens fed with no interval to show it is beyond "
                           "noise, which lets the simulator favour drafting that gains nothing. Fix: re-profile with "
                           "sacpolicy.profiling.profile (repeats >= 5)", source, *drops[0])
        batch = {int(b): _curves_from_dict(v) for b, v in d.get("batch", {}).items()}
        return cls(device=d["device"], verify=verify,
                   draft={name: PiecewiseLinear(**curve) for name, curve in d["draft"].items()},
                   per_token_draft={name: bool(v) for name, v in d["per_token_draft"].items()},
                   meta=dict(d.get("meta", {})), batch=batch,
                   draft_fixed={name: PiecewiseLinear(**c) for name, c in d.get("draft_fixed", {}).items()},
                   prefill=PiecewiseLinear(**d["prefill"]) if "prefill" in d else None,
                   draft_batch={name: PiecewiseLinear(**c) for name, c in d.get("draft_batch", {}).items()},
                   step_base=float(d.get("step_base", 0.0)),
                   step_draft={name: PiecewiseLinear(**c) for name, c in d.get("step_draft", {}).items()},
                   verify_pass=d.get("verify_pass", "padded"))

    def to_json(self, path) -> None:
        """Write atomically (temp file + rename), so a reader never sees half a file."""
        from sacpolicy.io import write_json

        write_json(path, self.to_dict())

    @classmethod
    def from_json(cls, path) -> CostModel:
        return cls.from_dict(json.loads(Path(path).read_text()), source=str(path))


def _curves_to_dict(curves: dict) -> dict:
    per = curves["per_context"]
    return {"tokens": curves["tokens"].to_dict(), "per_context": per.to_dict() if callable(per) else float(per)}


def _curves_from_dict(d: Mapping) -> dict:
    """A verify curve pair (``CostModel.verify`` or one batch size's) from its JSON form."""
    per = d["per_context"]
    return {"tokens": PiecewiseLinear(**d["tokens"]),
            "per_context": PiecewiseLinear(**per) if isinstance(per, Mapping) else float(per)}
