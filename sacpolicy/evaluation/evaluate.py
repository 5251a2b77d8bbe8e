"""Held-out evaluation of every policy, simulated over test traces and live on test prompts, side by side.

Rows: ``ar``, ``static-k<N>``, ``best-static`` (drafter and k chosen on val traces), ``heuristic``,
``confidence-0.4``, ``confidence-tuned`` (threshold chosen on val traces), ``seed-rule``, ``bandit``, the serving
engines' controllers ``peer-<name>`` (``policy.peers``, each tuned on val traces as its users would tune it:
``traces.peer_tuning``) and ``best-peer`` (the peer fastest on val traces), ``learned-<predictor>``, and the ceilings
(simulated only, ``evaluation.ceilings``): ``per-prompt-static``, ``learned-<predictor>-in-sample`` and ``oracle``.
The one-drafter rules and the peers use the best static drafter. Live rows are measured prompt by prompt with every
policy in turn, so machine noise hits them alike. Every ratio against AR and the best static carries a paired
bootstrap interval over prompts (``evaluation.intervals``), and so does the learned policy's against each peer row.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace

from sacpolicy.decoding import RequestInfo
from sacpolicy.evaluation.ceilings import InSample, in_sample_rules, per_prompt_static
from sacpolicy.evaluation.intervals import add_intervals, paired_ratios
from sacpolicy.evaluation.metrics import (
    add_speedups,
    flag_artefacts,
    gain_captured,
    row_from_results,
    simulated_vs_live,
)
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
from sacpolicy.profiling.drift import SpeedProbe
from sacpolicy.progress import progress_iter
from sacpolicy.traces import peer_tuning

logger = logging.getLogger(__name__)

HEADLINE = "learned"  # in eval.live_policies: the row of the predictor chosen on validation (headline_predictor)
BEST_PEER = "best-peer"  # the row of the peer fastest on validation traces (choose_on_val)


def headline_predictor(metrics: dict) -> str | None:
    """The learned policy a run reports first: of {predictor: its metrics by split} (``fit_predictor``'s, kept in
    ``fit.json`` and in each policy artifact), the predictor with the lowest validation log loss, the quantity it is
    fitted to minimise, on prompts neither its training nor the test saw (a missing or NaN loss ranks last; None without
    predictors). Chosen before any test prompt is decoded, so the headline row is not picked on test."""
    import math

    def key(name):
        loss = metrics[name].get("val", {}).get("log_loss")
        return math.inf if loss is None or math.isnan(loss) else loss

    return min(metrics, key=key) if metrics else None


@dataclass
class EvalSettings:
    """The ``eval`` section of ``conf/train.yaml``: the fields without a default are set there, with their comments;
    ``k_max`` is the pipeline's ``fit.k_max`` (``pipeline.context.eval_settings``)."""

    ks: tuple[int, ...]
    k_max: int
    live_prompts: int | None
    max_new_tokens: int
    price_per_hour: float
    confidence_grid: tuple[float, ...]
    live_policies: tuple[str, ...] | None = None  # fnmatch patterns of the rows decoded live (HEADLINE: the chosen
    # predictor's row); None: every policy
    ceilings: bool = True  # the in-sample rows: every predictor refitted, calibrated and tuned on the test traces
    # (the slowest part of a simulated-only evaluation; false: no in-sample rows, e.g. to replay other policies)
    warmup_tokens: int = 8  # tokens each live decoder decodes once before timing (lazy initialisation)
    resamples: int = 2000  # bootstrap resamples of the prompts behind each ratio's 95% interval
    bootstrap_seed: int = 0
    speed_probe_every: int = 8  # live prompts between probes of the machine's speed against its profile's
    # (profiling.drift; also before the first and after the last); 0: no probe
    # The engines' controllers (traces.peer_tuning.PEERS) tuned on val traces (a small grid each: peer_grid) and
    # replayed as peer-<name> rows; the fastest on val is also best-peer. None: every peer; []: none
    peers: tuple[str, ...] | None = None
    extra: dict = field(default_factory=dict)


class Timed(Policy):
    """Forwards to a policy and adds up the seconds spent in it (the policy's own overhead), every row's calls in
    one total."""

    def __init__(self, inner: Policy):
        self.inner, self.name = inner, inner.name
        self.needs_token_feedback, self.uses_peeks = inner.needs_token_feedback, inner.uses_peeks
        self.seconds = 0.0

    def _call(self, fn, *args):
        t0 = time.perf_counter()
        out = fn(*args)
        self.seconds += time.perf_counter() - t0
        return out

    def validate(self, drafters, k_max):
        self.inner.validate(drafters, k_max)

    def start(self, request):
        return self._call(self.inner.start, request)

    def decide(self, rows):
        return self._call(self.inner.decide, rows)

    def should_stop(self, row, token):
        return self._call(self.inner.should_stop, row, token)

    def observe(self, row, record):
        self._call(self.inner.observe, row, record)

    def __repr__(self) -> str:
        return repr(self.inner)


