"""Stage ``refit``: the production loop's decision. A candidate policy fitted on what a server logged, compared with
the policy that serves it on held-out requests of the same log (replayed, then a few served in vLLM), and deployed
only when it is no worse.

    python scripts/train.py stages=[refit] from_run=outputs/<run> refit.logs=<step-log dir>
    ... refit.deploy_root=deploy/root   # deploy it when accepted (and refit.canary_fraction=0.1: on trial)

1. The step log (``scripts/serve.py --log-steps``) becomes production traces (``traces.production``) in
   ``traces/production/{live,tf}`` of this run (``refit.target_pass=true``: the run's target computes beta and
   p_target over the logged sequences, which sampled requests need; ``refit.select``: one sampling setting of a log
   of several; ``refit.skip_corrupt=true``: damaged shards left out, counted); its requests are split by their
   prompt's hash into train / val / test (``data.splits.assign_split``, ``refit.fractions``), so no request is in two
   splits.
2. Every configured predictor is fitted as stage ``fit`` fits it (``fit.fit_policy``: the same examples, rule tuning
   on the val requests, the best static on them as fallback), with from_run's cost model (``cost.json``);
   ``refit.include_run_traces=true`` adds from_run's train-split traces of the served drafters to the fit examples.
   The candidate is the predictor with the lowest validation log-loss (``policies/<predictor>``).
3. The candidate, the current policy (``refit.policy``, else the deploy root's ``current``, else from_run's headline)
   and the best static (drafter, k) of the val requests are replayed over the held-out test requests as the server
   ran them (``traces.served_replay.served_config``; ``traces.simulate``, as evaluation replays): simulated seconds of
   the cost model, per request. The paired bootstrap over those requests (``evaluation.intervals``) gives each ratio's
   interval; the candidate passes when the lower end of its interval against the current policy is at least
   ``refit.threshold``. The oracle over the served drafters (``traces.simulate.Oracle``) is replayed beside them:
   its ratio to the best static is the headroom any refit has on that workload.
4. The served check (``sacpolicy.pipeline.served_check``; on by default, ``refit.served_check_requests`` held-out
   requests): a candidate that passed is served, with the current policy, through a real vLLM engine (each request's
   logged prompt; the engines of the two arms in the order candidate, current, current, candidate, so a machine's
   drift hits both), and is accepted only if its measured tokens/s is not below the current's beyond noise (the
   upper end of the paired interval at least ``refit.served_check_threshold``): a cost model's simulated seconds can
   miss what only the engine pays for. Without vLLM a refit with the check on refuses before fitting, naming the fix
   (install it, or ``refit.served_check_requests=0``: the simulation alone decides).
5. ``refit.json`` (this stage's summary: sizes, split, ratios, the served check, decision, paths, per-request figures)
   and ``refit.md`` (the ratio tables, the served check's time per output token and ratio, the decision); the tracker
   logs the ratios (``refit/...``). An accepted candidate is deployed to ``refit.deploy_root`` (``export.deploy``)
   when one is given.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import numpy as np

from sacpolicy.io import write_text
from sacpolicy.pipeline import served_check
from sacpolicy.pipeline.context import SPLITS, PipelineError, RunContext, RunTraces, command

logger = logging.getLogger(__name__)

TRACES = "traces/production"  # production traces of the log, in the refit run's directory
ARMS = ("candidate", "current", "best-static")


class RefitContext(RunContext):
    """The run's context with the production traces (and any mixed-in run traces) in place of collected ones, so the
    fit stage's code (examples, rule tuning, best static) reads them unchanged."""

    def __init__(self, ctx: RunContext, traces: RunTraces):
        super().__init__(ctx.cfg, ctx.out_dir, ctx.tracker)
        self.traces = traces


