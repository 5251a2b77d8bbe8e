"""The serving engines' adaptive speculation controllers as policies ("peers"): what users of each engine run, replayed
on the same traces as the learned policy (``traces.simulate``) and decodable live (``SpeculativeDecoder``). Each class
reproduces one engine's rule in our own code, from the source or documentation its docstring cites (no third-party
code is copied):

- ``SglangAdaptive``: SGLang ``--speculative-adaptive`` (an EMA of accepted drafts moves the draft steps between tiers,
  per batch-size slot);
- ``TrtllmAdaptive``: TensorRT-LLM ``draft_len_schedule`` / ``max_concurrency`` (k by batch size) and
  ``acceptance_rate_threshold`` / ``acceptance_rate_window_size`` (speculation off for good below a rolling rate);
- ``VllmBatchSchedule``: vLLM ``num_speculative_tokens_per_batch_size`` (k by batch-size range);
- ``VllmAdaptiveVerification``: vLLM Model Runner V2's adaptive verification (an online logistic estimator of each
  draft position's acceptance and a cost budget over the batch's draft slots);
- ``LlamaCppPMin``: llama.cpp ``--draft-p-min`` with ``--draft-max`` / ``--draft-min``;
- ``AdaEDL``: entropy-based early draft stopping (Agrawal et al., 2024).

Where state lives: what an engine keeps for the server's lifetime (SGLang's slots, TensorRT-LLM's gate, vLLM's
estimator) lives on the policy; what belongs to one request lives in the memory ``start`` returns. An engine updates
once per engine step from all its rows, while the decoder calls ``observe`` once per row: these peers collect a step's
records and fold them in when the next step is decided (``_EngineStep``), the same order live and replayed.

What the decoder cannot reproduce: it verifies every drafted token, so a rule that trims drafts after drafting them
(vLLM's adaptive verification, llama.cpp's ``--draft-min``) is approximated (each class says how); and a stop rule
keeps the token whose confidence ends the block (the decoder asks after drafting it, as llama.cpp's loop does).

Tuning each peer's documented knobs on validation traces: ``sacpolicy.traces.peer_tuning`` (the simulator is a layer
above the policies).
"""

from __future__ import annotations

import bisect
import logging
import math
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from itertools import pairwise

from sacpolicy.decoding.controller import room
from sacpolicy.policy.base import Decision, DraftToken, PolicyRow, RequestInfo, StepRecord, check_k
from sacpolicy.policy.baselines import Static, _OneDrafter
from sacpolicy.runtime.cost import CostModel

__all__ = ["SGLANG_DEFAULT_CONFIG", "AcceptanceEstimator", "AdaEDL", "LlamaCppPMin", "SglangAdaptive", "SglangSlot",
           "TrtllmAdaptive", "VllmAdaptiveVerification", "VllmBatchSchedule", "trtllm_draft_len", "vllm_k_for_batch",
           "vllm_schedule"]

logger = logging.getLogger(__name__)


class _EngineStep:
    """Engines fold one step's outcome into what they learn once, from all its rows; the decoder hands ``observe`` one
    row at a time. The records observed between two ``decide`` calls are one engine step's: ``_settle``, called first
    thing in ``decide``, hands them to ``_step`` before the next step is decided. Steps the decoder's cooldown forced
    to be autoregressive are the decoder's, not the engine's, and are left out."""

    _pending: list

    def _collect(self, record: StepRecord) -> None:
        if not record.cooldown:
            self._pending.append(record)

    def _settle(self) -> None:
        if self._pending:
            records, self._pending = self._pending, []
            self._step(records)

    def _step(self, records: list[StepRecord]) -> None:
        raise NotImplementedError


