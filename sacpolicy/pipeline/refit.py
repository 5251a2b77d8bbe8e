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

The stage is this module (``run``: the steps above; ``current_policy``, ``decide``, ``deploy_candidate``); what it
reads is ``refit_inputs``, its arms on the held-out requests ``refit_arms``, its report ``refit_report``.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import numpy as np

from sacpolicy.pipeline import served_check
from sacpolicy.pipeline.context import SPLITS, PipelineError, RunContext, RunTraces, command

# The stage's parts, by job (its inputs, its arms on the held-out requests, its report), called through this module's
# names: ``run`` looks them up here, so a test that patches ``refit.decode_live`` (say) reaches the stage.
from sacpolicy.pipeline.refit_arms import ARMS, check_live, compare, decode_live, replay, tokens_per_s
from sacpolicy.pipeline.refit_inputs import logged_requests, production_traces, run_traces, split_requests
from sacpolicy.pipeline.refit_report import track, write_report

logger = logging.getLogger(__name__)


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
                     "tokens_per_s": {arm: tokens_per_s(live_per[arm]) for arm in ARMS},
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
                     "tokens_per_s": {arm: tokens_per_s(per[arm]) for arm in (*ARMS, "oracle")},
                     "per_request": {"request": list(test), "tokens": per["candidate"]["tokens"],
                                     "seconds": {arm: per[arm]["seconds"] for arm in (*ARMS, "oracle")}}},
        "ratios": ratios, "live": live_part, "served_check": served, "threshold": rs.threshold, "level": rs.level,
        "resamples": rs.resamples, "accepted": accepted, "decision": decision,
    }
    summary["deployed"] = deploy_candidate(rs, candidate_path) if accepted else None
    summary["report_md"] = str(write_report(ctx.out_dir / "refit.md", summary))
    track(ctx.tracker, summary)
    return summary



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