def run(ctx: RunContext) -> dict:
    from sacpolicy.evaluation.evaluate import headline_predictor
    from sacpolicy.pipeline.fit import examples, fit_policy
    from sacpolicy.traces.schema import trace_sampling
    from sacpolicy.traces.steplog_read import logged_drafters

    cfg, rs = ctx.cfg, ctx.cfg.refit
    current_path = current_policy(ctx)  # resolved before this run writes policies of its own
    meta, tf_dir = production_traces(ctx)
    log = meta["log"]
    if rs.live_requests > 0:  # refused before minutes of fitting
        check_live(rs, meta)
    grouped, by_split, split_of = split_requests(ctx, tf_dir, meta)
    model_dir = served_check.prepare(cfg.target.spec, rs) if rs.served_check_requests > 0 else None  # before fitting
    specs = logged_drafters(meta)  # the drafters the server ran
    mixed = run_traces(ctx, list(specs), set(grouped), meta["sampling"]) if rs.include_run_traces else {}
    fit_grouped = {**grouped, **mixed}
    rctx = RefitContext(ctx, RunTraces(fit_grouped, {**by_split, "train": {**by_split["train"], **mixed}}, tf_dir,
                                       meta))
    ex = examples(rctx)
    ex = dataclasses.replace(ex, split=np.array([split_of.get(p, "train") for p in ex.prompt_id]))
    static = rctx.best_static()
    provenance = {"target": cfg.target.spec, "traces": str(tf_dir), "logs": str(Path(rs.logs).resolve()),
                  "from_run": str(Path(cfg.from_run).resolve()), "command": command()}
    fitted = {name: fit_policy(rctx, name, ex, static, specs, provenance) for name in cfg.predictor}
    name = headline_predictor({n: p["metrics"] for n, p in fitted.items()})
    candidate_path = ctx.out_dir / "policies" / name
    test = by_split["test"]
    per = {arm: replay(rctx, policy, test, log, list(specs))
           for arm, policy in (("candidate", candidate_path), ("current", current_path), ("best-static", static),
                               ("oracle", "oracle"))}
    ratios = compare(per, seed=cfg.seed, resamples=rs.resamples, level=rs.level)
    live_part = None
    if rs.live_requests > 0:
        arms = {"candidate": candidate_path, "current": current_path, "best-static": static}
        live_per, agree = decode_live(ctx, arms, list(test)[: rs.live_requests], list(specs.values()),
                                     int(log["k_cap"]), int(log["max_model_len"]), rs.live_repeats)
        live_part = {"requests": len(live_per["candidate"]["tokens"]), **agree,
                     "mode": f"live: our decoder, prompt by prompt with the arms in turn, to the served lengths, the "
                             f"fastest of {rs.live_repeats} repeats",
                     "tokens_per_s": {arm: _tps(live_per[arm]) for arm in ARMS},
                     "ratios": compare(live_per, seed=cfg.seed, resamples=rs.resamples, level=rs.level),
                     "per_request": {arm: live_per[arm] for arm in ARMS}}
    simulated = ratios["candidate_vs_current"]["ci"][0] >= rs.threshold
    served = None if model_dir is None else {"skipped": "the simulated comparison rejected the candidate"}
    if model_dir is not None and simulated:  # the held-out requests' logged prompts, served by both policies
        reqs = logged_requests(ctx)
        served = served_check.served_check(model_dir, {"candidate": candidate_path, "current": current_path},
                                           {rid: reqs[rid] for rid in list(test)[: rs.served_check_requests]},
                                           log=log, sampling=trace_sampling(meta), rs=rs, seed=cfg.seed)
    accepted, decision = decide(ratios, served, rs)
    summary = {
        "logs": provenance["logs"], "from_run": provenance["from_run"], "traces": str(tf_dir.parent),
        "requests": {k: log[k] for k in ("requests", "incomplete", "dropped", "shards", "corrupt_shards", "policies")},
        "split": {"fractions": dict(rs.fractions), **{s: len(by_split[s]) for s in SPLITS},
                  "requests": {s: sorted(by_split[s]) for s in SPLITS}},
        "run_traces": {"included": bool(rs.include_run_traces), "prompts": len(mixed)},
        "examples": {s: int((ex.split == s).sum()) for s in SPLITS},
        "candidate": {"predictor": name, "path": str(candidate_path), "predictors": fitted},
        "current": {"path": str(current_path)},
        "best_static": {**static, "chosen_on": "val requests"},
        "held_out": {"requests": len(test), "tokens": int(sum(per["candidate"]["tokens"])),
                     "mode": "simulated: replayed over the logged sequences, seconds from from_run's cost model",
                     "tokens_per_s": {arm: _tps(per[arm]) for arm in (*ARMS, "oracle")},
                     "per_request": {"request": list(test), "tokens": per["candidate"]["tokens"],
                                     "seconds": {arm: per[arm]["seconds"] for arm in (*ARMS, "oracle")}}},
        "ratios": ratios, "live": live_part, "served_check": served, "threshold": rs.threshold, "level": rs.level,
        "resamples": rs.resamples, "accepted": accepted, "decision": decision,
    }
    summary["deployed"] = deploy_candidate(rs, candidate_path) if accepted else None
    summary["report_md"] = str(write_report(ctx.out_dir / "refit.md", summary))
    track(ctx.tracker, summary)
    return summary