def _number(value, who: str, what: str, lo: float, hi: float, fix: str) -> float:
    """``value`` as a float within [lo, hi], or an error naming the setting and the fix."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not lo <= value <= hi:
        raise ValueError(f"{who}: {what} must be a number in [{lo:g}, {hi:g}], got {value!r}; {fix}")
    return float(value)


def _count(value, who: str, what: str, lo: int, fix: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise ValueError(f"{who}: {what} must be an integer >= {lo}, got {value!r}; {fix}")
    return value


# ---------------------------------------------------------------------- SGLang
# sglang 0.5.23, sglang/srt/speculative/adaptive_spec_params.py (DEFAULT_ADAPTIVE_CONFIG): the code's default, which
# the docs page (docs/advanced_features/adaptive_speculative_decoding.md) abbreviates as tiers [1, 3, 7]
SGLANG_DEFAULT_CONFIG: dict = {
    "1": {"candidate_steps": [1, 3, 5, 7], "up_hysteresis": 0.0, "down_hysteresis": -0.25, "ceiling_coeff": 0},
    "8": {"candidate_steps": [0, 1, 3], "up_hysteresis": 0.0, "down_hysteresis": 0.0, "ceiling_coeff": 0},
    "32": {"candidate_steps": [0, 1], "up_hysteresis": 0.0, "down_hysteresis": 0.0, "ceiling_coeff": 0},
    "64": {"candidate_steps": [0], "up_hysteresis": 0.0, "down_hysteresis": 0.0, "ceiling_coeff": 0},
}
# what a slot reads when neither its entry nor the config's top level sets it (AdaptiveStepSlot's defaults)
_SGLANG_SLOT_DEFAULTS = {"ema_alpha": 0.2, "update_interval": 5, "warmup_batches": 10, "down_hysteresis": -0.25,
                         "up_hysteresis": 0.0, "ceiling_coeff": 0.0}


@dataclass
class SglangSlot:
    """One batch-size slot of SGLang's adaptive speculation (``AdaptiveStepSlot`` in sglang 0.5.23's
    ``sglang/srt/speculative/adaptive_spec_params.py``). After every verify the EMA of the batch's mean accepted drafts
    moves by ``ema_alpha`` (not while the slot drafts nothing); after ``warmup_batches`` batches, every
    ``update_interval``-th batch recomputes the steps: down a tier while the EMA is at most the lower tier's steps
    - 0.5 (0.5 for a tier of 0) plus ``down_hysteresis``, else up a tier while it is above the current steps - 0.5 plus
    ``up_hysteresis``; a slot at 0 steps probes the next tier. ``ceiling_coeff`` > 0 caps a non-rising move at
    ceil(EMA * ceiling_coeff) steps."""

    candidates: tuple[int, ...]
    steps: int
    ema: float
    ema_alpha: float = 0.2
    update_interval: int = 5
    warmup_batches: int = 10
    down_hysteresis: float = -0.25
    up_hysteresis: float = 0.0
    ceiling_coeff: float = 0.0
    batches: int = 0

    @classmethod
    def of(cls, entry: Mapping, initial_steps: int, where: str) -> SglangSlot:
        """The slot an adaptive-config entry describes (``entry``: its keys over the config's shared ones), starting at
        ``initial_steps`` when that is one of its tiers, else at its middle tier, with the EMA at steps - 1."""
        who = f"SglangAdaptive ({where})"
        unknown = sorted(set(entry) - {"candidate_steps", *_SGLANG_SLOT_DEFAULTS})
        if unknown:
            raise ValueError(f"{who}: unknown setting(s) {unknown}; known: candidate_steps, "
                             f"{sorted(_SGLANG_SLOT_DEFAULTS)}")
        steps = entry.get("candidate_steps")
        if (not isinstance(steps, (list, tuple)) or not steps
                or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in steps)):
            raise ValueError(f"{who}: candidate_steps must be a non-empty list of integers >= 0 (draft steps per tier, "
                             f"0 = no speculation), got {steps!r}; e.g. [1, 3, 7]")
        s = {**_SGLANG_SLOT_DEFAULTS, **{k: v for k, v in entry.items() if k != "candidate_steps"}}
        tiers = tuple(sorted(set(steps)))
        start = initial_steps if initial_steps in tiers else tiers[len(tiers) // 2]
        return cls(tiers, start, float(start - 1),
                   ema_alpha=_number(s["ema_alpha"], who, "ema_alpha", 1e-9, 1.0, "the weight of the newest batch"),
                   update_interval=_count(s["update_interval"], who, "update_interval", 1, "batches between moves"),
                   warmup_batches=_count(s["warmup_batches"], who, "warmup_batches", 0, "batches before any move"),
                   down_hysteresis=_number(s["down_hysteresis"], who, "down_hysteresis", -100, 100, "e.g. -0.25"),
                   up_hysteresis=_number(s["up_hysteresis"], who, "up_hysteresis", -100, 100, "e.g. 0.0"),
                   ceiling_coeff=_number(s["ceiling_coeff"], who, "ceiling_coeff", 0, 100, "0 turns the cap off"))

    def update(self, accepted: Sequence[int]) -> bool:
        """Fold one verify's accepted drafts per request; True when the steps changed."""
        if not accepted:
            return False
        if self.steps > 0:
            self.ema += self.ema_alpha * (sum(accepted) / len(accepted) - self.ema)
        self.batches += 1
        if self.batches <= self.warmup_batches or (self.batches - self.warmup_batches) % self.update_interval:
            return False
        old, self.steps = self.steps, self._target()
        if self.steps != old:
            logger.info("sglang adaptive: steps %d -> %d (EMA of accepted drafts %.2f)", old, self.steps, self.ema)
        return self.steps != old

    def _target(self) -> int:
        tiers, i = self.candidates, self.candidates.index(self.steps)
        if self.steps == 0:  # no speculation: probe the next tier, from that tier's neutral EMA if none was kept
            up = tiers[min(i + 1, len(tiers) - 1)]
            if up > 0 and self.ema < 0:
                self.ema = float(up - 1)
            return up
        j = i
        while j > 0 and self.ema <= (0.5 if tiers[j - 1] == 0 else tiers[j - 1] - 0.5) + self.down_hysteresis:
            j -= 1
        if j == i:
            while j < len(tiers) - 1 and self.ema > tiers[j] - 0.5 + self.up_hysteresis:
                j += 1
        if self.ceiling_coeff > 0 and tiers[j] <= self.steps:
            ceiling = max(1, math.ceil(self.ema * self.ceiling_coeff))
            while j > 0 and tiers[j] > ceiling:
                j -= 1
        return tiers[j]


class SglangAdaptive(_EngineStep, _OneDrafter):
    """SGLang's ``--speculative-adaptive`` (sglang 0.5.23: ``AdaptiveSpeculativeParams`` in
    ``sglang/srt/speculative/adaptive_spec_params.py``; docs/advanced_features/adaptive_speculative_decoding.md): every
    row of a step drafts the steps of the slot its batch size routes to (the largest slot key at or below it, the
    smallest for a batch below every key), and each verify feeds that slot (``SglangSlot``). ``config``: the JSON of
    ``--speculative-adaptive-config`` as is (batch-size keys, shared settings at the top level; None: SGLang's default,
    ``SGLANG_DEFAULT_CONFIG``); ``initial_steps``: ``--speculative-num-steps`` (SGLang's default with adaptive on: the
    middle of every tier's union, 3). Slots live on the policy, as the server keeps them; SGLang first pads the batch
    size to a CUDA-graph size, which the decoder has none of."""

    def __init__(self, config: Mapping | None = None, initial_steps: int = 3, drafter: str | None = None):
        super().__init__(drafter)
        config = SGLANG_DEFAULT_CONFIG if config is None else config
        if not isinstance(config, Mapping):
            raise TypeError(f"SglangAdaptive: config must be a mapping like SGLang's adaptive config JSON, got "
                            f"{type(config).__name__}; e.g. {{'1': {{'candidate_steps': [1, 3, 7]}}}}")
        shared = {k: v for k, v in config.items() if not str(k).isdigit()}
        entries = {int(k): v for k, v in config.items() if str(k).isdigit()}
        if not entries or min(entries) < 1 or not all(isinstance(v, Mapping) for v in entries.values()):
            raise ValueError(f"SglangAdaptive: config needs batch-size keys >= 1, each with its slot's settings, got "
                             f"{dict(config)!r}; e.g. {{'1': {{'candidate_steps': [1, 3, 7]}}}}")
        self.initial_steps = _count(initial_steps, "SglangAdaptive", "initial_steps", 0, "e.g. 3")
        self.slots = {b: SglangSlot.of({**shared, **entries[b]}, initial_steps, f"batch {b}") for b in sorted(entries)}
        tiers = sorted({s for slot in self.slots.values() for s in slot.candidates})
        if initial_steps not in tiers:  # SGLang refuses it at start-up too
            raise ValueError(f"SglangAdaptive: initial_steps={initial_steps} (--speculative-num-steps) is not among the "
                             f"config's candidate steps {tiers}; pass one of them")
        self._keys, self._pending = sorted(entries), []
        self.name = "sglang-adaptive"

    def validate(self, drafters, k_max):
        super().validate(drafters, k_max)
        for b, slot in self.slots.items():
            check_k(max(slot.candidates), k_max, f"{self!r} slot {b} (candidate_steps)")

    def slot(self, batch_size: int) -> SglangSlot:
        return self.slots[self._keys[max(0, bisect.bisect_right(self._keys, batch_size) - 1)]]

    def decide(self, rows: list[PolicyRow]) -> list[Decision]:
        self._settle()
        steps = self.slot(rows[0].state.batch_size).steps
        return [self._pick(row.state, steps) for row in rows]

    def observe(self, row: PolicyRow, record: StepRecord) -> None:
        self._collect(record)

    def _step(self, records: list[StepRecord]) -> None:
        self.slot(records[0].batch_size).update([r.accepted for r in records])


# ---------------------------------------------------------------------- TensorRT-LLM
def trtllm_draft_len(schedule: Mapping[int, int], batch_size: int) -> int:
    """TensorRT-LLM's ``draft_len_schedule`` lookup: the draft length of the largest batch-size threshold at or below
    ``batch_size`` ({1: 4, 4: 2, 8: 0}: 4 below 4 rows, 2 from 4, none from 8)."""
    keys = sorted(schedule)
    return schedule[keys[max(0, bisect.bisect_right(keys, batch_size) - 1)]]


class _AcceptanceGate:
    """TensorRT-LLM's speculation gate: the rolling mean of the last ``window`` acceptance rates; once ``window`` rates
    were seen and that mean is below ``threshold``, speculation is off for good."""

    def __init__(self, window: int, threshold: float):
        self.rates, self.threshold, self.seen, self.off = deque(maxlen=window), threshold, 0, False

    def record(self, rate: float) -> None:
        if self.off:
            return
        self.rates.append(rate)
        self.seen += 1
        mean = sum(self.rates) / len(self.rates)
        if self.seen >= self.rates.maxlen and mean < self.threshold:
            self.off = True
            logger.info("trtllm gate: acceptance rate %.3f < %.3f over the last %d steps: speculation off for good",
                        mean, self.threshold, self.rates.maxlen)


class TrtllmAdaptive(_EngineStep, _OneDrafter):
    """TensorRT-LLM's run-time speculation controls (``DecodingBaseConfig`` in ``tensorrt_llm/llmapi/llm_args.py``;
    LLM API reference, e.g. nvidia.github.io/TensorRT-LLM/1.3.0rc29/llm-api/reference/AutoDecodingConfig.html):

    - ``draft_len_schedule`` {batch-size threshold: draft length}: the draft length of the largest threshold at or
      below the live batch size (``trtllm_draft_len``); it must map 1 to ``max_draft_len``. None: always
      ``max_draft_len``. ``max_concurrency``: no speculation above that many rows.
    - ``acceptance_rate_threshold`` / ``acceptance_rate_window_size``: speculation is disabled permanently once the
      rolling average of the true acceptance rate (accepted / drafted draft tokens) over the last N
      speculation-enabled iterations falls below the threshold (PyExecutor's ``SpeculationGate``; an iteration's rate
      is the batch's accepted over drafted tokens). Both None: no gate.

    ``scope``: "engine" (TensorRT-LLM's: one gate for the policy's lifetime, a server's) or "request" (a gate per
    request over its own steps, which a new request starts afresh)."""

    def __init__(self, max_draft_len: int = 4, draft_len_schedule: Mapping[int, int] | None = None,
                 acceptance_rate_window_size: int | None = None, acceptance_rate_threshold: float | None = None,
                 max_concurrency: int | None = None, scope: str = "engine", drafter: str | None = None):
        super().__init__(drafter)
        who = "TrtllmAdaptive"
        self.max_draft_len = _count(max_draft_len, who, "max_draft_len", 1, "0 drafts nothing: use the autoregressive "
                                                                             "policy instead")
        self.schedule = None if draft_len_schedule is None else self._schedule(draft_len_schedule)
        if (acceptance_rate_window_size is None) != (acceptance_rate_threshold is None):
            raise ValueError(f"{who}: set acceptance_rate_window_size and acceptance_rate_threshold together (the gate "
                             f"needs both), got {acceptance_rate_window_size!r} and {acceptance_rate_threshold!r}")
        self.window = None if acceptance_rate_window_size is None else _count(
            acceptance_rate_window_size, who, "acceptance_rate_window_size", 1,
            "it counts speculative iterations; pass None (TensorRT-LLM: 0) to turn the gate off")
        self.threshold = None if acceptance_rate_threshold is None else _number(
            acceptance_rate_threshold, who, "acceptance_rate_threshold", 0.0, 1.0,
            "it is a rate, accepted / drafted tokens")
        self.max_concurrency = None if max_concurrency is None else _count(
            max_concurrency, who, "max_concurrency", 1, "pass None to speculate at every batch size")
        if scope not in ("engine", "request"):
            raise ValueError(f"{who}: scope must be 'engine' (one gate, TensorRT-LLM's) or 'request' (a gate per "
                             f"request), got {scope!r}")
        self.scope = scope
        self.gate = self._gate() if scope == "engine" else None
        self._pending = []
        self.name = "trtllm-adaptive"

    def _schedule(self, schedule: Mapping) -> dict[int, int]:
        who = "TrtllmAdaptive: draft_len_schedule"
        if not isinstance(schedule, Mapping) or not schedule:
            raise ValueError(f"{who} must be a non-empty mapping {{batch-size threshold: draft length}}, got "
                             f"{schedule!r}; e.g. {{1: {self.max_draft_len}, 4: 2, 8: 0}}")
        out = {}
        for key, k in schedule.items():
            b = int(key) if str(key).isdigit() else None
            if b is None or b < 1 or isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= self.max_draft_len:
                raise ValueError(f"{who}: each entry maps a batch size >= 1 to a draft length in [0, max_draft_len="
                                 f"{self.max_draft_len}], got {key!r}: {k!r}")
            out[b] = k
        if out.get(1) != self.max_draft_len:
            raise ValueError(f"{who} must map batch size 1 to max_draft_len={self.max_draft_len} (TensorRT-LLM "
                             f"enforces it), got {schedule!r}; add 1: {self.max_draft_len}")
        return out

    def _gate(self) -> _AcceptanceGate | None:
        return None if self.window is None else _AcceptanceGate(self.window, self.threshold)

    def validate(self, drafters, k_max):
        super().validate(drafters, k_max)
        check_k(self.max_draft_len, k_max, f"{self!r} (max_draft_len)")

    def start(self, request: RequestInfo) -> _AcceptanceGate | None:
        return self._gate() if self.scope == "request" else None

    def draft_len(self, batch_size: int) -> int:
        """The draft length at ``batch_size`` rows, before the gate."""
        if self.max_concurrency is not None and batch_size > self.max_concurrency:
            return 0
        return self.max_draft_len if self.schedule is None else trtllm_draft_len(self.schedule, batch_size)

    def decide(self, rows: list[PolicyRow]) -> list[Decision]:
        self._settle()
        out = []
        for row in rows:
            gate = self.gate if self.scope == "engine" else row.memory
            off = gate is not None and gate.off
            k = 0 if off else self.draft_len(row.state.batch_size)
            out.append(self._pick(row.state, k))
        return out

    def observe(self, row: PolicyRow, record: StepRecord) -> None:
        if self.scope == "engine":
            self._collect(record)
        elif row.memory is not None and record.drafted and not record.cooldown:
            row.memory.record(record.accepted / record.drafted)

    def _step(self, records: list[StepRecord]) -> None:
        drafting = [r for r in records if r.drafter is not None and r.drafted]
        if self.gate is not None and drafting:
            self.gate.record(sum(r.accepted for r in drafting) / sum(r.drafted for r in drafting))


# ---------------------------------------------------------------------- vLLM: k by batch size
def vllm_schedule(entries) -> list[tuple[int, int, int]]:
    """``num_speculative_tokens_per_batch_size`` checked and sorted as vLLM does (``validate_and_normalize_dynamic_sd_
    schedule`` in vllm 0.32's ``vllm/v1/spec_decode/dynamic/utils.py``): (range start, range end, k) entries, inclusive
    batch-size ranges, positive, non-overlapping once sorted by start, the first starting at 1, k >= 0."""
    who = "VllmBatchSchedule: num_speculative_tokens_per_batch_size"
    if not isinstance(entries, (list, tuple)) or not entries:
        raise ValueError(f"{who} must be a non-empty list of [range_start, range_end, k] entries, got {entries!r}; "
                         "e.g. [[1, 16, 3], [17, 256, 1]]")
    out = []
    for e in entries:
        if (not isinstance(e, (list, tuple)) or len(e) != 3
                or not all(isinstance(v, int) and not isinstance(v, bool) for v in e)):
            raise ValueError(f"{who}: each entry is [range_start, range_end, k] (three integers), got {e!r}")
        start, end, k = e
        if start < 1 or end < start:
            raise ValueError(f"{who}: the batch-size range [{start}, {end}] must satisfy 1 <= start <= end")
        if k < 0:
            raise ValueError(f"{who}: k must be >= 0 (0: no speculation at those batch sizes), got {k} in {e!r}")
        out.append((start, end, k))
    out.sort()
    for (_, prev_end, _), (start, end, _) in pairwise(out):
        if start <= prev_end:
            raise ValueError(f"{who}: batch-size ranges overlap ([.., {prev_end}] and [{start}, {end}]); make them "
                             "disjoint")
    if out[0][0] != 1:
        raise ValueError(f"{who}: the first range must start at batch size 1 (vLLM needs a k for every batch size), "
                         f"got {out[0][0]}")
    return out


def vllm_k_for_batch(schedule: Sequence[tuple[int, int, int]], batch_size: int, num_speculative_tokens: int) -> int:
    """k at ``batch_size`` rows, vLLM's dense lookup (``build_dynamic_sd_schedule_lookup``, same file as
    ``vllm_schedule``; the scheduler indexes it by the step's scheduled requests): the k of the range holding the batch
    size; in a gap between ranges or past the last one, the k of the range before; never above
    ``num_speculative_tokens``. ``schedule``: ``vllm_schedule``'s."""
    k = None
    for start, end, range_k in schedule:
        if batch_size < start:
            break
        k = range_k
        if batch_size <= end:
            break
    return min(num_speculative_tokens, schedule[0][2] if k is None else k)


class VllmBatchSchedule(_OneDrafter):
    """vLLM's dynamic speculative decoding by batch size (``SpeculativeConfig.num_speculative_tokens_per_batch_size``,
    vllm 0.32 ``vllm/config/speculative.py``; lookup in ``vllm/v1/spec_decode/dynamic/utils.py``): each step drafts the
    k the schedule gives the live batch size (``vllm_k_for_batch``). ``num_speculative_tokens``: vLLM's cap on every k
    (None: the schedule's largest k)."""

    def __init__(self, num_speculative_tokens_per_batch_size, num_speculative_tokens: int | None = None,
                 drafter: str | None = None):
        super().__init__(drafter)
        self.schedule = vllm_schedule(num_speculative_tokens_per_batch_size)
        top = max(k for _, _, k in self.schedule)
        self.num_speculative_tokens = _count(top if num_speculative_tokens is None else num_speculative_tokens,
                                             "VllmBatchSchedule", "num_speculative_tokens", 1,
                                             "it caps every k of the schedule; 0 turns speculation off")
        self.name = "vllm-batch-schedule"

    def validate(self, drafters, k_max):
        super().validate(drafters, k_max)
        check_k(min(self.num_speculative_tokens, max(k for _, _, k in self.schedule)), k_max,
                f"{self!r} (num_speculative_tokens)")

    def decide(self, rows: list[PolicyRow]) -> list[Decision]:
        return [self._pick(row.state, vllm_k_for_batch(self.schedule, row.state.batch_size,
                                                        self.num_speculative_tokens)) for row in rows]


# ---------------------------------------------------------------------- vLLM: adaptive verification
def _sigmoid(x: float) -> float:
    if x >= 0:
        return 1.0 / (1.0 + math.exp(-x))
    e = math.exp(x)
    return e / (1.0 + e)


class AcceptanceEstimator:
    """vLLM Model Runner V2's online acceptance estimator (``OnlineAcceptanceEstimator`` in vllm 0.33.0's
    ``vllm/v1/worker/gpu/spec_decode/acceptance_estimator.py``), in plain floats: a drafted token at position k is
    accepted with probability p = sigmoid(slope * f + intercept[k]), f = logit(max q) = log(q1 / (1 - q1)) of the
    draft's top-1 probability, clamped to +-40; slope 0.5 and intercepts -0.2 at cold start. A position is observed
    while the chain reached it and it was verified (the accepted ones and the first rejected), labelled accepted or
    not; its IRLS statistics (weight p (1 - p) with the prediction made at draft time) accumulate, and every
    ``refit_interval`` engine steps (vLLM: 100) one ridge-regularised (1e-3) Newton step solves the arrowhead system of
    the shared slope and the per-position intercepts, each step damped by n / (n + 50) for its n observations of the
    round; a step that would make the slope negative or is not finite is dropped; the round's statistics are cleared.

    Ours, for bounded state: the top-1 probability is clipped to [1e-6, 1 - 1e-6] before the logit, a prediction to the
    same range, the slope to [0, 40] and the intercepts to [-40, 40]."""

    MAX_LOG_ODDS, INIT_SLOPE, INIT_BIAS, DAMPING, L2, EPS, BOUND = 40.0, 0.5, -0.2, 50.0, 1e-3, 1e-6, 40.0

    def __init__(self, positions: int, refit_interval: int = 100):
        self.positions = _count(positions, "AcceptanceEstimator", "positions", 1, "one per draft position")
        self.refit_interval = _count(refit_interval, "AcceptanceEstimator", "refit_interval", 1,
                                     "engine steps between refits (vLLM: 100)")
        self.slope, self.intercepts = self.INIT_SLOPE, [self.INIT_BIAS] * positions
        self._clear()
        self.steps = self.refits = 0

    def _clear(self) -> None:
        # per position: sum w f^2, sum w f, sum w, sum r f, sum r, count (w = p (1 - p), r = label - p)
        self.stats = [[0.0] * 6 for _ in range(self.positions)]

    def feature(self, top1: float) -> float:
        if not math.isfinite(top1):
            return 0.0
        q = min(max(top1, self.EPS), 1.0 - self.EPS)
        return min(max(math.log(q / (1.0 - q)), -self.MAX_LOG_ODDS), self.MAX_LOG_ODDS)

    def predict(self, feature: float, position: int) -> float:
        b = self.intercepts[min(position, self.positions - 1)]
        return min(max(_sigmoid(self.slope * feature + b), self.EPS), 1.0 - self.EPS)

    def observe(self, position: int, feature: float, prediction: float, accepted: bool) -> None:
        if position >= self.positions:
            return
        w, r = prediction * (1.0 - prediction), float(accepted) - prediction
        for i, v in enumerate((w * feature * feature, w * feature, w, r * feature, r, 1.0)):
            self.stats[position][i] += v

    def end_step(self) -> bool:
        """One engine step ended; True when it refit."""
        self.steps += 1
        if self.steps % self.refit_interval:
            return False
        self.refit()
        return True

    def refit(self) -> None:
        a = sum(s[0] for s in self.stats) + self.L2
        g0 = sum(s[3] for s in self.stats)
        c = [s[2] + self.L2 for s in self.stats]
        den = a - sum(s[1] * s[1] / ck for s, ck in zip(self.stats, c))
        d_slope = (g0 - sum(s[1] * s[4] / ck for s, ck in zip(self.stats, c))) / den if den > 0 else 0.0
        n = sum(s[5] for s in self.stats)
        d_slope *= n / (n + self.DAMPING)
        if not math.isfinite(d_slope) or self.slope + d_slope < 0.0:
            d_slope = 0.0
        self.slope = min(self.slope + d_slope, self.BOUND)
        for k, (s, ck) in enumerate(zip(self.stats, c)):
            d = (s[4] - s[1] * d_slope) / ck * s[5] / (s[5] + self.DAMPING)
            if math.isfinite(d):
                self.intercepts[k] = min(max(self.intercepts[k] + d, -self.BOUND), self.BOUND)
        self._clear()
        self.refits += 1


@dataclass
class VllmRowMemory:
    """A request's row of adaptive verification: the acceptance probability of each draft position from its last
    block (vLLM's stale confidences; a new request's are 1.0) and this block's features and predictions by position."""

    confidence: list[float]
    features: dict[int, float] = field(default_factory=dict)
    predictions: dict[int, float] = field(default_factory=dict)


class VllmAdaptiveVerification(_EngineStep, _OneDrafter):
    """vLLM Model Runner V2's adaptive verification (``enable_adaptive_verification``, vllm 0.33.0:
    ``vllm/v1/worker/gpu/spec_decode/adaptive_verification.py``, ``AdaptiveVerificationManager.get_num_tokens``, with
    the ``AcceptanceEstimator``). vLLM drafts ``num_speculative_tokens`` per request, then verifies only a budget B of
    the batch's draft slots: the B that maximises (requests + the sum of the B best survival scores) / (draft cost +
    verify cost), a slot's survival being the product of its request's acceptance probabilities up to it, read from
    the previous step's predictions (the budget is set before this step's are known); the B slots go to the highest
    survival.

    Here the budget is k per row, decided before drafting from each row's previous block (``VllmRowMemory``), the
    cost from the profiled ``cost`` model: drafting every row's full block (as vLLM does, whatever it then trims) plus
    the target pass of the longest admitted block at the live batch size (at batch size 1 exactly vLLM's count). vLLM
    allots the B slots by this step's predictions; the decoder cannot trim a drafted block, so they go by the previous
    step's. ``should_stop`` only records each drafted token's feature (it never stops a block). The estimator learns
    from positions up to the first rejection, and those positions' predictions are the row's next confidences; a
    position drafted after a wrong token (which a teacher-forced replay cannot know) or not drafted at all is estimated
    from the feature of the last one on the target's prefix, which keeps the replay exact. A block's last token is seen
    only in the step's statistics (``DecoderConfig.step_stats``), as the decoder asks no stop after it; without them
    it is not learnt from."""

    needs_token_feedback = True

    def __init__(self, cost: CostModel, num_speculative_tokens: int = 4, refit_interval: int = 100,
                 drafter: str | None = None):
        super().__init__(drafter)
        self.cost = cost
        self.num_speculative_tokens = _count(num_speculative_tokens, "VllmAdaptiveVerification",
                                             "num_speculative_tokens", 1, "0 drafts nothing: use the autoregressive "
                                                                          "policy instead")
        self.estimator = AcceptanceEstimator(num_speculative_tokens, refit_interval)
        self._pending = []
        self.name = "vllm-adaptive-verification"

    def validate(self, drafters, k_max):
        super().validate(drafters, k_max)
        check_k(self.num_speculative_tokens, k_max, f"{self!r} (num_speculative_tokens)")
        for name in [self.drafter] if self.drafter else drafters:
            if name not in self.cost.draft:
                raise ValueError(f"{self!r}: the cost model has no draft curve for drafter {name!r} (profiled: "
                                 f"{sorted(self.cost.draft)}); profile it or name a profiled drafter")

    def start(self, request: RequestInfo) -> VllmRowMemory:
        return VllmRowMemory([1.0] * self.num_speculative_tokens)

    def decide(self, rows: list[PolicyRow]) -> list[Decision]:
        self._settle()
        names = [self._pick(row.state, 1).drafter for row in rows]
        caps = [min(self.num_speculative_tokens, room(row.state.remaining)) if name else 0
                for row, name in zip(rows, names)]
        ks = self.budget(rows, names, caps)
        for row in rows:
            row.memory.features, row.memory.predictions = {}, {}
        return [self._pick(row.state, k) for row, k in zip(rows, ks)]

    def budget(self, rows: list[PolicyRow], names: list[str | None], caps: list[int]) -> list[int]:
        """Each row's admitted draft slots (module docstring): the count maximising expected tokens over seconds."""
        scores = []
        for i, (row, cap) in enumerate(zip(rows, caps)):
            alive = 1.0
            for j, p in enumerate(row.memory.confidence[:cap]):
                alive *= p
                scores.append((-alive, i, j))
        scores.sort()  # survival falls along a row, so every row's admitted slots are a prefix of its block
        ctx = sum(r.state.context_len for r in rows) / len(rows)
        batch = rows[0].state.batch_size if self.cost.batch else 1
        together = {n: names.count(n) for n in set(names) if n}
        draft = sum(self.cost.draft_time(n, c, r.state.context_len, together.get(n, 1))
                    for r, n, c in zip(rows, names, caps) if n)
        ks, tokens = [0] * len(rows), float(len(rows))
        best = (tokens / (draft + self.cost.verify_time(0, ctx, batch)), list(ks))
        for neg, i, _ in scores:
            ks[i] += 1
            tokens -= neg
            rate = tokens / (draft + self.cost.verify_time(max(ks), ctx, batch))
            if rate > best[0]:
                best = (rate, list(ks))
        return best[1]

    def should_stop(self, row: PolicyRow, token: DraftToken) -> bool:
        self._note(row.memory, token.position, token.top1)
        return False

    def _note(self, memory: VllmRowMemory, position: int, top1: float) -> None:
        if position not in memory.features:
            f = self.estimator.feature(top1)
            memory.features[position], memory.predictions[position] = f, self.estimator.predict(f, position)

    def observe(self, row: PolicyRow, record: StepRecord) -> None:
        self._collect(record)
        memory = row.memory
        if record.cooldown or record.drafter is None or not record.drafted:
            return
        if len(record.top1) == record.drafted:  # the step's statistics: every drafted token's confidence
            for j, top1 in enumerate(record.top1):
                self._note(memory, j, top1)
        on_prefix = [j for j in range(min(record.accepted, record.drafted - 1) + 1) if j in memory.features]
        for j in on_prefix:
            self.estimator.observe(j, memory.features[j], memory.predictions[j], j < record.accepted)
        if on_prefix:
            last = memory.features[on_prefix[-1]]
            memory.confidence = [memory.predictions[j] if j in on_prefix else self.estimator.predict(last, j)
                                 for j in range(self.num_speculative_tokens)]

    def _step(self, records: list[StepRecord]) -> None:
        if any(r.drafter is not None and r.drafted for r in records):
            self.estimator.end_step()


# ---------------------------------------------------------------------- llama.cpp and AdaEDL: stop rules
class LlamaCppPMin(Static):
    """llama.cpp's ``--draft-p-min`` with ``--draft-max`` / ``--draft-min`` (``common/speculative.cpp``,
    ``common_speculative_gen_draft``: a drafted token is kept and drafting stops once its top-1 probability is below
    ``p_min``, or at ``draft_max`` tokens; defaults from ``common/common.h``'s ``common_params_speculative`` of the
    releases that shipped p_min 0.75 (b6000): draft_max 16, draft_min 0). llama.cpp's server drops a draft shorter
    than ``draft_min`` and decodes that step without one; the decoder verifies whatever was drafted, so here p_min is
    not consulted before ``draft_min`` tokens instead."""

    needs_token_feedback = True

    def __init__(self, p_min: float = 0.75, draft_max: int = 16, draft_min: int = 0, drafter: str | None = None):
        who = "LlamaCppPMin"
        self.p_min = _number(p_min, who, "p_min (--draft-p-min)", 0.0, 1.0, "0 never stops a block early")
        _count(draft_max, who, "draft_max (--draft-max)", 1, "0 drafts nothing: use the autoregressive policy instead")
        if isinstance(draft_min, bool) or not isinstance(draft_min, int) or not 0 <= draft_min <= draft_max:
            raise ValueError(f"{who}: draft_min (--draft-min) must be an integer in [0, draft_max={draft_max}], got "
                             f"{draft_min!r}")
        super().__init__(draft_max, drafter)
        self.draft_min = draft_min
        self.name = f"llamacpp-pmin-{p_min:g}"

    def should_stop(self, row: PolicyRow, token: DraftToken) -> bool:
        return token.position + 1 >= self.draft_min and token.top1 < self.p_min


class AdaEDL(Static):
    """AdaEDL (Agrawal, Jeon and Lee, "AdaEDL: Early Draft Stopping for Speculative Decoding of Large Language Models
    via an Entropy-based Lower Bound on Token Acceptance Probability", 2024, arXiv:2410.18351): no training; drafting
    stops once the lower bound 1 - sqrt(gamma * H) on a drafted token's acceptance probability, H the entropy (nats)
    of the draft distribution it came from, falls below ``threshold``; at most ``k`` tokens. The paper stops before
    drafting that token; the decoder learns H with the token, so the block keeps it and ends there. The defaults are
    ours, not the paper's: tune them (``traces.peer_tuning``). A non-finite entropy stops the block."""

    needs_token_feedback = True

    def __init__(self, gamma: float = 0.3, threshold: float = 0.4, k: int = 8, drafter: str | None = None):
        self.gamma = _number(gamma, "AdaEDL", "gamma", 1e-12, 1e6, "it scales the entropy under the square root")
        self.threshold = _number(threshold, "AdaEDL", "threshold", 0.0, 1.0, "it bounds an acceptance probability")
        _count(k, "AdaEDL", "k", 1, "0 drafts nothing: use the autoregressive policy instead")
        super().__init__(k, drafter)
        self.name = f"adaedl-{gamma:g}-{threshold:g}"

    def bound(self, entropy: float) -> float:
        """The lower bound on the acceptance probability of a token drawn from a distribution of this entropy."""
        return 1.0 - math.sqrt(self.gamma * max(entropy, 0.0))

    def should_stop(self, row: PolicyRow, token: DraftToken) -> bool:
        return not math.isfinite(token.entropy) or self.bound(token.entropy) < self.threshold
