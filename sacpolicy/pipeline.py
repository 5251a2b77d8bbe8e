"""Pipeline stages wired together; ``scripts/train.py`` runs ``run(cfg)`` on a composed Hydra config.

Stages (``cfg.stages``, run in order; each reads and writes files in the run directory):
- ``distill``: distil a draft from the target on the training prompts (``distill/draft``, loadable by transformers);
  later stages add it to the drafters as ``distilled``.
- ``collect``: profile the cost model (``cost.json``), collect teacher-forced traces over the train/val/test prompts
  (``traces/tf``) and a live sample with the configured policy (``traces/live``).
- ``fit``: train each configured predictor on the traces, tune its decision rule on val traces and save the policy
  artifact (``policies/<predictor>``).
- ``evaluate``: every policy on held-out test prompts, simulated and live (``eval.json``, ``eval.md``, plots).
- ``export``: transformers and vLLM settings for each policy (``export/<predictor>``).
- ``decode``: a quick live comparison of the configured policy with autoregressive decoding (``decode.json``).

A finished stage leaves ``<stage>.json``; running again in the same directory (``hydra.run.dir=<run dir>``) skips
finished stages and resumes unfinished ones (collection by chunk, distillation from its last checkpoint).
``from_run=<dir>`` reads artifacts this run lacks from an earlier run of the same target.
"""

from __future__ import annotations

import json
import logging
import shlex
import sys
import time
from pathlib import Path

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from sacpolicy.data import split_prompts
from sacpolicy.decoding import SpeculativeDecoder
from sacpolicy.io import write_json
from sacpolicy.models import LoadedModel
from sacpolicy.policy import Autoregressive

logger = logging.getLogger(__name__)

STAGES = ("distill", "collect", "fit", "evaluate", "export", "decode")
SPLITS = ("train", "val", "test")


class PipelineError(ValueError):
    pass


# ---------------------------------------------------------------------- checks and paths
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
    if cfg.get("from_run"):
        src = Path(cfg.from_run)
        if not (src / "config.yaml").is_file():
            raise PipelineError(f"from_run={src} is not a sacpolicy run directory (no config.yaml); point it at the "
                                "output directory of an earlier scripts/train.py run")
        old = OmegaConf.load(src / "config.yaml")
        if old.target.spec != cfg.target.spec:
            raise PipelineError(f"from_run={src} was made with target {old.target.spec!r}, this run uses "
                                f"{cfg.target.spec!r}; reuse a run of the same target or drop from_run")


def find(cfg: DictConfig, out_dir: Path, rel: str) -> Path | None:
    """An artifact of this run, else of ``from_run``, else of the run that one reused from (and so on), else None."""
    seen, base, src = set(), out_dir, cfg.get("from_run")
    while base is not None and base.resolve() not in seen:
        if (base / rel).exists():
            return base / rel
        seen.add(base.resolve())
        base = Path(src) if src else None
        src = OmegaConf.load(base / "config.yaml").get("from_run") if base and (base / "config.yaml").is_file() else None
    return None


def need(cfg: DictConfig, out_dir: Path, rel: str, stage: str) -> Path:
    path = find(cfg, out_dir, rel)
    if path is None:
        raise PipelineError(f"stage {stage} needs {rel}, which neither this run nor from_run has; run the stage that "
                            f"makes it first (e.g. stages=[collect,{stage}]) or set from_run=<an earlier run dir>")
    return path


# ---------------------------------------------------------------------- builders
def build_target(cfg: DictConfig) -> LoadedModel:
    return instantiate(cfg.target)


def drafter_specs(cfg: DictConfig, out_dir: Path) -> dict[str, dict]:
    """How to rebuild each drafter (recorded in policy artifacts): the distilled draft first when there is one."""
    specs = {}
    draft_dir = find(cfg, out_dir, "distill/draft")
    if draft_dir is not None:
        specs["distilled"] = {"kind": "model", "path": str(draft_dir.resolve())}
    for key, node in (cfg.get("draft") or {}).items():
        target = node["_target_"].rsplit(".", 1)[-1]
        name = node.get("name") or key
        if target == "ngram_drafter":
            specs[name] = {"kind": "ngram", "max_ngram": node.get("max_ngram", 3)}
        elif target == "layer_skip_drafter":
            specs[name] = {"kind": "layer_skip", "layers": node.num_layers}
        else:
            specs[name] = {"kind": "model", "path": str(node.get("spec"))}
    return specs