# ---------------------------------------------------------------------- inputs
def current_policy(ctx: RunContext) -> Path:
    """The policy directory the candidate is compared with: ``refit.policy`` (an artifact, a vLLM export or a deploy
    root), else ``refit.deploy_root``'s current version, else from_run's headline (``fit.json``)."""
    import json

    from sacpolicy.export.reload import is_deploy_root, live_policy_dir

    rs, src = ctx.cfg.refit, Path(ctx.cfg.from_run)
    path = rs.policy or (rs.deploy_root if rs.deploy_root and is_deploy_root(rs.deploy_root) else None)
    if path is None:
        fit = src / "fit.json"
        if not fit.is_file():
            raise PipelineError(f"from_run={src} has no fit.json, so no headline policy to compare the candidate with; "
                                "pass refit.policy=<the serving policy: artifact, vLLM export or deploy root>")
        path = src / "policies" / json.loads(fit.read_text())["headline"]
    path = live_policy_dir(path)
    if (path / "vllm.env").is_file() and (path / "policy").is_dir():  # a vLLM export (or a deploy version)
        path = path / "policy"
    if not (path / "policy.json").is_file():
        raise PipelineError(f"{path} is not a policy artifact (no policy.json); set refit.policy to a policy "
                            "directory (policies/<predictor>), a vLLM export or a deploy root")
    return path


def log_meta(logs) -> dict | None:
    """The provenance the log's first readable shard records (``traces.steplog_read.read_step_log``'s meta); None
    without one (reading the log then names the problem and the fix)."""
    import pyarrow.parquet as pq

    from sacpolicy.traces.logformat import shard_files, shard_meta

    for path in shard_files(logs):
        try:
            return shard_meta(path, pq.read_schema(path))
        except (OSError, ValueError):  # damaged (pyarrow's ArrowInvalid and StepLogError are ValueErrors)
            continue
    return None


