"""Stage ``collect``: the cost model profiled on this device (``cost.json``) and teacher-forced traces over the
train/val/test prompts (``traces/tf``), which record the sampling settings they were decoded with (sampled ones
replay in expectation: ``traces.draws``). Live decoding is measured by the ``evaluate`` stage; no live traces are
written here (nothing read them)."""

from __future__ import annotations

import logging
import time

from omegaconf import OmegaConf

from sacpolicy.pipeline.context import SPLITS, PipelineError, RunContext

logger = logging.getLogger(__name__)


def run(ctx: RunContext) -> dict:
    from hydra.utils import instantiate

    from sacpolicy.profiling import profile
    from sacpolicy.runtime.cost import CostModel
    from sacpolicy.traces.collect import collect_teacher_forced

    cfg, c, target = ctx.cfg, ctx.cfg.collect, ctx.target
    drafters = ctx.drafters
    if not drafters:
        raise PipelineError("collect needs at least one drafter (draft=[ngram], or a distill stage); got none")
    chosen = {s: ctx.take(ctx.prompts(s), c.num_prompts[s]) for s in SPLITS}
    cost_path = ctx.out_dir / "cost.json"
    sampling = instantiate(cfg.sampling)
    if not cost_path.exists():  # the decoder's own work is timed at the run's sampling settings
        logger.info("profiling the cost model on %s", target.device)
        profile(target.model, drafters, **OmegaConf.to_container(c.profile), sampling=sampling).to_json(cost_path)
    cost = CostModel.from_json(cost_path)
    meta = {"target": target.spec, "vocab_size": int(target.model.get_output_embeddings().out_features)}
    if not sampling.greedy:
        logger.info("collecting sampled traces (temperature %s, top_p %s): fit labels examples with beta, and replays "
                    "(rule tuning, best static, simulated rows) run in expectation over seeded draws",
                    sampling.temperature, sampling.top_p)
    t0 = time.perf_counter()
    collect_teacher_forced(target, drafters, [r for s in SPLITS for r in chosen[s]], ctx.out_dir / "traces" / "tf",
                           max_new_tokens=c.max_new_tokens, meta=meta, sampling=sampling,
                           k_max=c.k_max, shard=c.shard, chunk_size=c.chunk_size)
    return {"target": target.spec, "drafters": [d.name for d in drafters],
            "prompts": {s: len(chosen[s]) for s in SPLITS}, "teacher_forced_s": time.perf_counter() - t0,
            "cost_model": str(cost_path), "verify_s_k0_ctx256": cost.verify_time(0, 256)}
