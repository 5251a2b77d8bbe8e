"""Held-out evaluation of every policy, simulated over test traces and live on test prompts, side by side.

Rows: ``ar``, ``static-k<N>``, ``best-static`` (drafter and k chosen on val traces), ``heuristic``,
``confidence-0.4``, ``confidence-tuned`` (threshold chosen on val traces), ``seed-rule``, ``bandit``,
``learned-<predictor>`` and ``oracle`` (simulated only). The one-drafter rules use the best static drafter. Live rows
are measured prompt by prompt with every policy in turn, so machine noise hits them alike.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace

from sacpolicy.decoding import RequestInfo
from sacpolicy.evaluation.metrics import add_speedups, row_from_results
from sacpolicy.policy import (
    Autoregressive,
    Bandit,
    Confidence,
    Heuristic,
    Policy,
    SeedRule,
    Static,
)
from sacpolicy.policy.learned import LearnedPolicy

logger = logging.getLogger(__name__)


@dataclass
class EvalSettings:
    """The ``eval`` section of ``conf/train.yaml`` (its one home: the values and their comments are there)."""

    ks: tuple[int, ...]
    k_max: int
    live_prompts: int | None
    max_new_tokens: int
    price_per_hour: float
    confidence_grid: tuple[float, ...]
    warmup_tokens: int = 8  # tokens each live decoder decodes once before timing (lazy initialisation)
    extra: dict = field(default_factory=dict)


class Timed(Policy):
    """Forwards to a policy and adds up the seconds spent in it (the policy's own overhead)."""

    def __init__(self, inner: Policy):
        self.inner, self.name, self.seconds = inner, inner.name, 0.0
        self.needs_token_feedback, self.uses_peeks = inner.needs_token_feedback, inner.uses_peeks

    def _call(self, fn, *args):
        t0 = time.perf_counter()
        out = fn(*args)
        self.seconds += time.perf_counter() - t0
        return out

    def validate(self, drafters, k_max):
        self.inner.validate(drafters, k_max)

    def reset(self, request):
        self._call(self.inner.reset, request)

    def decide(self, state):
        return self._call(self.inner.decide, state)

    def should_stop(self, state, token):
        return self._call(self.inner.should_stop, state, token)

    def observe(self, record):
        self._call(self.inner.observe, record)

    def __repr__(self) -> str:
        return repr(self.inner)


def tune_confidence(val_grouped, cost, drafter: str, k: int, grid, *, vocab_size: int, config=None) -> float:
    """The confidence threshold with the highest simulated tokens/s on validation traces."""
    from sacpolicy.traces.simulate import simulate

    scores = {t: simulate(Confidence(t, k, drafter), val_grouped, cost, vocab_size=vocab_size, config=config,
                          drafters=[drafter]).tokens_per_s for t in grid}
    return max(scores, key=scores.get)


def choose_on_val(settings: EvalSettings, val_grouped, cost, best: dict, *, vocab_size: int, config=None) -> dict:
    """What the baselines take from validation traces: the best static (drafter, k), computed once per run and
    passed in, and the tuned confidence threshold."""
    threshold = tune_confidence(val_grouped, cost, best["drafter"], settings.k_max, settings.confidence_grid,
                                vocab_size=vocab_size, config=config)
    return {"best_static": best, "confidence_threshold": threshold}


def policy_factories(settings: EvalSettings, chosen: dict, cost, rules: dict, *, live: bool) -> dict:
    """{row name: () -> Policy}, every policy fresh (its own counters), from what was chosen on val."""
    d, k_best = chosen["best_static"]["drafter"], chosen["best_static"]["k"]
    threshold = chosen["confidence_threshold"]
    make = {"ar": Autoregressive}
    for k in settings.ks:
        make[f"static-k{k}"] = lambda k=k: Static(k, d)
    make |= {
        "best-static": lambda: Static(k_best, d),
        "heuristic": lambda: Heuristic(k0=min(5, settings.k_max), drafter=d, k_max=settings.k_max),
        "confidence-0.4": lambda: Confidence(0.4, settings.k_max, d),
        "confidence-tuned": lambda: Confidence(threshold, settings.k_max, d),
        "seed-rule": lambda: SeedRule(k_short=min(6, settings.k_max), k_long=2, drafter=d),
        # live steps are timed; replayed ones are priced by the cost model
        "bandit": lambda: Bandit(ks=tuple(k for k in settings.ks if k <= settings.k_max), cost=None if live else cost),
    }
    for name, rule in rules.items():  # a copy of the rule per policy: fallback counts stay per row
        make[f"learned-{name}"] = lambda rule=rule, name=name: LearnedPolicy(replace(rule, fallbacks=0),
                                                                             name=f"learned-{name}")
    return make


def evaluate(*, target, drafters: list, cost, val_grouped: dict, test_grouped: dict, test_prompts: list,
             rules: dict, settings: EvalSettings, best_static: dict, sampling=None, decoder_config=None,
             progress: bool = True):
    """-> (rows, meta). ``rules``: {predictor name: DecisionRule}; ``drafters`` in the order the traces hold them;
    ``best_static``: the best static (drafter, k) on val traces (``traces.simulate.best_static``)."""
    from tqdm.auto import tqdm

    from sacpolicy.decoding import SpeculativeDecoder
    from sacpolicy.traces.simulate import Oracle, simulate

    vocab = int(target.model.get_output_embeddings().out_features)
    rows = []
    chosen = choose_on_val(settings, val_grouped, cost, best_static, vocab_size=vocab, config=decoder_config)
    sim_make = policy_factories(settings, chosen, cost, rules, live=False)
    sim_make["oracle"] = lambda: Oracle(cost, k_max=settings.k_max)
    for name, make in tqdm(sim_make.items(), desc="simulated rows", disable=not progress):
        policy = make()
        timed = policy if isinstance(policy, Oracle) else Timed(policy)  # the oracle reads traces through .current
        sim = simulate(timed, test_grouped, cost, vocab_size=vocab, config=decoder_config)
        rows.append(row_from_results(name, "simulated", sim.results, price_per_hour=settings.price_per_hour,
                                     policy_s=getattr(timed, "seconds", 0.0),
                                     extra={"fallbacks": getattr(policy, "fallbacks", 0)}))

    n_live = len(test_prompts) if settings.live_prompts is None else min(settings.live_prompts, len(test_prompts))
    if n_live:
        live_make = policy_factories(settings, chosen, cost, rules, live=True)
        decoders = {name: SpeculativeDecoder(target.model, drafters, Timed(make()), sampling=sampling,
                                             config=decoder_config, stop_token_ids=target.eos_token_ids)
                    for name, make in live_make.items()}
        for dec in decoders.values():  # first calls pay for lazy initialisation
            dec.generate(test_prompts[0]["input_ids"], settings.warmup_tokens)
            dec.policy.seconds = 0.0
        results = {name: [] for name in decoders}
        for row in tqdm(test_prompts[:n_live], desc="live rows (prompt by prompt)", disable=not progress):
            for name, dec in decoders.items():
                res = dec.generate(row["input_ids"], settings.max_new_tokens, request=RequestInfo(category=row["category"]))
                results[name].append((row["category"], res))
        for name, dec in decoders.items():
            rows.append(row_from_results(name, "live", results[name], price_per_hour=settings.price_per_hour,
                                         policy_s=dec.policy.seconds,
                                         extra={"fallbacks": getattr(dec.policy.inner, "fallbacks", 0)}))
    add_speedups(rows)
    meta = {"target": target.spec, "device": str(target.device), "dtype": str(target.dtype),
            "drafters": [d.name for d in drafters], "test_prompts_simulated": len(test_grouped),
            "val_prompts": len(val_grouped), "live_prompts": n_live, "max_new_tokens": settings.max_new_tokens,
            "price_per_hour": settings.price_per_hour, **chosen, **targets(rows, list(rules)), **settings.extra}
    return rows, meta


def targets(rows: list[dict], predictors: list[str]) -> dict:
    """The learned policy's figures of merit: tokens/s over best static (live and simulated) and the share of the
    oracle's gain over best static it captures (simulated)."""
    by = {(r["name"], r["mode"]): r["tokens_per_s"] for r in rows}
    out = {}
    for p in predictors:
        name = f"learned-{p}"
        for mode in ("live", "simulated"):
            if (name, mode) in by and ("best-static", mode) in by:
                out[f"{name}_vs_best_static_{mode}"] = by[(name, mode)] / by[("best-static", mode)]
        if ("oracle", "simulated") in by and (name, "simulated") in by:
            gain = by[("oracle", "simulated")] - by[("best-static", "simulated")]
            out[f"{name}_oracle_gain_captured"] = (
                (by[(name, "simulated")] - by[("best-static", "simulated")]) / gain if gain > 0 else float("nan"))
    return out