def tune_confidence(val_grouped, cost, drafter: str, k: int, grid, *, vocab_size: int, config=None) -> float:
    """The confidence threshold with the highest simulated tokens/s on validation traces."""
    from sacpolicy.traces.simulate import simulate

    scores = {t: simulate(Confidence(t, k, drafter), val_grouped, cost, vocab_size=vocab_size, config=config,
                          drafters=[drafter]).tokens_per_s for t in grid}
    return max(scores, key=scores.get)


def peer_names(settings: EvalSettings) -> list[str]:
    """The peers ``settings.peers`` names (None: every one of ``traces.peer_tuning.PEERS``), or an error naming
    them."""
    known = list(peer_tuning.PEERS)
    names = known if settings.peers is None else list(settings.peers)
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"eval.peers {unknown} name no peer; peers are {known} (null: every one, []: none)")
    return names


def tune_peers(settings: EvalSettings, val_grouped, cost, drafter: str, *, vocab_size: int, config=None,
               progress: bool = True) -> dict:
    """{peer: {"settings", "val_tokens_per_s"}}: each peer of ``settings.peers`` tuned on the validation traces
    alone (``tune_peer``: the fastest of its small grid in replay), drafting with ``drafter``."""
    out = {}
    for name in progress_iter(peer_names(settings), "peers tuned on val", unit="peer", enabled=progress):
        _, chosen, tps = peer_tuning.tune_peer(name, val_grouped, cost, vocab_size=vocab_size, drafter=drafter,
                                               k_max=settings.k_max, config=config)
        out[name] = {"settings": chosen, "val_tokens_per_s": tps}
    return out


def choose_on_val(settings: EvalSettings, val_grouped, cost, best: dict, *, vocab_size: int, config=None,
                  progress: bool = True) -> dict:
    """What the baselines take from validation traces: the best static (drafter, k), computed once per run and
    passed in, the tuned confidence threshold, each peer's tuned setting and the best peer (fastest on val, ties to
    the earlier; None without peers)."""
    threshold = tune_confidence(val_grouped, cost, best["drafter"], settings.k_max, settings.confidence_grid,
                                vocab_size=vocab_size, config=config)
    peers = tune_peers(settings, val_grouped, cost, best["drafter"], vocab_size=vocab_size, config=config,
                       progress=progress)
    best_peer = max(peers, key=lambda n: peers[n]["val_tokens_per_s"]) if peers else None
    return {"best_static": best, "confidence_threshold": threshold, "peers": peers, "best_peer": best_peer}


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
    peers = chosen.get("peers", {})
    for name, tuned in peers.items():  # adaptive verification budgets with the cost model, live too (as vLLM does)
        make[f"peer-{name}"] = lambda name=name, s=tuned["settings"]: peer_tuning.build_peer(name, s, cost, d)
    if chosen.get("best_peer"):
        make[BEST_PEER] = lambda n=chosen["best_peer"]: peer_tuning.build_peer(n, peers[n]["settings"], cost, d)
    for name, rule in rules.items():  # a copy of the rule per policy: fallback counts stay per row
        make[f"learned-{name}"] = lambda rule=rule, name=name: LearnedPolicy(replace(rule, fallbacks=0),
                                                                             name=f"learned-{name}")
        # the same predictor the other way: fitted only where the rule learns while serving, learning where not
        other = f"learned-{name}-" + ("offline" if rule is not None and rule.online is not None else "online")
        make[other] = lambda rule=rule, other=other: LearnedPolicy(replace(rule, fallbacks=0), name=other,
                                                                   online=rule.online is None)
    return make


