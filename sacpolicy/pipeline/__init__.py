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
from sacpolicy.pipeline.context import PipelineError, RunContext, eval_settings

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
}
STAGES = tuple(STAGE_RUNNERS)

__all__ = ["PipelineError", "RunContext", "STAGES", "metric_of", "run", "stage_runner", "validate"]


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
    k_max = cfg.fit.k_max  # the policies' longest block, under the two other limits (sacpolicy.pipeline.config)
    if "collect" in cfg.stages and k_max > cfg.collect.k_max:
        raise PipelineError(f"fit.k_max={k_max} exceeds collect.k_max={cfg.collect.k_max}, the longest accepted run "
                            "the traces record (longer blocks would replay as rejected); raise collect.k_max or lower "
                            "fit.k_max")
    if {"fit", "evaluate"} & set(cfg.stages) and k_max > cfg.decoder.k_max:
        raise PipelineError(f"fit.k_max={k_max} exceeds decoder.k_max={cfg.decoder.k_max}, the largest block the "
                            "decoder accepts; raise decoder.k_max or lower fit.k_max")
    if "evaluate" in cfg.stages and cfg.eval.get("live_policies") is not None:
        from sacpolicy.evaluation.evaluate import check_live_policies

        try:
            check_live_policies(eval_settings(cfg), list(cfg.predictor))
        except ValueError as e:
            raise PipelineError(str(e)) from e
    if cfg.get("from_run"):
        src = Path(cfg.from_run)
        if not (src / "config.yaml").is_file():
            raise PipelineError(f"from_run={src} is not a sacpolicy run directory (no config.yaml); point it at the "
                                "output directory of an earlier scripts/train.py run")
        old = OmegaConf.load(src / "config.yaml")
        if old.target.spec != cfg.target.spec:
            raise PipelineError(f"from_run={src} was made with target {old.target.spec!r}, this run uses "
                                f"{cfg.target.spec!r}; reuse a run of the same target or drop from_run")


def metric_of(outputs: dict) -> float:
    """The number sweeps optimize: the best learned policy's live tokens/s when evaluated, else the decode stage's."""
    if "evaluate" in outputs:
        rows = json.loads(Path(outputs["evaluate"]["eval"]).read_text())["rows"]
        learned = [r["tokens_per_s"] for r in rows if r["name"].startswith("learned") and r["mode"] == "live"]
        learned = learned or [r["tokens_per_s"] for r in rows if r["name"].startswith("learned")]
        if learned:
            return max(learned)
    if "decode" in outputs:
        return outputs["decode"]["rows"]["policy"]["tokens_per_s"]
    return float("nan")


def run(cfg: DictConfig) -> dict:
    """Run the configured stages (skipping those this run directory already finished). Returns each stage's summary
    and ``metric``, the number a sweep optimizes."""
    from sacpolicy.pipeline.tracking import make_tracker

    validate(cfg)
    torch.manual_seed(cfg.seed)
    out_dir = Path(cfg.paths.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(cfg, out_dir / "config.yaml", resolve=False)
    tracker = make_tracker(cfg.get("tracker"), out_dir, OmegaConf.to_container(cfg, resolve=False))
    ctx = RunContext(cfg, out_dir, tracker)
    outputs: dict = {}
    try:
        for stage in cfg.stages:
            done = out_dir / f"{stage}.json"
            if done.exists():
                logger.info("stage %s already finished in %s: skipped (delete %s to rerun it)", stage, out_dir, done)
                outputs[stage] = json.loads(done.read_text())
                continue
            t0 = time.perf_counter()
            logger.info("stage %s", stage)
            summary = stage_runner(stage)(ctx)
            summary["stage_s"] = time.perf_counter() - t0
            write_json(done, summary)
            outputs[stage] = summary
            tracker.log({"seconds": summary["stage_s"]}, stage)
            logger.info("stage %s done in %.1fs", stage, summary["stage_s"])
        outputs["metric"] = metric_of(outputs)
        if "evaluate" in outputs:
            from sacpolicy.pipeline.report import write_run_report

            outputs["report"] = str(write_run_report(cfg, out_dir, outputs))
        tracker.summary({"metric": outputs["metric"]})
    finally:
        tracker.finish()
    return outputs