def build_drafters(cfg: DictConfig, target: LoadedModel, out_dir: Path | None = None) -> list:
    """Each entry of ``cfg.draft`` is a partial called with the target; its key is the drafter's default name. A
    distilled draft of this run (or of from_run) comes first, named ``distilled``."""
    from sacpolicy.decoding.drafters import model_drafter

    drafters = []
    draft_dir = find(cfg, out_dir, "distill/draft") if out_dir is not None else None
    if draft_dir is not None:
        drafters.append(model_drafter(target, str(draft_dir), name="distilled"))
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


def _take(rows, n, seed: int) -> list:
    """n prompts drawn at random (seeded) from a split, so a sample mixes its sources and categories."""
    rows = rows.shuffle(seed=seed) if hasattr(rows, "shuffle") else rows
    return [rows[i] for i in range(len(rows) if n is None else min(n, len(rows)))]


# ---------------------------------------------------------------------- stages
def stage_distill(cfg: DictConfig, out_dir: Path, tracker) -> dict:
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
    metrics = train_draft(target, dm, settings, instantiate(cfg.trainer), out_dir / "distill", _lightning_logger(cfg))
    return {"target": target.spec, "draft_dir": str(out_dir / "distill" / "draft"), **metrics}


def stage_collect(cfg: DictConfig, out_dir: Path, tracker) -> dict:
    from sacpolicy.policy.cost import CostModel, profile
    from sacpolicy.traces.collect import collect_live, collect_teacher_forced

    c = cfg.collect
    target = build_target(cfg)
    drafters = build_drafters(cfg, target, out_dir)
    if not drafters:
        raise PipelineError("collect needs at least one drafter (draft=pool, or a distill stage); got none")
    prompts = split_prompts(instantiate(cfg.data)(tokenizer=target.tokenizer))
    chosen = {s: _take(prompts[s], c.num_prompts[s], cfg.seed) for s in SPLITS}
    cost_path = out_dir / "cost.json"
    if not cost_path.exists():
        logger.info("profiling the cost model on %s", target.device)
        profile(target.model, drafters, **OmegaConf.to_container(c.profile)).to_json(cost_path)
    cost = CostModel.from_json(cost_path)
    sampling = instantiate(cfg.sampling)
    meta = {"target": target.spec}
    t0 = time.perf_counter()
    collect_teacher_forced(target, drafters, [r for s in SPLITS for r in chosen[s]], out_dir / "traces" / "tf",
                           max_new_tokens=c.max_new_tokens, meta=meta, sampling=sampling, k_max=c.k_max,
                           shard=c.shard, chunk_size=c.chunk_size)
    tf_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    live = chosen["val"][: c.live_prompts]
    if live:
        collect_live(build_decoder(cfg, target, drafters), live, out_dir / "traces" / "live",
                     max_new_tokens=c.max_new_tokens, meta=meta, shard=c.shard, chunk_size=c.chunk_size)
    return {"target": target.spec, "drafters": [d.name for d in drafters], "prompts": {s: len(chosen[s]) for s in SPLITS},
            "teacher_forced_s": tf_s, "live_s": time.perf_counter() - t0, "live_prompts": len(live),
            "cost_model": str(cost_path), "verify_s_k0_ctx256": cost.verify_time(0, 256)}


def split_traces(cfg: DictConfig, out_dir: Path, stage: str):
    """The run's teacher-forced traces (or from_run's): (grouped by prompt, {split: grouped}, trace dir, meta)."""
    from sacpolicy.data import assign_split
    from sacpolicy.traces.schema import load_traces, read_meta
    from sacpolicy.traces.simulate import group_traces

    tf_dir = need(cfg, out_dir, "traces/tf", stage)
    grouped = group_traces(load_traces(tf_dir, kind="teacher_forced", target=cfg.target.spec))
    by_split = {s: {} for s in SPLITS}
    for pid, p in grouped.items():
        by_split[assign_split(pid)][pid] = p
    return grouped, by_split, tf_dir, read_meta(tf_dir)


def soft_labels(meta: dict) -> bool:
    """Traces of sampled decoding label a drafted token with its acceptance probability beta, not accepted or not."""
    return float(meta["sampling"].get("temperature", 0.0)) > 0.0