def production_traces(ctx: RunContext) -> tuple[dict, Path]:
    """(meta, tf dir) of the production traces built from ``refit.logs`` into this run (refusing, with the fix, logs
    of another target than the run's and a k cap below ``fit.k_max``)."""
    from sacpolicy.traces.logformat import StepLogError
    from sacpolicy.traces.production import build_production_traces
    from sacpolicy.traces.schema import read_meta

    cfg, logs = ctx.cfg, Path(ctx.cfg.refit.logs)
    first = log_meta(logs)
    theirs = first["target"].get("target") if first else None
    if theirs is not None and theirs != cfg.target.spec:
        raise PipelineError(f"refit.logs={logs} was logged serving target {theirs!r}, but from_run and this run use "
                            f"{cfg.target.spec!r}: a policy refits on its own target's logs. Point refit.logs at logs "
                            f"of {cfg.target.spec!r}, or from_run at a run of {theirs!r} (and target= to match)")
    out = ctx.out_dir / TRACES
    rs = cfg.refit
    select = None if rs.select is None else dict(rs.select)
    try:
        meta = build_production_traces(logs, out, target=ctx.target if rs.target_pass else cfg.target.spec,
                                       select=select, skip_corrupt=rs.skip_corrupt)
    except StepLogError as e:
        raise PipelineError(f"refit.logs={logs}: {e}") from e
    k_cap = int(meta["log"]["k_cap"])
    if cfg.fit.k_max > k_cap:
        raise PipelineError(f"fit.k_max={cfg.fit.k_max} exceeds the k cap {k_cap} of the server that logged "
                            f"{logs} (its traces record no longer accepted run, and a deploy root refuses a policy "
                            f"above its cap); set fit.k_max={k_cap}")
    served = log_meta(logs)
    return {**read_meta(out / "tf"), "drafter": served["drafter"], "drafters": served.get("drafters")}, out / "tf"


def split_requests(ctx: RunContext, tf_dir: Path, meta: dict) -> tuple[dict, dict, dict]:
    """(grouped, {split: grouped}, {request: split}) of the production traces: each request's split from its prompt
    (``assign_split`` of ``traces.production.prompt_key``, ``refit.fractions``: the same prompt served twice lands in
    one split, and a split does not depend on the server run's log ids); refused when a split has fewer than
    ``refit.min_requests``."""
    from sacpolicy.data.splits import SplitError, assign_split
    from sacpolicy.traces.schema import load_traces
    from sacpolicy.traces.simulate import group_traces

    rs = ctx.cfg.refit
    fractions = dict(rs.fractions)
    grouped = group_traces(load_traces(tf_dir, kind="teacher_forced", target=ctx.cfg.target.spec), meta)
    try:
        split_of = {rid: assign_split(meta["log"]["prompts"][rid], fractions) for rid in grouped}
    except SplitError as e:
        raise PipelineError(f"refit.fractions: {e}") from e
    by_split = {s: {rid: grouped[rid] for rid in sorted(grouped) if split_of[rid] == s} for s in SPLITS}
    sizes = {s: len(g) for s, g in by_split.items()}
    if set(fractions) != set(SPLITS) or min(sizes.values()) < rs.min_requests:
        raise PipelineError(f"the log's {len(grouped)} complete requests split into {sizes} (refit.fractions="
                            f"{fractions}); a refit needs at least refit.min_requests={rs.min_requests} in each of "
                            f"{list(SPLITS)} to fit, tune and compare on. Log more requests (serve longer, or a "
                            "higher --log-rate) or adjust refit.fractions")
    return grouped, by_split, split_of


def run_traces(ctx: RunContext, drafters: list[str], taken: set, sampling: dict) -> dict:
    """from_run's train-split traces of the served ``drafters`` (grouped, those drafters only), for the fit examples;
    refused unless they were decoded at the production traces' ``sampling`` (their labels differ otherwise)."""
    from sacpolicy.data.splits import assign_split
    from sacpolicy.traces.schema import load_traces, read_meta, trace_sampling
    from sacpolicy.traces.simulate import group_traces

    tf_dir = ctx.need("traces/tf", "refit")
    meta = read_meta(tf_dir)
    theirs, ours = trace_sampling(meta), trace_sampling({"sampling": sampling})
    if theirs != ours:
        raise PipelineError(f"{tf_dir} holds traces decoded at {theirs}, the production ones at {ours}: their labels "
                            "differ; refit without them (refit.include_run_traces=false), or on logs served at "
                            f"{theirs} (refit.select)")
    grouped = group_traces(load_traces(tf_dir, kind="teacher_forced", target=ctx.cfg.target.spec), meta)
    out = {pid: {**p, "drafters": {d: p["drafters"][d] for d in drafters}} for pid, p in grouped.items()
           if assign_split(pid) == "train" and all(d in p["drafters"] for d in drafters)}
    if not out:
        raise PipelineError(f"{tf_dir} holds no train traces of the served drafters {drafters}; collect them with "
                            f"draft=[{','.join(drafters)}] or refit without them (refit.include_run_traces=false)")
    if taken & set(out):
        raise PipelineError(f"request ids {sorted(taken & set(out))[:3]} of the log are also prompt ids of {tf_dir}")
    return out


