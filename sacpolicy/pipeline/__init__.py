"""Pipeline stages wired together; ``scripts/train.py`` runs ``run(cfg)`` on a composed Hydra config.

Stages (``cfg.stages``, run in order; each reads and writes files in the run directory, one module each):
- ``distill``: distil a draft from the target on the training prompts (``distill/draft``, loadable by transformers);
  later stages add it to the drafters as ``distilled``.
- ``head``: train an EAGLE-3 feature head on the same data (``head/head``); later stages add it as ``feature``.
- ``collect``: profile the cost model (``cost.json``) and collect teacher-forced traces over the train/val/test prompts
  (``traces/tf``).
- ``fit``: train each configured predictor on the traces, tune its decision rule on val traces and save the policy
  artifact (``policies/<predictor>``).
- ``evaluate``: every policy on held-out test prompts, simulated and live (``eval.json``, ``eval.md``, plots).
- ``export``: transformers and vLLM settings for each policy (``export/<predictor>``).
- ``decode``: a quick live comparison of the configured policy with autoregressive decoding (``decode.json``).
- ``refit``: on its own, with ``from_run`` and ``refit.logs``: a candidate fitted on a server's step log, compared with
  the serving policy on held-out logged requests, deployed when no worse (``refit.json``, ``refit.md``; ``refit.py``,
  its parts in ``refit_inputs.py``, ``refit_arms.py``, ``refit_report.py``).

A finished stage leaves ``<stage>.json``; running again in the same directory (``hydra.run.dir=<run dir>``) skips
finished stages and resumes unfinished ones (collection by chunk, distillation from its last checkpoint).
``from_run=<dir>`` reads artifacts this run lacks from an earlier run of the same target. A ``RunContext`` loads the
target, drafters, cost model and traces once for all stages of a run.
"""

from __future__ import annotations

import importlib
import json
import logging
import time
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from sacpolicy.io import write_json
from sacpolicy.pipeline import config  # noqa: F401 (registers the config nodes conf/ extends: config.register)
from sacpolicy.pipeline.context import PipelineError, RunContext, build_policy, eval_settings

logger = logging.getLogger(__name__)

# Each stage's ``run(ctx) -> summary``, as "module:function", imported when the stage runs (so importing the pipeline
# loads no training or evaluation code); STAGES, their order, is this registry's keys.
STAGE_RUNNERS = {
    "distill": "sacpolicy.pipeline.distill:run",
    "head": "sacpolicy.pipeline.head:run",
    "collect": "sacpolicy.pipeline.collect:run",
    "fit": "sacpolicy.pipeline.fit:run",
    "evaluate": "sacpolicy.pipeline.evaluate:run",
    "export": "sacpolicy.pipeline.export:run",
    "decode": "sacpolicy.pipeline.decode:run",
    "refit": "sacpolicy.pipeline.refit:run",
}
STAGES = tuple(STAGE_RUNNERS)
# the stages every rank of a distributed launch runs: training (Lightning DDP / FSDP) and sharded collection
EVERY_RANK = ("distill", "head", "collect")

__all__ = ["EVERY_RANK", "PipelineError", "RunContext", "STAGES", "metric_of", "run", "stage_runner", "validate"]


def stage_runner(stage: str):
    """The function that runs ``stage`` (``STAGE_RUNNERS``)."""
    if stage not in STAGE_RUNNERS:
        raise PipelineError(f"unknown stage {stage!r}; stages are {list(STAGES)} (e.g. stages=[collect,fit])")
    module, function = STAGE_RUNNERS[stage].split(":")
    return getattr(importlib.import_module(module), function)


def validate(cfg: DictConfig) -> None:
    """Fail early, with the fix, on settings that would only break deep inside a stage."""
    unknown = [s for s in cfg.stages if s not in STAGES]
    if unknown:
        raise PipelineError(f"unknown stage(s) {unknown}; stages are {list(STAGES)} (e.g. stages=[collect,fit])")
    device = str(cfg.target.get("device", "auto"))
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise PipelineError(
            f"target {cfg.target.spec} is configured for device={device} but no CUDA GPU is visible; run it on a GPU "
            "machine (GPU presets also need Hub access to download the models), or pick a CPU preset "
            "(experiment=embedded_cpu or experiment=smoke)"
        )
    if cfg.get("policy") is not None:  # its settings alone (the cost model is a stage's): a bad one is named here
        build_policy(cfg.policy)
    k_max = cfg.fit.k_max  # the policies' longest block, under the two other limits (sacpolicy.pipeline.config)
    if "collect" in cfg.stages and k_max > cfg.collect.k_max:
        raise PipelineError(f"fit.k_max={k_max} exceeds collect.k_max={cfg.collect.k_max}, the longest accepted run "
                            "the traces record (longer blocks would replay as rejected); raise collect.k_max or lower "
                            "fit.k_max")
    if {"fit", "evaluate", "refit"} & set(cfg.stages) and k_max > cfg.decoder.k_max:
        raise PipelineError(f"fit.k_max={k_max} exceeds decoder.k_max={cfg.decoder.k_max}, the largest block the "
                            "decoder accepts; raise decoder.k_max or lower fit.k_max")
    if "evaluate" in cfg.stages and cfg.eval.get("live_policies") is not None:
        from sacpolicy.evaluation.evaluate import check_live_policies

        try:
            check_live_policies(eval_settings(cfg), list(cfg.predictor))
        except ValueError as e:
            raise PipelineError(str(e)) from e
    if "refit" in cfg.stages:
        check_refit(cfg)
    if cfg.get("from_run"):
        src = Path(cfg.from_run)
        if not (src / "config.yaml").is_file():
            raise PipelineError(f"from_run={src} is not a sacpolicy run directory (no config.yaml); point it at the "
                                "output directory of an earlier scripts/train.py run")
        old = OmegaConf.load(src / "config.yaml")
        if old.target.spec != cfg.target.spec:
            raise PipelineError(f"from_run={src} was made with target {old.target.spec!r}, this run uses "
                                f"{cfg.target.spec!r}; reuse a run of the same target or drop from_run")