def stage_fit(cfg: DictConfig, out_dir: Path, tracker) -> dict:
    from sacpolicy.evaluation.plots import calibration_plot
    from sacpolicy.policy.cost import CostModel
    from sacpolicy.runtime.artifact import save_policy
    from sacpolicy.training.predictor import acceptance_examples, fit_predictor, tune_rule

    grouped, by_split, tf_dir, meta = split_traces(cfg, out_dir, "fit")
    cost = CostModel.from_json(need(cfg, out_dir, "cost.json", "fit"))
    vocab = target_vocab(cfg)
    soft = soft_labels(meta)
    ex = acceptance_examples(grouped, cost, vocab_size=vocab, k=cfg.fit.k, soft=soft)
    summary = {"examples": {s: int((ex.split == s).sum()) for s in SPLITS}, "soft_labels": soft, "predictors": {}}
    specs = drafter_specs(cfg, out_dir)
    for name, spec in cfg.predictor.items():
        t0 = time.perf_counter()
        pred, metrics = fit_predictor(name, instantiate(spec, _convert_="all"), ex, out_dir / "fit" / name,
                                      logger=_lightning_logger(cfg))
        rule, tuning = tune_rule(pred, cost, by_split["val"], vocab_size=vocab, k_max=cfg.fit.k_max,
                                 config=instantiate(cfg.decoder))
        missing = [d for d in rule.drafters if d not in specs]
        if missing:
            raise PipelineError(f"traces hold drafters {missing} this run cannot rebuild; configure them in draft=")
        save_policy(out_dir / "policies" / name, rule, drafters={d: specs[d] for d in rule.drafters},
                    provenance={"target": cfg.target.spec, "traces": str(tf_dir),
                                "command": _command()},
                    metrics={"predictor": metrics, "tuning": tuning})
        test = ex.of("test", "known")
        if len(test):
            plot = calibration_plot(pred.predict(test.X), test.y, out_dir / "plots" / f"calibration_{name}.png",
                                    title=f"{name}: acceptance calibration (test, drafted tokens)")
            tracker.image(f"fit/calibration_{name}", plot)
        summary["predictors"][name] = {"metrics": metrics, "mode": rule.mode, "optimism": rule.optimism,
                                       "fallback": list(rule.fallback), "fit_s": time.perf_counter() - t0,
                                       "val_tokens_per_s": max(r["val_tokens_per_s"] for r in tuning["grid"])}
        tracker.log({f"{name}_{split}_{k}": v for split, m in metrics.items() for k, v in m.items()}, "fit")
    return summary


def stage_evaluate(cfg: DictConfig, out_dir: Path, tracker) -> dict:
    from sacpolicy.evaluation.evaluate import EvalSettings, evaluate
    from sacpolicy.evaluation.plots import make_plots
    from sacpolicy.evaluation.report import write_eval
    from sacpolicy.policy.cost import CostModel
    from sacpolicy.runtime.artifact import load_policy

    _, by_split, _, _ = split_traces(cfg, out_dir, "evaluate")
    cost = CostModel.from_json(need(cfg, out_dir, "cost.json", "evaluate"))
    rules = {name: load_policy(need(cfg, out_dir, f"policies/{name}", "evaluate")) for name in cfg.predictor}
    target = build_target(cfg)
    drafters = build_drafters(cfg, target, out_dir)
    order = list(next(iter(by_split["val"].values()))["drafters"]) if by_split["val"] else []
    if [d.name for d in drafters] != order:
        raise PipelineError(f"the traces were collected with drafters {order} but this run builds "
                            f"{[d.name for d in drafters]}; use the same draft= setting (and distilled draft)")
    test = [r for r in _take(load_split(cfg, target, "test"), None, cfg.seed) if r["prompt_id"] in by_split["test"]]
    e = cfg.eval
    settings = EvalSettings(ks=tuple(e.ks), k_max=e.k_max, live_prompts=e.live_prompts,
                            max_new_tokens=e.max_new_tokens, price_per_hour=e.price_per_hour,
                            confidence_grid=tuple(e.confidence_grid))
    rows, meta = evaluate(target=target, drafters=drafters, cost=cost, val_grouped=by_split["val"],
                          test_grouped=by_split["test"], test_prompts=test, rules=rules, settings=settings,
                          sampling=instantiate(cfg.sampling), decoder_config=instantiate(cfg.decoder))
    write_eval(out_dir, rows, meta)
    plots = make_plots({"rows": rows, "meta": meta}, out_dir / "plots")
    tracker.table("eval/rows", rows)
    tracker.table("eval/per_category", [{"name": r["name"], "mode": r["mode"], "category": c, **v}
                                        for r in rows for c, v in r["per_category"].items()])
    for p in plots:
        tracker.image(f"eval/{p.stem}", p)
    tracker.log({k: v for k, v in meta.items() if isinstance(v, (int, float))}, "evaluate")
    return {"eval": str(out_dir / "eval.json"), "rows": len(rows), **{k: v for k, v in meta.items()
                                                                       if k.startswith("learned")}}


