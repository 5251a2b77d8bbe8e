"""Stage ``head``: an EAGLE-3 feature head trained with the training-time test on the distillation data (the
target's own continuations, generated once and shared with the ``distill`` stage) into ``head/head``; later stages
add it to the drafters as ``feature``."""

from __future__ import annotations

from hydra.utils import instantiate

from sacpolicy.pipeline.context import RunContext
from sacpolicy.pipeline.distill import distill_data


def run(ctx: RunContext) -> dict:
    from sacpolicy.training.eagle3 import train_eagle3

    settings = instantiate(ctx.cfg.head)
    dm = distill_data(ctx, instantiate(ctx.cfg.distill))
    dm.setup()
    metrics = train_eagle3(ctx.target, dm.train, dm.val, settings, instantiate(ctx.cfg.trainer), ctx.out_dir / "head",
                           ctx.lightning_logger())
    return {"target": ctx.target.spec, "head_dir": str(ctx.out_dir / "head" / "head"), **metrics}