# ---------------------------------------------------------------------- the comparison
def replay(ctx: RunContext, policy, test: dict, log: dict, drafters: list[str]) -> dict:
    """{"tokens", "seconds"} per held-out request (``test``'s order) of ``policy`` (a policy directory, replayed as
    the server runs it: ``served_config``; a best-static {"drafter", "k"}; or "oracle": ``traces.simulate.Oracle`` over
    the served drafters, the ceiling any policy reaches on them), seconds from the run's cost model."""
    from sacpolicy.decoding import DecoderConfig
    from sacpolicy.policy import Static
    from sacpolicy.policy.learned import LearnedPolicy
    from sacpolicy.runtime.artifact import load_artifact
    from sacpolicy.traces.served_replay import served_config
    from sacpolicy.traces.simulate import Oracle, simulate

    k_cap = int(log["k_cap"])
    if isinstance(policy, dict):
        pol, config = Static(int(policy["k"]), policy["drafter"]), DecoderConfig(k_max=k_cap)
    elif policy == "oracle":  # the ceiling: the served drafters' accepted runs known in advance
        pol, config = Oracle(ctx.cost, k_max=k_cap), DecoderConfig(k_max=k_cap)
    else:
        rule = load_artifact(policy).rule
        pol, config = LearnedPolicy(rule), served_config(rule, k_cap, int(log["max_model_len"]))
    sim = simulate(pol, test, ctx.cost, vocab_size=ctx.vocab_size, config=config, drafters=drafters)
    return {"tokens": [len(out.tokens) for _, out in sim.results],
            "seconds": [float(out.total_s) for _, out in sim.results]}


def check_live(rs, meta: dict) -> None:
    """Refuse live arms the log cannot support: no repeat, or a sampled log (the live arms decode greedily)."""
    if rs.live_repeats < 1:
        raise PipelineError(f"refit.live_repeats={rs.live_repeats}: each live request needs at least one "
                            "decode per arm; set refit.live_repeats=1 or more")
    if float((meta.get("sampling") or {}).get("temperature") or 0.0) > 0:
        raise PipelineError("refit.live_requests decodes the held-out requests greedily, but this log's requests "
                            f"were sampled ({meta['sampling']}); set refit.live_requests=0 (the simulated "
                            "comparison covers sampled logs)")


