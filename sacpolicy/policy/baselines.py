"""Hand-made speculation policies: the baselines every learned policy has to beat (the learned policy's decision rule
is ``runtime.rule``; its policy ``policy.learned``)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from sacpolicy.policy.base import (
    Decision,
    DecodeState,
    DraftToken,
    Policy,
    PolicyRow,
    RequestInfo,
    check_drafter,
    check_k,
)


class _OneDrafter(Policy):
    """Shared part of the rules that use one drafter: ``drafter=None`` means the decoder's first drafter."""

    def __init__(self, drafter: str | None = None):
        self.drafter = drafter
        self.tree: int | None = None  # a token tree's node budget (Decision.tree); None: the drafter's default

    def validate(self, drafters: tuple[str, ...], k_max: int) -> None:
        if not drafters:
            raise ValueError(f"{self!r} needs at least one drafter; configure one or use the autoregressive policy")
        check_drafter(self.drafter, drafters, repr(self))

    def _pick(self, state: DecodeState, k: int) -> Decision:
        name = self.drafter or (state.drafters[0] if state.drafters else None)
        if name is None or name not in state.drafters or k == 0:
            return Decision.autoregressive()
        return Decision(name, k, self.tree)


class Static(_OneDrafter):
    """Always draft k tokens; with ``tree`` = n > 0 a token tree of at most n nodes and depth k (drafters that draft
    trees), with 0 a chain, with None (default) what the drafter does by default."""

    def __init__(self, k: int, drafter: str | None = None, tree: int | None = None):
        check_k(k, k, "Static policy")
        if tree is not None and (not isinstance(tree, int) or tree < 0):
            raise ValueError(f"Static policy: tree must be None (the drafter's default), 0 (chains) or a node budget "
                             f">= 1, got {tree!r}")
        super().__init__(drafter)
        self.k, self.tree = k, tree
        self.name = f"static-k{k}" + (f"-tree{tree}" if tree else "")

    def validate(self, drafters, k_max):
        super().validate(drafters, k_max)
        check_k(self.k, k_max, repr(self))

    def decide(self, rows: list[PolicyRow]) -> list[Decision]:
        return [self._pick(row.state, self.k) for row in rows]


@dataclass
class HeuristicMemory:
    k: int  # the request's current k


class Heuristic(_OneDrafter):
    """transformers' ``num_assistant_tokens_schedule="heuristic"``: k += 2 after a fully accepted block, else k -= 1
    (floor 1). Starts each request at ``k0`` (transformers' "heuristic_transient"; its "heuristic" carries k over
    between calls, which ``carry_over=True`` reproduces)."""

    def __init__(self, k0: int = 5, drafter: str | None = None, carry_over: bool = False, k_max: int | None = None):
        check_k(k0, k0, "Heuristic policy")
        if k0 < 1:
            raise ValueError("Heuristic policy: k0 must be >= 1")
        super().__init__(drafter)
        self.k0, self.carry_over, self.k_max = k0, carry_over, k_max
        self.k = k0  # the k the next request starts at (carry_over: the last request's last k)
        self.name = "heuristic"

    def validate(self, drafters, k_max):
        super().validate(drafters, k_max)
        check_k(self.k0, k_max, repr(self))
        self.k_max = min(self.k_max or k_max, k_max)

    def start(self, request: RequestInfo) -> HeuristicMemory:
        return HeuristicMemory(self.k if self.carry_over else self.k0)

    def decide(self, rows: list[PolicyRow]) -> list[Decision]:
        return [self._pick(row.state, min(row.memory.k, self.k_max or row.memory.k)) for row in rows]

    def observe(self, row: PolicyRow, record) -> None:
        if record.drafter is None or record.drafted == 0 or record.cooldown:
            return
        mem = row.memory
        if record.accepted == record.drafted and record.drafted == record.k:
            mem.k += 2
        else:
            mem.k = max(1, mem.k - 1)
        if self.k_max:
            mem.k = min(mem.k, self.k_max)
        if self.carry_over:
            self.k = mem.k


class Confidence(Static):
    """Draft up to k tokens, stopping after a token whose draft top-1 probability is below ``threshold``
    (transformers' ``assistant_confidence_threshold``)."""

    needs_token_feedback = True

    def __init__(self, threshold: float = 0.4, k: int = 8, drafter: str | None = None):
        if not 0.0 <= threshold <= 1.0:
            raise ValueError(f"Confidence policy: threshold must be in [0, 1], got {threshold}")
        check_k(k, k, "Confidence policy")
        super().__init__(k, drafter)
        self.threshold = threshold
        self.name = f"confidence-{threshold:g}"

    def should_stop(self, row: PolicyRow, token: DraftToken) -> bool:
        return token.top1 < self.threshold