def evaluate(*, target, drafters: list, cost, val_grouped: dict, test_grouped: dict, test_prompts: list,
             rules: dict, settings: EvalSettings, best_static: dict, sampling=None, decoder_config=None,
             in_sample: InSample | None = None, headline: str | None = None, progress: bool = True):
    """-> (rows, meta). ``rules``: {predictor name: DecisionRule}; ``drafters`` in the order the traces hold them;
    ``best_static``: the best static (drafter, k) on val traces (``traces.simulate.best_static``); ``in_sample``:
    what to refit for the in-sample ceilings (none without it); ``headline``: the predictor chosen on validation
    (``headline_predictor``), whose row ``eval.live_policies``' ``learned`` names. Traces of sampled decoding replay
    in expectation (``traces.draws``; ``meta["simulated_replay"]`` says which replay ran) and give no load rows."""
    from sacpolicy.traces.draws import replay_kind

    vocab = int(target.model.get_output_embeddings().out_features)
    chosen = choose_on_val(settings, val_grouped, cost, best_static, vocab_size=vocab, config=decoder_config,
                           progress=progress)
    rows, no_ceiling = simulated_rows(settings, chosen, cost, rules, test_grouped, vocab_size=vocab,
                                      config=decoder_config, in_sample=in_sample, progress=progress)
    load = load_rows(settings, chosen, cost, rules, test_grouped, vocab_size=vocab, config=decoder_config)
    n_live = len(test_prompts) if settings.live_prompts is None else min(settings.live_prompts, len(test_prompts))
    probe = SpeedProbe(target.model, cost) if n_live and settings.speed_probe_every > 0 else None
    if n_live:
        rows += live_rows(settings, chosen, cost, rules, target, drafters, test_prompts[:n_live], sampling=sampling,
                          config=decoder_config, headline=headline, progress=progress, probe=probe)
    add_speedups(rows)
    add_intervals(rows, resamples=settings.resamples, seed=settings.bootstrap_seed)
    learned = [f"learned-{headline}"] if headline else [f"learned-{n}" for n in rules]
    vs_peers = paired_ratios(rows, learned, [n for n in dict.fromkeys(r["name"] for r in rows)
                                             if n.startswith("peer-") or n == BEST_PEER],
                             resamples=settings.resamples, seed=settings.bootstrap_seed)
    flag_artefacts(rows)
    meta = {"target": target.spec, "device": str(target.device), "dtype": str(target.dtype),
            "drafters": [d.name for d in drafters], "test_prompts_simulated": len(test_grouped),
            "simulated_replay": replay_kind(test_grouped),
            "val_prompts": len(val_grouped), "live_prompts": n_live, "max_new_tokens": settings.max_new_tokens,
            "price_per_hour": settings.price_per_hour, "bootstrap_resamples": settings.resamples, **chosen,
            **targets(rows, list(rules)),
            **({"in_sample_skipped": no_ceiling} if no_ceiling else {}),
            **({"learned_policy": f"learned-{headline}"} if headline else {}), **settings.extra}
    if vs_peers:  # the learned policy over each peer row, with its paired interval; the best peer's as a number too
        meta["learned_vs_peers"] = vs_peers
        meta |= {f"{p['row']}_vs_best_peer_{p['mode']}": p["ratio"] for p in vs_peers if p["ref"] == BEST_PEER}
    if probe is not None:
        meta["machine_speed"] = probe.summary()
    if n_live:
        meta["simulated_vs_live"] = simulated_vs_live(rows)
    if load:
        meta["load"] = load
    return rows, meta


def simulated_rows(settings: EvalSettings, chosen: dict, cost, rules: dict, test_grouped: dict, *, vocab_size: int,
                   config=None, in_sample: InSample | None = None, progress: bool = True) -> tuple[list, dict]:
    """Every policy replayed over the test traces, then the ceilings: per-prompt hindsight static, each predictor
    refitted in sample (with ``in_sample``) and the oracle. -> (rows, {predictor: why it has no in-sample row})."""
    from sacpolicy.traces.simulate import Oracle, simulate

    def row(name, results, policy_s=0.0, fallbacks=0):
        return row_from_results(name, "simulated", results, price_per_hour=settings.price_per_hour,
                                policy_s=policy_s, extra={"fallbacks": fallbacks})

    make, no_ceiling = policy_factories(settings, chosen, cost, rules, live=False), {}
    if in_sample is not None:
        refit, no_ceiling = in_sample_rules(test_grouped, cost, in_sample, vocab_size=vocab_size, k_max=settings.k_max,
                                config=config)
        make |= {f"learned-{n}-in-sample": lambda r=r, n=n: LearnedPolicy(r, name=f"learned-{n}-in-sample")
                 for n, r in refit.items()}
    make["oracle"] = lambda: Oracle(cost, k_max=settings.k_max)
    rows = []
    for name, factory in progress_iter(make.items(), "simulated rows", unit="policy", enabled=progress):
        policy = factory()
        timed = policy if isinstance(policy, Oracle) else Timed(policy)  # the oracle reads traces through .current
        sim = simulate(timed, test_grouped, cost, vocab_size=vocab_size, config=config)
        rows.append(row(name, sim.results, getattr(timed, "seconds", 0.0), getattr(policy, "fallbacks", 0)))
        if name == "best-static":
            rows.append(row("per-prompt-static", per_prompt_static(test_grouped, cost, vocab_size=vocab_size,
                                                                   k_max=settings.k_max, config=config)))
    return rows, no_ceiling