def check_refit(cfg: DictConfig) -> None:
    rs = cfg.refit
    if list(cfg.stages) != ["refit"]:
        raise PipelineError(f"stage refit runs on its own (stages=[refit], not {list(cfg.stages)}): it fits on the "
                            "production traces of refit.logs, not on this run's; run the other stages separately")
    if not rs.logs or not cfg.get("from_run"):
        raise PipelineError("stage refit needs refit.logs=<the step-log directory of scripts/serve.py --log-steps> "
                            "and from_run=<the run whose policy serves> (its cost model and headline policy)")
    if rs.canary_fraction is not None and not (rs.deploy_root and 0.0 < rs.canary_fraction <= 1.0):
        raise PipelineError(f"refit.canary_fraction={rs.canary_fraction} puts an accepted candidate on trial in a "
                            "deploy root: it needs refit.deploy_root=<root> and a fraction in (0, 1]")


def metric_of(outputs: dict) -> float:
    """The number sweeps optimize: the best learned policy's live tokens/s when evaluated, else the decode stage's,
    else a refit's candidate/current ratio on held-out requests."""
    if "evaluate" in outputs:
        rows = json.loads(Path(outputs["evaluate"]["eval"]).read_text())["rows"]
        learned = [r["tokens_per_s"] for r in rows if r["name"].startswith("learned") and r["mode"] == "live"]
        learned = learned or [r["tokens_per_s"] for r in rows if r["name"].startswith("learned")]
        if learned:
            return max(learned)
    if "decode" in outputs:
        return outputs["decode"]["rows"]["policy"]["tokens_per_s"]
    if "refit" in outputs:
        return outputs["refit"]["ratios"]["candidate_vs_current"]["ratio"]
    return float("nan")


def run(cfg: DictConfig) -> dict:
    """Run the configured stages (skipping those this run directory already finished). Returns each stage's summary
    and ``metric``, the number a sweep optimizes.

    Under torchrun or Lightning's DDP launcher every rank runs this: the training stages and collection
    (``EVERY_RANK``) on every rank, each on its own device and share; the other stages, the run's files
    (``config.yaml``, ``<stage>.json``, the tracker) and the report on rank 0 alone, while the other ranks wait for
    its ``<stage>.json`` when a stage of theirs follows, and stop after their last stage otherwise. A stage that
    returns ``partial`` (one shard of a separately launched collection) ends the run without its ``<stage>.json``."""
    from sacpolicy import ranks
    from sacpolicy.pipeline.tracking import SilentTracker, make_tracker

    validate(cfg)
    torch.manual_seed(cfg.seed)
    out_dir = Path(cfg.paths.output_dir)
    rank, started = ranks.current(), time.time()
    if rank.zero:
        out_dir.mkdir(parents=True, exist_ok=True)
        OmegaConf.save(cfg, out_dir / "config.yaml", resolve=False)
        tracker = make_tracker(cfg.get("tracker"), out_dir, OmegaConf.to_container(cfg, resolve=False))
    else:
        tracker = SilentTracker()
    ctx = RunContext(cfg, out_dir, tracker)
    stages = list(cfg.stages)
    if not rank.zero:  # the stages after the last of EVERY_RANK are rank 0's alone
        stages = stages[: max((i + 1 for i, s in enumerate(stages) if s in EVERY_RANK), default=0)]
    outputs: dict = {}
    try:
        for stage in stages:
            done = out_dir / f"{stage}.json"
            if not rank.zero and stage not in EVERY_RANK:
                logger.info("rank %d: stage %s runs on rank 0; waiting for %s", rank.rank, stage, done)
                ranks.wait_for(done, out_dir / f"{stage}.failed", since=started)
            if done.exists():
                logger.info("stage %s already finished in %s: skipped (delete %s to rerun it)", stage, out_dir, done)
                outputs[stage] = json.loads(done.read_text())
                continue
            outputs[stage] = _run_stage(ctx, stage, rank.zero)
            if outputs[stage].get("partial"):
                logger.warning("stage %s did its part (%s); the run goes on once the rest is done: %s", stage,
                               outputs[stage].get("shard"), outputs[stage])
                break
        outputs["metric"] = metric_of(outputs)
        if "evaluate" in outputs and rank.zero:
            from sacpolicy.pipeline.report import write_run_report

            outputs["report"] = str(write_run_report(cfg, out_dir, outputs))
        tracker.summary({"metric": outputs["metric"]})
    finally:
        tracker.finish()
    return outputs


def _run_stage(ctx: RunContext, stage: str, writes: bool) -> dict:
    """Run one stage; ``writes``: leave its ``<stage>.json`` (rank 0), or ``<stage>.failed`` with the error, which
    the ranks waiting for it raise."""
    from sacpolicy.io import write_text

    t0 = time.perf_counter()
    logger.info("stage %s", stage)
    try:
        summary = stage_runner(stage)(ctx)
    except BaseException as exc:
        if writes:
            write_text(ctx.out_dir / f"{stage}.failed", f"{type(exc).__name__}: {exc}")
        raise
    summary["stage_s"] = time.perf_counter() - t0
    if writes and not summary.get("partial"):
        write_json(ctx.out_dir / f"{stage}.json", summary)
        ctx.tracker.log({"seconds": summary["stage_s"]}, stage)
    logger.info("stage %s done in %.1fs", stage, summary["stage_s"])
    return summary