def decode_live(ctx: RunContext, arms: dict, ids: list, specs: list, k_cap: int, max_model_len: int,
                repeats: int = 1) -> tuple[dict, dict]:
    """({arm: {"tokens", "seconds"}}, agreement) of each arm (a policy directory or a best static {"drafter", "k"})
    decoding the held-out requests ``ids`` live in our decoder with the served drafters (``specs``, ``DrafterSpec``s,
    built by ``build.build_drafters``, fresh per arm; a suffix drafter's global index grows with the arm's own
    outputs, request by request, and every repeat of a request starts from the index as it stood before the request,
    so no repeat reads its own answer): each request's logged prompt,
    to the length the server generated, prompt by prompt with the arms in turn (machine noise hits all alike), after
    one warm-up generation each; wall seconds per request, the fastest of ``repeats`` (a shared machine's stalls hit
    one repeat, not all). Greedy: every arm must emit the same tokens (lossless;
    otherwise an error), and ``agreement`` counts the requests whose tokens equal what the server logged (vLLM's
    kernels may round differently: reported, not required) and, per arm, the requests that dropped a drafter (it
    raised, and the arm decoded on without it: ``dropped_drafters``, {arm: {drafter: requests}})."""
    import time

    from sacpolicy.build import build_drafters
    from sacpolicy.decoding import DecoderConfig, SpeculativeDecoder
    from sacpolicy.evaluation.metrics import dropped_counts
    from sacpolicy.policy import Static
    from sacpolicy.policy.learned import LearnedPolicy
    from sacpolicy.runtime.artifact import load_artifact
    from sacpolicy.traces.served_replay import served_config

    reqs = logged_requests(ctx)
    target = ctx.target

    def decoder(policy):  # each arm as the server runs it (served_config: the server's k cap and room), as replay does
        if isinstance(policy, dict):
            pol, config = Static(int(policy["k"]), policy["drafter"]), DecoderConfig(k_max=k_cap)
        else:
            rule = load_artifact(policy).rule
            pol, config = LearnedPolicy(rule), served_config(rule, k_cap, int(max_model_len))
        return SpeculativeDecoder(target.model, build_drafters(specs, target), pol, config=config,
                                  stop_token_ids=target.eos_token_ids)

    decoders = {arm: decoder(p) for arm, p in arms.items()}
    first = reqs[ids[0]]
    for dec in decoders.values():  # first calls pay for lazy initialisation
        dec.generate(first["tokens"][: first["prompt_len"]], 8)
    per = {arm: {"tokens": [], "seconds": []} for arm in arms}
    lost = {arm: [] for arm in arms}  # per request, the drafters it dropped in any repeat
    same_as_logged = 0
    for rid in ids:
        req = reqs[rid]
        prompt, served = req["tokens"][: req["prompt_len"]], req["tokens"][req["prompt_len"]:]
        outs, best, dropped = {}, dict.fromkeys(decoders, float("inf")), {arm: set() for arm in decoders}
        before = {arm: _learned(dec) for arm, dec in decoders.items()}
        for r in range(repeats):  # arms in turn, the order reversed every repeat (ABC CBA ...)
            for arm in (list(decoders) if r % 2 == 0 else list(decoders)[::-1]):
                if r:
                    _restore(decoders[arm], before[arm])
                t0 = time.perf_counter()
                res = decoders[arm].generate(prompt, len(served))
                best[arm] = min(best[arm], time.perf_counter() - t0)
                outs[arm] = res.tokens
                dropped[arm].update(res.dropped_drafters)
        for arm in decoders:
            per[arm]["seconds"].append(best[arm])
            per[arm]["tokens"].append(len(outs[arm]))
            lost[arm].append(dropped[arm])
        if len({tuple(t) for t in outs.values()}) != 1:
            raise PipelineError(f"request {rid}: the arms decoded different tokens greedily ({outs}); speculation "
                                "must not change the output: this is a decoder bug")
        same_as_logged += outs["candidate"] == served[: len(outs["candidate"])]
    return per, {"identical_across_arms": len(ids), "same_as_logged": int(same_as_logged),
                 "dropped_drafters": {arm: dropped_counts(lost[arm]) for arm in arms}}


def logged_requests(ctx: RunContext) -> dict:
    """{log id: {"prompt_len", "tokens", "steps"}} of ``refit.logs``' complete requests (``requests_of``): the prompts
    and served lengths the live arms and the served check run again."""
    from sacpolicy.traces.steplog_read import read_step_log, requests_of

    rs = ctx.cfg.refit
    return requests_of(read_step_log(rs.logs, target=ctx.cfg.target.spec, skip_corrupt=rs.skip_corrupt)[0])[0]


def _learned(decoder) -> dict:
    """What ``decoder``'s drafters learned from earlier requests (a suffix drafter's global index), copied."""
    import copy

    from sacpolicy.decoding.protocols import Resettable

    return {name: copy.deepcopy(d.index) for name, d in decoder.drafters.items() if isinstance(d, Resettable)}