def check_live_policies(settings: EvalSettings, predictors) -> None:
    """Refuse ``eval.live_policies`` patterns that match no row, before a run spends minutes reaching evaluation."""
    names = peer_names(settings)  # row names only: never built
    chosen = {"best_static": {"drafter": None, "k": 1}, "confidence_threshold": 0.5,
              "peers": {n: {"settings": {}} for n in names}, "best_peer": names[0] if names else None}
    predictors = list(predictors)
    live_factories(settings, policy_factories(settings, chosen, None, dict.fromkeys(predictors), live=True),
                   headline=predictors[0] if predictors else None)  # any predictor may turn out the headline


def live_factories(settings: EvalSettings, make: dict, headline: str | None = None) -> dict:
    """The policies ``settings.live_policies`` names (fnmatch patterns, e.g. ``learned-*``; ``learned`` alone is the
    ``headline`` predictor's row), in their order; all of them when it is None. A pattern that matches nothing is an
    error naming the rows there are."""
    import fnmatch

    if settings.live_policies is None:
        return make
    patterns = [f"learned-{headline}" if p == HEADLINE and headline else p for p in settings.live_policies]
    unmatched = [p for p, q in zip(settings.live_policies, patterns) if not fnmatch.filter(make, q)]
    if unmatched:
        raise ValueError(f"eval.live_policies {unmatched} match no policy row; rows are {list(make)} "
                         f"(patterns as in fnmatch, e.g. learned-*; {HEADLINE}: the predictor with the lowest "
                         "validation log loss, none without predictors; null = every row)")
    return {name: f for name, f in make.items() if any(fnmatch.fnmatch(name, p) for p in patterns)}


def live_rows(settings: EvalSettings, chosen: dict, cost, rules: dict, target, drafters: list, prompts: list, *,
              sampling=None, config=None, headline: str | None = None, progress: bool = True,
              probe=None) -> list[dict]:
    """Every policy decoding the prompts live, prompt by prompt with each policy in turn (machine noise hits all
    alike), after a warm-up generation each. ``probe`` (a ``profiling.drift.SpeedProbe``): timed before the first
    prompt, every ``settings.speed_probe_every`` prompts and after the last. Each policy decodes with its own copies
    of the drafters that keep state across requests (``fresh_drafters``: the suffix drafter's global index), reset
    after its warm-up: no policy sees another's answers to the same prompts, nor the traces collected before."""
    from sacpolicy.decoding import SpeculativeDecoder, fresh_drafters, reset_drafters

    factories = live_factories(settings, policy_factories(settings, chosen, cost, rules, live=True), headline)
    decoders = {name: SpeculativeDecoder(target.model, fresh_drafters(drafters), Timed(make()), sampling=sampling,
                                         config=config, stop_token_ids=target.eos_token_ids)
                for name, make in factories.items()}
    for dec in decoders.values():  # first calls pay for lazy initialisation
        dec.generate(prompts[0]["input_ids"], settings.warmup_tokens)
        dec.policy.seconds = 0.0
        reset_drafters(dec.drafters.values())
    results = {name: [] for name in decoders}
    for i, row in enumerate(progress_iter(prompts, "live rows (prompt by prompt)", unit="prompt", enabled=progress)):
        if probe is not None and i % settings.speed_probe_every == 0:
            probe()
        for name, dec in decoders.items():
            res = dec.generate(row["input_ids"], settings.max_new_tokens, request=RequestInfo(category=row["category"]))
            results[name].append((row["category"], res))
    if probe is not None:
        probe()
    return [row_from_results(name, "live", results[name], price_per_hour=settings.price_per_hour,
                             policy_s=dec.policy.seconds, extra={"fallbacks": getattr(dec.policy.inner, "fallbacks", 0)})
            for name, dec in decoders.items()]


LOAD_POLICIES = ("ar", "best-static", "heuristic", "seed-rule")  # + static-k<N> and the learned rules
LOAD_RATES = (0.25, 0.5, 1.0)  # Poisson arrival rates, as fractions of AR's request throughput at the largest batch


