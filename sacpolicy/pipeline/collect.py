"""Stage ``collect``: the cost model profiled on this device (``cost.json``) and teacher-forced traces over the
train/val/test prompts (``traces/tf``; the test prompts are ``collect.num_prompts.test`` of the data mix and the
evaluation-only held-out sets of ``collect.eval_only``), which record the sampling settings they were decoded with
(sampled ones replay in expectation: ``traces.draws``). Live decoding is measured by the ``evaluate`` stage; no live
traces are written here (nothing read them).

Sharded: under a distributed launch (torchrun, or Lightning's ranks after a training stage) every rank collects its
share (shard rank/world) and rank 0, after a barrier, merges the shards (``traces.shards``); ``collect.shard=i/n``
collects one shard of n in this process (separate launches into one run directory: the last to finish merges, and
the run goes on from there). Only shard 0 profiles the cost model: one ``cost.json``."""

from __future__ import annotations

import logging
import time

from omegaconf import OmegaConf

from sacpolicy import ranks
from sacpolicy.pipeline.context import SPLITS, PipelineError, RunContext

logger = logging.getLogger(__name__)


def run(ctx: RunContext) -> dict:
    from hydra.utils import instantiate

    from sacpolicy.profiling import profile
    from sacpolicy.runtime.cost import CostModel
    from sacpolicy.traces.collect import collect_teacher_forced, resolve_shard
    from sacpolicy.traces.shards import merge_shards, missing_shards

    cfg, c, target = ctx.cfg, ctx.cfg.collect, ctx.target
    drafters = ctx.drafters
    if not drafters:
        raise PipelineError("collect needs at least one drafter (draft=[ngram], or a distill stage); got none")
    rank = ranks.current()
    launched = c.shard is None and rank.distributed  # every rank of the launch collects its shard
    i, n = (rank.rank, rank.world_size) if launched else resolve_shard(c.shard or "0/1")
    chosen = {s: ctx.take(ctx.prompts(s), c.num_prompts[s]) for s in SPLITS}
    in_mix = {r["prompt_id"] for r in chosen["test"]}
    eval_only = [r for r in ctx.eval_only_prompts if r["prompt_id"] not in in_mix]  # held out, evaluated, never fitted
    chosen["test"] += eval_only
    cost_path = ctx.out_dir / "cost.json"
    sampling = instantiate(cfg.sampling)
    if i == 0 and not cost_path.exists():  # the decoder's own work is timed at the run's sampling settings
        logger.info("profiling the cost model on %s", target.device)
        profile(target.model, drafters, **OmegaConf.to_container(c.profile), sampling=sampling).to_json(cost_path)
    meta = {"target": target.spec, "vocab_size": int(target.model.get_output_embeddings().out_features)}
    if not sampling.greedy:
        logger.info("collecting sampled traces (temperature %s, top_p %s): fit labels examples with beta, and replays "
                    "(rule tuning, best static, simulated rows) run in expectation over seeded draws",
                    sampling.temperature, sampling.top_p)
    t0, tf_dir = time.perf_counter(), ctx.out_dir / "traces" / "tf"
    collect_teacher_forced(target, drafters, [r for s in SPLITS for r in chosen[s]], tf_dir,
                           max_new_tokens=c.max_new_tokens, meta=meta, sampling=sampling,
                           k_max=c.k_max, shard=(i, n), chunk_size=c.chunk_size)
    summary = {"target": target.spec, "drafters": [d.name for d in drafters], "shards": n,
               "prompts": {s: len(chosen[s]) for s in SPLITS}, "eval_only_prompts": len(eval_only),
               "teacher_forced_s": time.perf_counter() - t0}
    if launched:
        ranks.barrier()  # every rank's shard and manifest written
    if n > 1 and missing_shards(tf_dir, n):  # a separate launch of one shard: the others are still to come
        return {**summary, "partial": True, "shard": f"{i}/{n}", "missing": missing_shards(tf_dir, n)}
    if n > 1 and rank.zero:
        summary["merged"] = merge_shards(tf_dir, n)
    if cost_path.exists():
        summary.update(cost_model=str(cost_path), verify_s_k0_ctx256=CostModel.from_json(cost_path).verify_time(0, 256))
    return summary