def _restore(decoder, learned: dict) -> None:
    import copy

    for name, index in learned.items():
        decoder.drafters[name].index = copy.deepcopy(index)


def compare(per: dict, *, seed: int, resamples: int, level: float) -> dict:
    """The candidate's tokens/s over the current policy's and over the best static's, the current's over the best
    static's and, where ``per`` has it, the oracle's over the best static's (the headroom the served drafters leave),
    each with a paired bootstrap interval over the held-out requests (one draw for all)."""
    from sacpolicy.evaluation.intervals import bootstrap_indices, paired_ratio_interval

    idx = bootstrap_indices(len(per["candidate"]["tokens"]), resamples=resamples, seed=seed)
    out = {}
    for a, b in (("candidate", "current"), ("candidate", "best-static"), ("current", "best-static"),
                 ("oracle", "best-static")):
        if a not in per:  # the oracle: simulated arms only
            continue
        lo, hi = paired_ratio_interval(per[a]["tokens"], per[a]["seconds"], per[b]["tokens"], per[b]["seconds"],
                                       idx=idx, level=level)
        out[f"{a}_vs_{b}".replace("-", "_")] = {"ratio": _tps(per[a]) / _tps(per[b]), "ci": [lo, hi]}
    return out


def _tps(arm: dict) -> float:
    return sum(arm["tokens"]) / sum(arm["seconds"])


def decide(ratios: dict, served: dict | None, rs) -> tuple[bool, str]:
    """(accepted, the decision's sentence): the simulated candidate/current interval's lower end at least
    ``refit.threshold`` and, where the served check ran (``served``: ``served_check.served_check``'s summary; None:
    off), the candidate not slower there beyond noise (``served["accepted"]``)."""
    lo = ratios["candidate_vs_current"]["ci"][0]
    if lo < rs.threshold:
        return False, (f"rejected: the lower end of the candidate/current interval is below {rs.threshold}; the "
                       "current policy keeps serving")
    simulated = f"the lower end of the candidate/current interval is at least {rs.threshold}"
    if served is None:
        return True, f"accepted: {simulated} (no served check: refit.served_check_requests=0)"
    hi = served["ci"][1]
    if not served["accepted"]:
        return False, (f"rejected: {simulated} in the simulation, but served in vLLM the candidate was slower than the "
                       f"current policy beyond noise (candidate/current {served['ratio']:.3f}, interval upper end "
                       f"{hi:.3f} below refit.served_check_threshold={served['threshold']}); the current policy keeps "
                       "serving")
    return True, (f"accepted: {simulated}, and served in vLLM the candidate was not slower (candidate/current "
                  f"{served['ratio']:.3f}, interval upper end {hi:.3f} at least {served['threshold']})")


# ---------------------------------------------------------------------- outputs
def deploy_candidate(rs, candidate: Path) -> dict | None:
    """An accepted candidate written to ``refit.deploy_root`` as ``current``, or as ``candidate`` on trial for
    ``refit.canary_fraction`` of requests; None without a deploy root."""
    from sacpolicy.export.deploy import deploy
    from sacpolicy.runtime.artifact import ArtifactError

    if not rs.deploy_root:
        return None
    canary = rs.canary_fraction is not None
    try:
        version = deploy(candidate, rs.deploy_root, candidate=canary, fraction=rs.canary_fraction)
    except ArtifactError as e:
        raise PipelineError(f"the candidate was accepted but not deployed to refit.deploy_root={rs.deploy_root}: "
                            f"{e}") from e
    logger.info("deployed the candidate as %s of %s: %s", "candidate" if canary else "current", rs.deploy_root,
                version.name)
    return {"root": str(Path(rs.deploy_root).resolve()), "version": version.name,
            "as": "candidate" if canary else "current", "canary_fraction": rs.canary_fraction}