class SeedRule(_OneDrafter):
    """The seed article's rule: short prompts speculate more, long prompts less, and load scales it down.

    k interpolates log-linearly from ``k_short`` (prompts of <= ``short_len`` tokens) to ``k_long`` (>= ``long_len``),
    then is multiplied by (1 - load_weight * load) and rounded. The load is live when the decoder decodes in batches
    (rows / ``decoder.max_batch``, every step), else the request's signal in [0, 1].
    """

    def __init__(self, k_short: int = 6, k_long: int = 2, short_len: int = 64, long_len: int = 1024,
                 load_weight: float = 1.0, drafter: str | None = None):
        check_k(k_short, k_short, "SeedRule policy")
        check_k(k_long, k_long, "SeedRule policy")
        if not 0 < short_len < long_len:
            raise ValueError(f"SeedRule: need 0 < short_len < long_len, got {short_len}, {long_len}")
        super().__init__(drafter)
        self.k_short, self.k_long, self.short_len, self.long_len = k_short, k_long, short_len, long_len
        self.load_weight = load_weight
        self.name = "seed-rule"

    def validate(self, drafters, k_max):
        super().validate(drafters, k_max)
        check_k(max(self.k_short, self.k_long), k_max, repr(self))

    def k_for(self, prompt_len: int, load: float) -> int:
        if not 0.0 <= load <= 1.0:
            raise ValueError(f"SeedRule: load must be in [0, 1], got {load}")
        t = (math.log(max(prompt_len, 1)) - math.log(self.short_len)) / (math.log(self.long_len) - math.log(self.short_len))
        t = min(max(t, 0.0), 1.0)
        base = self.k_short + t * (self.k_long - self.k_short)
        return max(0, round(base * (1.0 - self.load_weight * load)))

    def decide(self, rows: list[PolicyRow]) -> list[Decision]:
        return [self._pick(r.state, self.k_for(r.state.request.prompt_len, r.state.load_signal)) for r in rows]


@dataclass
class BanditMemory:
    arm: int | None = None  # the arm the row's last decision pulled


class Bandit(Policy):
    """Online choice of (drafter, k), autoregressive included, with no training: discounted UCB1 on the reward
    tokens per second of each step. Statistics carry over between requests and decay by ``discount`` per step, so the
    policy follows traffic shifts. Step seconds are the measured ones, or the cost model's prediction when ``cost``
    is given (replaying traces, where no step is timed). Rows decoded together choose from the same statistics and
    each reports its own arm's reward."""

    def __init__(self, ks=(1, 2, 4, 8), drafters: tuple[str, ...] | None = None, c: float = 0.5,
                 discount: float = 0.995, cost=None):
        if not ks or min(ks) < 1:
            raise ValueError(f"Bandit: ks must be non-empty integers >= 1, got {ks}")
        if not 0.0 < discount <= 1.0:
            raise ValueError(f"Bandit: discount must be in (0, 1], got {discount}")
        self.ks, self.only, self.c, self.discount, self.cost = tuple(ks), drafters, c, discount, cost
        self.name = "bandit"
        self.arms: list[tuple[str | None, int]] = []
        self.n = self.total = None
        self.best = 0.0  # largest reward seen: rewards are scaled into [0, 1] by it

    def validate(self, drafters, k_max):
        for k in self.ks:
            check_k(k, k_max, repr(self))
        for d in self.only or ():
            check_drafter(d, drafters, repr(self))
        use = self.only or drafters
        self.arms = [(None, 0)] + [(d, k) for d in use for k in self.ks]
        self.n, self.total = [0.0] * len(self.arms), [0.0] * len(self.arms)

    def start(self, request: RequestInfo) -> BanditMemory:
        return BanditMemory()

    def decide(self, rows: list[PolicyRow]) -> list[Decision]:
        return [self._decide(row) for row in rows]

    def _decide(self, row: PolicyRow) -> Decision:
        usable = [i for i, (d, _) in enumerate(self.arms) if d is None or d in row.state.drafters]
        untried = [i for i in usable if self.n[i] == 0]
        if untried:
            arm = untried[0]
        else:
            log_t = math.log(sum(self.n[i] for i in usable))
            arm = max(usable, key=lambda i: self.total[i] / self.n[i] + self.c * math.sqrt(log_t / self.n[i]))
        row.memory.arm = arm
        d, k = self.arms[arm]
        return Decision(d, k) if d is not None else Decision.autoregressive()

    def observe(self, row: PolicyRow, record) -> None:
        if record.cooldown or not self.arms or row.memory.arm is None:
            return
        if self.cost is not None:
            seconds = self.cost.step_time(record.drafter, record.drafted, record.context_len)
        else:
            seconds = record.draft_s + record.verify_s
        reward = record.emitted / max(seconds, 1e-9)
        self.best = max(self.best, reward)
        self.n = [self.discount * v for v in self.n]
        self.total = [self.discount * v for v in self.total]
        self.n[row.memory.arm] += 1.0
        self.total[row.memory.arm] += reward / self.best
