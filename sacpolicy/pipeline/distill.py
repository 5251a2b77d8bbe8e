"""Stage ``distill``: a token-level draft distilled from the target (``distill/draft``, loadable by transformers);
later stages add it to the drafters as ``distilled``."""

from __future__ import annotations

from hydra.utils import instantiate

from sacpolicy.pipeline.context import RunContext


def run(ctx: RunContext) -> dict:
    from sacpolicy.training.distill import train_draft

    settings = instantiate(ctx.cfg.distill)
    metrics = train_draft(ctx.target, distill_data(ctx, settings), settings, instantiate(ctx.cfg.trainer),
                          ctx.out_dir / "distill", ctx.lightning_logger("distill"))
    return {"target": ctx.target.spec, "draft_dir": str(ctx.out_dir / "distill" / "draft"), **metrics}


def distill_data(ctx: RunContext, settings):
    """The target's continuations of the training prompts (and of its own synthetic requests) and held-out ones,
    generated once and cached (``$SACPOLICY_CACHE/distill``): what every draft trains on (token-level and heads)."""
    from functools import partial

    from sacpolicy.data import load_prompt_mix, needs_answers, split_prompts
    from sacpolicy.training.distill_data import DistillDataModule

    cfg, target = ctx.cfg, ctx.target
    max_tokens = cfg.data.max_prompt_tokens

    def mix(sources, **kwargs):
        kwargs = {"chat": ctx.chat, **kwargs}  # the run's prompt format (fixed text is never templated)
        return ctx.load_prompts(partial(load_prompt_mix, sources), sources, max_prompt_tokens=max_tokens, **kwargs)

    train = split_prompts(mix(settings.prompts))["train"]
    # early stopping watches what the draft is for: greedy agreement on held-out first turns
    val = split_prompts(mix(settings.val_prompts))["val"]
    fixed = mix(settings.fixed_text, chat=False) if settings.fixed_text else None
    # the target's first answers, when the run generates them anyway, are its greedy continuations of those prompts
    quoted = needs_answers(cfg.data.get("sources")) or needs_answers(settings.prompts)
    return DistillDataModule(target, train, val, fixed_text=fixed, seed=cfg.seed,
                             reuse=ctx.first_answers if quoted else None, **settings.data)