def write_report(path: Path, s: dict) -> Path:
    from sacpolicy.evaluation.metrics import dropped_text

    req, split, held, best = s["requests"], s["split"], s["held_out"], s["best_static"]
    lines = [
        f"# Refit: {s['decision'].split(':')[0]}", "",
        (f"- logs: `{s['logs']}` ({req['requests']} complete requests, {req['incomplete']} incomplete, "
         f"{req['dropped']} steps dropped, {req['corrupt_shards']} damaged shards skipped); from_run: "
         f"`{s['from_run']}`"),
        (f"- split by request: train {split['train']}, val {split['val']}, test {split['test']} (fractions "
         f"{split['fractions']}); run traces mixed in: {s['run_traces']['prompts']} prompts"),
        (f"- candidate: `{s['candidate']['path']}` ({s['candidate']['predictor']}); current: `{s['current']['path']}`; "
         f"best static on val requests: {best['drafter']} k={best['k']}"),
        f"- held-out requests: {held['requests']} ({held['tokens']} tokens), {held['mode']}", "",
        f"| ratio | value | {100 * s['level']:g}% interval (paired bootstrap over held-out requests) |",
        "|---|---:|---|"]
    for key, r in s["ratios"].items():
        lines.append(f"| {key.replace('_vs_', ' / ')} | {r['ratio']:.3f} | [{r['ci'][0]:.3f}, {r['ci'][1]:.3f}] |")
    live = s.get("live")
    if live:
        lines += ["", f"Live: {live['requests']} held-out requests, {live['mode']}; identical across arms: "
                      f"{live['identical_across_arms']}, same as the server logged: {live['same_as_logged']}", "",
                  "| ratio (live) | value | interval |", "|---|---:|---|"]
        for key, r in live["ratios"].items():
            lines.append(f"| {key.replace('_vs_', ' / ')} | {r['ratio']:.3f} | [{r['ci'][0]:.3f}, {r['ci'][1]:.3f}] |")
        dropped = [f"{arm}: {dropped_text(d, live['requests'])}" for arm, d in live["dropped_drafters"].items() if d]
        if dropped:
            lines += ["", ("Drafters dropped in the live arms (they raised; those requests were decoded and timed "
                           f"without them): {'; '.join(dropped)}")]
    if s.get("served_check"):
        lines += served_check.report_lines(s["served_check"])
    lines += ["", f"Decision: {s['decision']} (threshold {s['threshold']}).", ""]
    if s["deployed"]:
        d = s["deployed"]
        lines.append(f"Deployed to `{d['root']}` as {d['as']}: version `{d['version']}`.")
    write_text(path, "\n".join(lines) + "\n")
    return path


def track(tracker, s: dict) -> None:
    metrics = {f"tokens_per_s_{arm.replace('-', '_')}": v for arm, v in s["held_out"]["tokens_per_s"].items()}
    for key, r in s["ratios"].items():
        metrics.update({key: r["ratio"], f"{key}_lo": r["ci"][0], f"{key}_hi": r["ci"][1]})
    for key, r in ((s.get("live") or {}).get("ratios") or {}).items():
        metrics.update({f"live_{key}": r["ratio"], f"live_{key}_lo": r["ci"][0], f"live_{key}_hi": r["ci"][1]})
    served = s.get("served_check") or {}
    if "ratio" in served:
        metrics.update({"served_candidate_vs_current": served["ratio"], "served_candidate_vs_current_lo":
                        served["ci"][0], "served_candidate_vs_current_hi": served["ci"][1]})
    metrics.update({"accepted": int(s["accepted"]), "held_out_requests": s["held_out"]["requests"],
                    **{f"{k}_requests": s["split"][k] for k in SPLITS}})
    tracker.log(metrics, "refit")
    tracker.table("refit/ratios", [{"ratio": k, "value": r["ratio"], "lo": r["ci"][0], "hi": r["ci"][1]}
                                   for k, r in s["ratios"].items()])
    tracker.bar("refit/tokens_per_s", s["held_out"]["tokens_per_s"], value="tokens_per_s",
                title="tokens/s on held-out requests (simulated)")
