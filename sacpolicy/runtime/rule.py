"""The learned decision rule, from feature rows to decisions: which drafter (or none), how many tokens, when to stop.
The in-framework ``LearnedPolicy`` and every exported adapter call this one class, so they decide identically.

- *plan* (before a block): for each drafter, predicted acceptance of positions 0..k_max-1 with the confidence still
  unknown; the cost model turns them into expected tokens/s for every k, and the best (drafter, k) wins against
  autoregressive decoding. Mode ``"k"`` drafts that k; mode ``"stop"`` lets the stop rule end the block (in a batch,
  at most at the batch plan's k: the pass costs what its longest block costs).
- *stop* (after each drafted token, SpecDec++-style): with S the probability that every token so far is accepted and
  E the expected tokens of the block if it ended now, drafting one more token (predicted acceptance a) is worth it
  when (E + optimism * S * a) / T(n + 1) > E / T(n), T from the cost model. ``optimism`` scales the predicted gain
  and is tuned on validation traces by the simulator; the threshold itself moves with the cost of each step.
  In a batch the pass is as wide as the plan's longest block whatever one row drafts, so a row's next token costs
  only its own draft time, paid at the batch's planned rate R (tokens/s): it is worth it when
  optimism * S * a > R * (draft(n + 1) - draft(n)), the per-row test ``CostModel.best_batch_k`` plans with, now
  with the drafted token's confidence known. A drafter paying once per proposal (n-gram) never stops early there.
  Where the host's pass costs the tokens it feeds (``CostModel.verify_pass == "total"``: vLLM flattens the batch),
  the plan allocates the rows' k jointly (``CostModel.allocate_batch_k``) and one more token also costs the pass's
  seconds per token fed (``CostModel.token_seconds`` at the plan's tokens), added to the row's draft time.
- Non-finite features (a broken signal upstream) never reach a decision: the rule falls back to the best static
  (drafter, k), chosen on validation traces, and counts it in ``fallbacks``.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from sacpolicy.runtime.cost import CostModel
from sacpolicy.runtime.features import (
    CONFIDENCE,
    FEATURE_NAMES,
    PREV_TOP1,
    feature_spec,
)
from sacpolicy.runtime.online import OnlineCalibration, OnlineSettings
from sacpolicy.runtime.predictors import Predictor

MODES = ("stop", "k")
# |temperature - fitted| (and |top_p - fitted|) beyond which decoding is not what the predictor was fitted for
SAMPLING_TOLERANCE = 0.05
_CONF_KNOWN = FEATURE_NAMES.index("conf_known")


class RuleError(ValueError):
    pass


@dataclass
class Block:
    """What the stop rule tracks while a block is drafted."""

    drafter: str
    context_len: int
    k: int  # the block's cap
    n: int = 0  # tokens drafted so far
    survive: float = 1.0  # P(all n accepted)
    expected: float = 1.0  # expected tokens emitted if the block ended now (accepted + the target's own token)
    batch: int = 1  # rows in the target pass that will verify the block
    rows: int = 1  # rows drafting with this block's drafter together (``CostModel.draft_batch``)
    rate: float | None = None  # a batch's planned expected tokens/s (``plan_batch``); None: the row is alone
    token_s: float = 0.0  # seconds one more drafted token adds to the batch's pass (``CostModel.token_seconds``)
    # position -> (feature row, the fitted predictor's p) of each drafted token the stop rule predicted: what learning
    # while serving labels once the block is verified, with no second predictor call
    predicted: dict = field(default_factory=dict)


def _finite(rows: np.ndarray) -> bool:
    """Every feature is finite, except NaN by design: the confidence of a token not drafted yet (and of its
    predecessor, when that is not drafted yet either)."""
    ok = np.isfinite(rows)
    unknown = (rows[:, _CONF_KNOWN] == 0.0)[:, None]
    ok[:, CONFIDENCE] |= unknown & np.isnan(rows[:, CONFIDENCE])
    ok[:, PREV_TOP1] |= unknown[:, 0] & np.isnan(rows[:, PREV_TOP1])
    return bool(ok.all())


@dataclass
class DecisionRule:
    predictor: Predictor
    cost: CostModel
    drafters: tuple[str, ...]  # the drafters it was trained on; a feature row's drafter_index points in here
    k_max: int
    fallback: tuple[str | None, int]  # best static (drafter, k) on validation traces
    mode: str = "stop"
    optimism: float = 1.0
    fallbacks: int = field(default=0, compare=False)  # decisions that fell back on non-finite features
    # learning while serving (``runtime.online``): the settings travel with the rule; the calibration is one policy's
    # learned state (``LearnedPolicy`` gives each of its instances its own), None: the fitted predictor as it is
    online: OnlineSettings | None = None
    calibration: OnlineCalibration | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        self.drafters = tuple(self.drafters)
        self.online = OnlineSettings.of(self.online)
        self.fallback = (self.fallback[0], int(self.fallback[1]))
        if self.mode not in MODES:
            raise RuleError(f"unknown decision mode {self.mode!r}; modes are {list(MODES)}")
        if self.k_max < 1:
            raise RuleError(f"k_max must be >= 1, got {self.k_max}")
        spec = self.predictor.meta.get("features")
        if spec != feature_spec():
            raise RuleError(
                f"the predictor was trained on feature spec {spec}, but this runtime computes {feature_spec()}; "
                "retrain the predictor (or re-export it) with this sacpolicy version")
        missing = [d for d in self.drafters if d not in self.cost.draft]
        if missing:
            raise RuleError(f"the cost model has no timings for drafters {missing}; profile them with "
                            "sacpolicy.profiling.profile")
        if self.fallback[0] is not None and self.fallback[0] not in self.drafters:
            raise RuleError(f"fallback drafter {self.fallback[0]!r} is not among {list(self.drafters)}")

    def sampling_mismatch(self, temperature: float, top_p: float = 1.0) -> str | None:
        """Why decoding at ``temperature`` / ``top_p`` is not what the predictor was fitted for, or None. Acceptance
        depends on them (a sampled draft is accepted with probability beta, a greedy one when it matches), and so do
        the predictor's labels and the rule's tuning; the pipeline's fit records them in the predictor's meta
        (``fitted_temperature``, ``fitted_top_p``). None also when the meta does not record them (older artifacts)."""
        fitted = self.predictor.meta.get("fitted_temperature")
        if fitted is None:
            return None
        fitted_p = float(self.predictor.meta.get("fitted_top_p", 1.0))
        if (fitted > 0.0) == (temperature > 0.0) and (fitted == 0.0 or (
                abs(temperature - fitted) <= SAMPLING_TOLERANCE and abs(top_p - fitted_p) <= SAMPLING_TOLERANCE)):
            return None

        def words(t, p):
            return "greedy" if t == 0.0 else f"temperature {t:g}, top_p {p:g}"

        return (f"the policy was fitted on traces decoded {words(fitted, fitted_p)}, but decodes "
                f"{words(temperature, top_p)}: its acceptance predictions and tuned rule are for the former. Fit it "
                "on traces collected with the sampling settings it will decode with (sampling.temperature=, "
                "sampling.top_p=; e.g. experiment=sampled_t07)")

    def check_drafter(self, name: str) -> None:
        if name not in self.drafters:
            raise RuleError(f"the policy was trained on drafters {list(self.drafters)}, not {name!r}; collect traces "
                            "with this drafter and refit, or remove it from the decoder")

    def predict(self, X: np.ndarray) -> np.ndarray:
        """Acceptance probabilities of feature rows ``X``: the fitted predictor's, through the online calibration
        when the rule learns while serving."""
        return self.predictions(X)[1]

    def predictions(self, X: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(the fitted predictor's probabilities of rows ``X``, the ones the rule decides with: ``predict``); the
        first is what learning while serving labels."""
        p = self.predictor.predict(X)
        return p, (p if self.calibration is None else self.calibration.adjust(np.asarray(X, dtype=np.float64), p))

    # ------------------------------------------------------------------ plan
    def plan(self, rows: dict[str, np.ndarray], context_len: int, k_cap: int | None = None) -> tuple[str | None, int]:
        """rows: {drafter: [n, F] feature rows of positions 0..n-1 before drafting (``runtime.features.plan_rows``;
        n = k_cap, or fewer when the drafter's peeked proposal is shorter)} -> (drafter, k). (None, 0) = decode one
        token autoregressively."""
        return self.plan_batch([rows], [context_len], [k_cap])[0][0]

    def plan_batch(self, rows: list[dict[str, np.ndarray]], context_lens: list[int], k_caps: list[int | None],
                   per_row: bool = True, batch: int | None = None,
                   fitted: list | None = None) -> tuple[list[tuple[str | None, int]], float]:
        """``plan`` for the rows of a batch verified in one target pass: each row's drafter is the one with the best
        expected tokens/s for that row at this batch size (at its best k >= 1); then k, 0 included, maximises the
        whole batch's expected tokens/s (``CostModel.best_batch_k``; ``per_row``: rows may draft less than the
        longest block; where the pass costs the tokens it feeds, the rows' k allocated jointly). One predictor call
        for the whole batch. -> (each row's (drafter, k), the batch's expected
        tokens/s at those k: the rate a row's stop rule weighs its draft time against). ``batch``: the rows in the
        target pass when more than these (rows the decoder keeps autoregressive, cooling down): they emit one token
        each and pay the pass's width, at the planned rows' mean context. ``fitted``: a list this call fills with
        each row's {drafter: the fitted predictor's probabilities of its rows} ({} for a row planned without a
        prediction), which learning while serving labels once the row's block is verified."""
        B = max(len(rows), batch or 0)
        others = B - len(rows)
        caps = [min(self.k_max, c or self.k_max) for c in k_caps]
        blocks, out = [], [(None, 0)] * len(rows)
        for i, (r, cap) in enumerate(zip(rows, caps)):
            r = {n: x[:cap] for n, x in r.items() if len(x)}
            if cap < 1 or not r:
                continue
            # a drafter with fewer rows than the cap proposes no further (a short peeked proposal): acceptance 0 beyond
            lens = [len(x) for x in r.values()]
            X = np.concatenate(list(r.values()))
            if not _finite(X):
                self.fallbacks += 1
                name, k = self.fallback
                out[i] = (name, min(k, cap, len(r[name]))) if name in r else (None, 0)
                continue
            blocks.append((i, list(r), cap, lens, X))
        if fitted is not None:
            fitted[:] = [{} for _ in rows]
        if not blocks:
            return out, 0.0
        raw, probs = self.predictions(np.concatenate([X for *_, X in blocks]))
        tables, at = [], 0
        for i, names, cap, lens, X in blocks:
            p = np.zeros((len(names), cap))
            for row, name, n in zip(p, names, lens):
                row[:n] = probs[at : at + n]
                if fitted is not None:
                    fitted[i][name] = raw[at : at + n]
                at += n
            tables.append((i, names, p, self.cost.verify_table(cap, context_lens[i], B)))  # same pass for any drafter

        def score(i: int, name: str, a, verify, rows: int) -> float:  # the row's tokens/s at its best k >= 1
            return max(self.cost.tokens_per_s_table(name, context_lens[i], a, B, verify=verify, rows=rows))

        def pick() -> dict:  # each row's drafter: the best at its best k >= 1 (AR is weighed for the batch)
            return {i: max(names, key=lambda n, i=i: scores[i][n]) for i, names, _, _ in tables}

        # rows drafting with one model drafter share its batched drafting (``CostModel.draft_batch``): score as if
        # every planned row drafted with it, then rescore those drafters with the rows that chose them (and this row)
        scores = {i: {n: score(i, n, a, verify, len(tables)) for n, a in zip(names, p)}
                  for i, names, p, verify in tables}
        chosen = pick()
        if self.cost.draft_batch and len(tables) > 1:
            counts = Counter(chosen.values())
            for i, names, p, verify in tables:
                for n, a in zip(names, p):
                    if n in self.cost.draft_batch:
                        scores[i][n] = score(i, n, a, verify, counts[n] + (chosen[i] != n))
            chosen = pick()
        chosen = {i: (chosen[i], p[names.index(chosen[i])].tolist()) for i, names, p, _ in tables}
        # a row on the fallback keeps its k; it counts in the pass, with no acceptance assumed
        batch_rows = [(chosen[i][0], context_lens[i], chosen[i][1]) if i in chosen
                      else (out[i][0], context_lens[i], [0.0] * out[i][1]) for i in range(len(rows))]
        batch_rows += [(None, sum(context_lens) / len(context_lens), [])] * others
        ks, rate = self.cost.best_batch_k(batch_rows, max(caps), per_row=per_row)
        for i, (name, _) in chosen.items():
            # mode "stop": the stop rule ends the block, alone up to the cap; in a batch up to the plan's k (the
            # pass is as wide as the longest planned block), weighing each row's draft time at the batch's rate
            if name is not None and ks[i] > 0:
                out[i] = (name, caps[i] if self.mode == "stop" and B == 1 else ks[i])
        return out, rate

    # ------------------------------------------------------------------ stop
    def stop(self, block: Block, row: np.ndarray, next_row: np.ndarray) -> bool:
        """After drafting a token (``row``, confidence known): True ends the block. ``next_row``: the next position,
        confidence unknown (its previous-token confidence is this token's)."""
        block.n += 1
        if block.n >= block.k:
            return True
        batch = block.batch > 1 and block.rate is not None
        extra = 0.0
        if batch:  # a row of a batch pays only its own draft time for one more token
            extra = (self.cost.draft_time(block.drafter, block.n + 1, block.context_len, block.rows)
                     - self.cost.draft_time(block.drafter, block.n, block.context_len, block.rows)) + block.token_s
            if extra <= 0.0:  # a proposal paid once in a padded pass: more of it costs nothing, no prediction needed
                return False
        X = np.stack([row, next_row])
        if not _finite(X):
            self.fallbacks += 1
            return block.n >= self.fallback[1]
        raw, p = self.predictions(X)
        block.predicted[block.n - 1] = (X[0], float(raw[0]))
        a, a_next = p.tolist()
        block.survive *= a
        block.expected += block.survive
        if batch:
            return not self.optimism * block.survive * a_next > block.rate * extra
        now = block.expected / self.cost.step_time(block.drafter, block.n, block.context_len, block.batch)
        more = (block.expected + self.optimism * block.survive * a_next) / self.cost.step_time(
            block.drafter, block.n + 1, block.context_len, block.batch)
        return not more > now

    # ------------------------------------------------------------------ files
    def config(self) -> dict:
        """Everything but the predictor's arrays and the cost model, as JSON-ready data."""
        return {"drafters": list(self.drafters), "k_max": self.k_max, "mode": self.mode,
                "optimism": self.optimism,
                "fallback": {"drafter": self.fallback[0], "k": self.fallback[1]}} | (
            {"online": self.online.to_dict()} if self.online is not None else {})
