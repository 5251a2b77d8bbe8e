"""Stage ``head``: an EAGLE-3 feature head trained with the training-time test into ``head/head``, warm-started from
``head.init_from`` (the embedded default: the head shipped in ``sacpolicy/heads``, used as it is with a budget of 0);
later stages add it to the drafters as ``feature``. Its data: ``head_data=sharegpt``, chat text with its fixed
answers and the target's own regenerated answers teacher-forced at scale (``sacpolicy.training.head_data``), or by
default the distillation data (the
target's own continuations, generated once and shared with the ``distill`` stage). ``head.features=online`` runs the
target in each training step instead of caching its features on disk first."""

from __future__ import annotations

from hydra.utils import instantiate

from sacpolicy import ranks
from sacpolicy.pipeline.context import RunContext
from sacpolicy.pipeline.distill import distill_data


def run(ctx: RunContext) -> dict:
    from sacpolicy.training.eagle3 import train_eagle3

    settings = instantiate(ctx.cfg.head)
    train, val, caches, data = [], [], None, None
    if settings.trains and ctx.cfg.get("head_data"):
        from dataclasses import asdict

        from sacpolicy.training.eagle3 import head_layers
        from sacpolicy.training.head_data import build_head_data, head_sequences

        head_data = instantiate(ctx.cfg.head_data, _convert_="all")
        kinds = {"sharegpt": "ShareGPT's fixed answers", "regenerated": "the target's own greedy answers"}
        data = {**asdict(head_data), "kind": [f"{kinds[x]}, teacher-forced" for x in head_data.sources]}
        if settings.features == "online":  # every rank reads the same streams; nothing is written
            seqs = head_sequences(ctx.target, head_data)
            train, val = seqs["train"], seqs["val"]
        else:
            layers = head_layers(settings, ctx.target)
            caches = ranks.rank_zero_first(lambda: build_head_data(ctx.target, head_data, layers), "the head's data")
            data["train_tokens_by_source"] = {x: sum(c.lengths) for x, c in zip(head_data.sources,
                                                                                caches["train"].caches)}
    elif settings.trains:  # budget 0 with a warm start: the warm-start head as it is, no data needed
        dm = distill_data(ctx, instantiate(ctx.cfg.distill))
        ranks.rank_zero_first(dm.setup, "the distillation data")
        train, val = dm.train, dm.val
    metrics = train_eagle3(ctx.target, train, val, settings, instantiate(ctx.cfg.trainer), ctx.out_dir / "head",
                           ctx.lightning_logger("head"), caches=caches, data=data)
    return {"target": ctx.target.spec, "head_dir": str(ctx.out_dir / "head" / "head"), **metrics}