def load_rows(settings: EvalSettings, chosen: dict, cost, rules: dict, test_grouped: dict, *, vocab_size: int,
              config=None, seed: int = 0) -> list[dict]:
    """Every policy under load, replayed over the test traces by the batched decoder (``simulate_batch``): at each
    batch size the cost model was profiled at, then with Poisson arrivals at ``LOAD_RATES`` of AR's throughput at the
    largest. Empty when the cost model has no batch curves (``collect.profile.batch_sizes``) or the traces were
    sampled (the batched replay is exact for greedy traces and has no expected-value form). Ratios: against AR and
    against the best static k of the same load (k = 0 included)."""
    import numpy as np

    from sacpolicy.traces.draws import is_sampled
    from sacpolicy.traces.simulate import simulate_batch

    if not cost.batch or not test_grouped or any(is_sampled(p) for p in test_grouped.values()):
        return []
    make = policy_factories(settings, chosen, cost, rules, live=False)
    names = [n for n in make if n in LOAD_POLICIES or n.startswith(("static-k", "learned-"))]
    top = max(cost.batch_sizes)

    def row(load, name, res):
        return {"load": load, "policy": name, "tokens_per_s": res.tokens_per_s,
                "tokens_per_call": res.tokens / res.target_calls, "p50_s": res.latency_percentile(50),
                "p90_s": res.latency_percentile(90), "p99_s": res.latency_percentile(99)}

    def run(name, B, arrivals=None):
        return simulate_batch(make[name](), test_grouped, cost, vocab_size=vocab_size, max_batch=B,
                              arrivals=arrivals, config=config, load_batch=top)

    by_batch = {(B, n): run(n, B) for B in cost.batch_sizes for n in names}
    rows = [row(f"B={B}", n, res) for (B, n), res in by_batch.items()]
    ar_top = by_batch[top, "ar"]
    capacity = len(ar_top.results) / ar_top.makespan_s  # AR's requests per second at the largest batch
    gaps = np.random.default_rng(seed).exponential(1.0, len(test_grouped))
    for frac in LOAD_RATES:
        arrivals = (np.cumsum(gaps) / (frac * capacity)).tolist()
        rows += [row(f"poisson {frac:g}x", n, run(n, top, arrivals)) for n in names]
    add_load_ratios(rows, "load")
    return rows


def add_load_ratios(rows: list[dict], key: str) -> None:
    """``vs_ar`` and ``vs_best_static`` (the best static k of the same load, k = 0 included) of every row, rows
    grouped by ``key``; each group has an "ar" row and "static-k<N>" rows. Rows of repeated runs (``tokens_per_s_runs``)
    also get the ratios repeat by repeat (repeat r against repeat r of the baseline, run back to back):
    ``vs_ar_runs`` and ``vs_best_static_runs``, whose spread is the machine's noise on the ratio."""
    for load in dict.fromkeys(r[key] for r in rows):
        group = [r for r in rows if r[key] == load]
        ar = next(r for r in group if r["policy"] == "ar")
        best = max((r for r in group if r["policy"] == "ar" or r["policy"].startswith("static-k")),
                   key=lambda r: r["tokens_per_s"])
        for r in group:
            r["vs_ar"] = r["tokens_per_s"] / ar["tokens_per_s"]
            r["vs_best_static"] = r["tokens_per_s"] / best["tokens_per_s"]
            if "tokens_per_s_runs" in r:
                for name, base in (("vs_ar_runs", ar), ("vs_best_static_runs", best)):
                    r[name] = [a / b for a, b in zip(r["tokens_per_s_runs"], base["tokens_per_s_runs"])]


def targets(rows: list[dict], predictors: list[str]) -> dict:
    """The learned policy's figures of merit: tokens/s over best static (live with its 95% interval, and simulated),
    and the share of the gain over best static it captures of the in-sample ceiling's and of the oracle's
    (simulated; None where a row is missing or the ceiling gains nothing)."""
    by = {(r["name"], r["mode"]): r for r in rows}
    out = {}
    for p in predictors:
        name = f"learned-{p}"
        for mode in ("live", "simulated"):
            row = by.get((name, mode), {})
            if row.get("speedup_vs_best_static") is not None:
                out[f"{name}_vs_best_static_{mode}"] = row["speedup_vs_best_static"]
                if mode == "live" and row.get("speedup_vs_best_static_ci"):
                    out[f"{name}_vs_best_static_live_ci"] = row["speedup_vs_best_static_ci"]
        out[f"{name}_in_sample_gain_captured"] = gain_captured(rows, name, f"{name}-in-sample")
        out[f"{name}_oracle_gain_captured"] = gain_captured(rows, name, "oracle")
    return out
