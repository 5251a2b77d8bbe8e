"""Pipeline stages wired together; ``scripts/train.py`` runs ``run(cfg)`` on a composed Hydra config.

Stages (``cfg.stages``, run in order, each writing files into the run directory):
- ``distill``: distil a draft from the target on the training prompts (``distill/draft``, loadable by transformers).
- ``decode``: load the target and drafters, decode a few held-out prompts autoregressively and with the configured
  policy, print tokens/s and write ``decode.json``.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from sacpolicy.data import split_prompts
from sacpolicy.io import write_json
from sacpolicy.decoding import SpeculativeDecoder
from sacpolicy.models import LoadedModel
from sacpolicy.policy import Autoregressive

logger = logging.getLogger(__name__)

STAGES = ("distill", "decode")


class PipelineError(ValueError):
    pass


def validate(cfg: DictConfig) -> None:
    """Fail early, with the fix, on settings that would only break deep inside a stage."""
    unknown = [s for s in cfg.stages if s not in STAGES]
    if unknown:
        raise PipelineError(f"unknown stage(s) {unknown}; stages are {list(STAGES)} (e.g. stages=[decode])")
    device = str(cfg.target.get("device", "auto"))
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise PipelineError(
            f"target {cfg.target.spec} is configured for device={device} but no CUDA GPU is visible; run it on a GPU "
            "machine, or pick a CPU preset (experiment=embedded_cpu or experiment=smoke)"
        )


def build_target(cfg: DictConfig) -> LoadedModel:
    return instantiate(cfg.target)


def build_drafters(cfg: DictConfig, target: LoadedModel) -> list:
    """Each entry of ``cfg.draft`` is a partial called with the target; its key is the drafter's default name."""
    drafters = []
    for key, node in (cfg.get("draft") or {}).items():
        make = instantiate(node)
        drafters.append(make(target) if callable(make) else make)
        if drafters[-1].name is None:
            drafters[-1].name = key
    return drafters


def build_decoder(cfg: DictConfig, target: LoadedModel, drafters: list, policy=None) -> SpeculativeDecoder:
    return SpeculativeDecoder(
        target.model,
        drafters,
        policy if policy is not None else instantiate(cfg.policy),
        sampling=instantiate(cfg.sampling),
        config=instantiate(cfg.decoder),
        stop_token_ids=target.eos_token_ids,
    )


def load_split(cfg: DictConfig, target: LoadedModel, split: str | None = None):
    prompts = instantiate(cfg.data)(tokenizer=target.tokenizer)
    return split_prompts(prompts)[split or cfg.run.split]


def stage_distill(cfg: DictConfig, out_dir: Path) -> dict:
    from sacpolicy.data import load_prompt_mix
    from sacpolicy.training.distill import train_draft
    from sacpolicy.training.distill_data import DistillDataModule

    target = build_target(cfg)
    settings = instantiate(cfg.distill)
    mix = load_prompt_mix(settings.prompts, tokenizer=target.tokenizer, max_prompt_tokens=cfg.data.max_prompt_tokens)
    train = split_prompts(mix)["train"]
    # early stopping watches what the draft is for: greedy agreement on held-out first turns
    val = split_prompts(load_prompt_mix(settings.val_prompts, tokenizer=target.tokenizer,
                                        max_prompt_tokens=cfg.data.max_prompt_tokens))["val"]
    fixed = None
    if settings.fixed_text:
        fixed = load_prompt_mix(settings.fixed_text, tokenizer=target.tokenizer, chat=False,
                                max_prompt_tokens=cfg.data.max_prompt_tokens)
    dm = DistillDataModule(target, train, val, fixed_text=fixed, seed=cfg.seed, **settings.data)
    logger = instantiate(cfg.logger) if cfg.get("logger") else None
    metrics = train_draft(target, dm, settings, instantiate(cfg.trainer), out_dir / "distill", logger)
    summary = {"target": target.spec, "draft_dir": str(out_dir / "distill" / "draft"), **metrics}
    write_json(out_dir / "distill.json", summary)
    return summary


def stage_decode(cfg: DictConfig, out_dir: Path) -> dict:
    target = build_target(cfg)
    drafters = build_drafters(cfg, target)
    rows = load_split(cfg, target)
    n = len(rows) if cfg.run.num_prompts is None else min(cfg.run.num_prompts, len(rows))
    prompts = [rows[i] for i in range(n)]
    decoders = {
        "ar": build_decoder(cfg, target, [], Autoregressive()),
        "policy": build_decoder(cfg, target, drafters),
    }
    for dec in decoders.values():  # warm-up: first calls pay for lazy initialisation
        for row in prompts[: cfg.run.warmup_prompts]:
            dec.generate(row["input_ids"], 8)
    results = {}
    for name, dec in decoders.items():
        tokens = seconds = calls = 0
        for row in prompts:
            res = dec.generate(row["input_ids"], cfg.run.max_new_tokens, category=row["category"])
            tokens, seconds, calls = tokens + len(res.tokens), seconds + res.total_s, calls + res.target_calls
        results[name] = {
            "policy": repr(dec.policy), "tokens": tokens, "seconds": seconds,
            "tokens_per_s": tokens / seconds, "mean_accepted": tokens / calls,
        }
    results["policy"]["speedup_vs_ar"] = results["policy"]["tokens_per_s"] / results["ar"]["tokens_per_s"]
    summary = {"target": target.spec, "device": str(target.device), "dtype": str(target.dtype),
               "prompts": n, "max_new_tokens": cfg.run.max_new_tokens, "rows": results}
    write_json(out_dir / "decode.json", summary)
    return summary


def run(cfg: DictConfig) -> dict:
    """Run the configured stages. Returns each stage's summary and ``metric``, the number a sweep optimizes
    (tokens/s of the configured policy)."""
    validate(cfg)
    torch.manual_seed(cfg.seed)
    out_dir = Path(cfg.paths.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(cfg, out_dir / "config.yaml", resolve=False)
    outputs: dict = {"metric": float("nan")}
    for stage in cfg.stages:
        t0 = time.perf_counter()
        logger.info("stage %s", stage)
        if stage == "distill":
            outputs["distill"] = stage_distill(cfg, out_dir)
        if stage == "decode":
            outputs["decode"] = stage_decode(cfg, out_dir)
            outputs["metric"] = outputs["decode"]["rows"]["policy"]["tokens_per_s"]
        logger.info("stage %s done in %.1fs", stage, time.perf_counter() - t0)
    return outputs