def stage_export(cfg: DictConfig, out_dir: Path, tracker) -> dict:
    """Per policy: vLLM's speculative_config and, when the policy has a model drafter, the transformers
    generation_config settings for stock assisted generation (copy them into the draft's directory)."""
    import shutil

    from sacpolicy.export.hf import export_generation_config
    from sacpolicy.export.vllm import write_vllm_config
    from sacpolicy.runtime.artifact import ArtifactError

    out = {}
    for name in cfg.predictor:
        policy_dir = need(cfg, out_dir, f"policies/{name}", "export")
        dest = out_dir / "export" / name
        dest.mkdir(parents=True, exist_ok=True)
        out[name] = {"runtime": str(policy_dir), "vllm": str(write_vllm_config(policy_dir, dest / "vllm.json"))}
        draft_dir = find(cfg, out_dir, "distill/draft")
        if draft_dir is not None and (draft_dir / "generation_config.json").is_file():
            shutil.copyfile(draft_dir / "generation_config.json", dest / "generation_config.json")
        try:
            out[name]["transformers"] = export_generation_config(policy_dir, dest)
        except ArtifactError as exc:  # no model drafter among the policy's drafters
            logger.info("no transformers export for %s: %s", name, exc)
    return out


def stage_decode(cfg: DictConfig, out_dir: Path, tracker) -> dict:
    target = build_target(cfg)
    drafters = build_drafters(cfg, target, out_dir)
    prompts = _take(load_split(cfg, target), cfg.run.num_prompts, cfg.seed)
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
    tracker.log({f"{n}_tokens_per_s": r["tokens_per_s"] for n, r in results.items()}, "decode")
    return {"target": target.spec, "device": str(target.device), "dtype": str(target.dtype),
            "prompts": len(prompts), "max_new_tokens": cfg.run.max_new_tokens, "rows": results}


_RUN = {"distill": stage_distill, "collect": stage_collect, "fit": stage_fit, "evaluate": stage_evaluate,
        "export": stage_export, "decode": stage_decode}


# ---------------------------------------------------------------------- the run
def target_vocab(cfg: DictConfig) -> int:
    """The target's vocabulary size (its LM head's rows), which feature vectors and replays are sized by."""
    return int(build_target(cfg).model.get_output_embeddings().out_features)


def _command() -> str:
    return " ".join(shlex.quote(a) for a in [Path(sys.executable).name, *sys.argv])


def _tracker_kind(cfg: DictConfig) -> str:
    return "wandb" if "Wandb" in str(cfg.get("logger", {}).get("_target_", "")) else "csv"


def _lightning_logger(cfg: DictConfig):
    return instantiate(cfg.logger) if cfg.get("logger") else None


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
    from sacpolicy.tracking import make_tracker

    validate(cfg)
    torch.manual_seed(cfg.seed)
    out_dir = Path(cfg.paths.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(cfg, out_dir / "config.yaml", resolve=False)
    kind = _tracker_kind(cfg)
    kwargs = {"project": cfg.logger.project, "offline": cfg.logger.offline} if kind == "wandb" else {}
    tracker = make_tracker(kind, out_dir, OmegaConf.to_container(cfg, resolve=False), **kwargs)
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
            summary = _RUN[stage](cfg, out_dir, tracker)
            summary["stage_s"] = time.perf_counter() - t0
            write_json(done, summary)
            outputs[stage] = summary
            tracker.log({"seconds": summary["stage_s"]}, stage)
            logger.info("stage %s done in %.1fs", stage, summary["stage_s"])
        outputs["metric"] = metric_of(outputs)
        if "evaluate" in outputs:
            outputs["report"] = str(write_run_report(cfg, out_dir, outputs))
        tracker.summary({"metric": outputs["metric"]})
    finally:
        tracker.finish()
    return outputs


def write_run_report(cfg: DictConfig, out_dir: Path, outputs: dict) -> Path:
    from sacpolicy.evaluation.report import write_report

    ev = json.loads(Path(outputs["evaluate"]["eval"]).read_text())
    sections = {}
    if "distill" in outputs:
        d = outputs["distill"]
        sections["Distilled draft"] = "\n".join(f"- {k}: {v}" for k, v in d.items() if not isinstance(v, dict))
    if "fit" in outputs:
        lines = []
        for name, p in outputs["fit"]["predictors"].items():
            for split in ("val", "test"):
                m = p["metrics"][split]
                lines.append(f"- {name} ({split}): AUC {m.get('auc', float('nan')):.3f}, log-loss "
                             f"{m.get('log_loss', float('nan')):.3f}, ECE {m.get('ece', float('nan')):.3f}, n={m['n']}")
            lines.append(f"- {name}: decision mode {p['mode']}, optimism {p['optimism']}, fallback {p['fallback']}")
        sections["Predictors"] = "\n".join(lines)
    plots = sorted((out_dir / "plots").glob("*.png"))
    md, _ = write_report(out_dir, ev, command=_command(), sections=sections, plots=plots)
    return md
