"""Logit distillation of a draft from a frozen target (DistillSpec / GKD divergences), as a LightningModule.

p: teacher (target) next-token distribution, q: draft distribution, both over the draft's vocabulary (the trimmed
one when the draft's head is trimmed; the teacher is projected onto it and renormalized).
- ``fkl``: KL(p || q)            mode-covering; the classic KD loss
- ``rkl``: KL(q || p)            mode-seeking
- ``jsd``: beta KL(p || m) + (1 - beta) KL(q || m), m = beta p + (1 - beta) q   (generalized JSD of GKD)
- ``tvd``: 1/2 sum |p - q|       acceptance of speculative sampling is exactly 1 - TVD
Each optionally mixed with cross-entropy on the target's own tokens (``ce_weight``) and computed at a temperature.
"""

from __future__ import annotations

import logging
import math
import random
from dataclasses import asdict, dataclass, field

import lightning as L
import torch

from sacpolicy.training.common import MinuteLog, StepAcceptance, WarmupAdamW, config_hash
from sacpolicy.training.drafts import DraftModel

logger = logging.getLogger(__name__)

LOSSES = ("fkl", "rkl", "jsd", "tvd")
ACCEPT_STEPS = 4  # draft steps whose held-out acceptance validation logs (val/acc_step0..3, val/accept_len)


def _data_defaults() -> dict:
    from sacpolicy.training.distill_data import data_defaults

    return data_defaults()


@dataclass
class DistillSettings:
    """Everything a distillation run depends on; the one home of its defaults (the data settings' home is
    ``DistillDataModule``'s signature; ``conf/distill/fkl.yaml`` sets the seed, the other options only the loss)."""

    loss: str = "fkl"  # fkl | rkl | jsd | tvd
    beta: float = 0.5  # generalized JSD weight (jsd only)
    temperature: float = 1.0
    ce_weight: float = 0.0  # mix in cross-entropy on the target's tokens
    lr: float = 2e-3  # high: drafts train on a budget of minutes (lower rates: docs/benchmarks.md, "Distillation")
    weight_decay: float = 0.0
    warmup_steps: int = 20
    on_policy_fraction: float = 0.0  # lambda: fraction of batches sampled from the draft, scored by the target
    on_policy_tokens: int = 64
    arch: str = "truncate"  # truncate (the target's first layers) | fresh (small random Llama) | pretrained (spec)
    num_layers: int = 2
    spec: str | None = None
    fresh: dict | None = None
    vocab_size: int | None = 8192  # trimmed draft vocabulary (None = full): the head costs vocab_size / V of the full
    freeze_embeddings: bool = True
    budget_minutes: float | None = 8.0  # training time budget (data preparation is cached and not counted)
    max_steps: int | None = None
    patience: int = 4
    val_check_interval: float = 0.5
    seed: int = 0
    data: dict = field(default_factory=lambda: _data_defaults())  # DistillDataModule's keyword arguments
    prompts: list = field(default_factory=lambda: [{"source": "mt_bench", "turns": "all"}, "humaneval"])  # train split
    val_prompts: list = field(default_factory=lambda: ["mt_bench"])  # early stopping: val split, first turns
    fixed_text: list | None = None  # prompt sources used verbatim (no chat template, no generation), e.g. text:<path>

    def __post_init__(self) -> None:
        from sacpolicy.training.drafts import ARCHS

        if self.loss not in LOSSES:
            raise ValueError(f"unknown distillation loss {self.loss!r}; choose one of {list(LOSSES)}")
        if self.arch not in ARCHS:
            raise ValueError(f"unknown draft arch {self.arch!r}; choose one of {list(ARCHS)}")
        if not 0.0 <= self.ce_weight <= 1.0 or not 0.0 <= self.on_policy_fraction <= 1.0:
            raise ValueError("ce_weight and on_policy_fraction must be in [0, 1]")
        if self.temperature <= 0 or self.lr <= 0:
            raise ValueError("temperature and lr must be positive")
        if not (self.budget_minutes or self.max_steps):
            raise ValueError("give distill.budget_minutes or distill.max_steps: training needs a budget")

    def identity(self) -> dict:
        """What a checkpoint must agree on to be resumed (the budget may change between runs)."""
        return {k: v for k, v in asdict(self).items() if k not in ("budget_minutes", "max_steps", "patience")}



def teacher_logp(topk_ids: torch.Tensor, topk_logp: torch.Tensor, t2d: torch.Tensor, draft_vocab: int,
                 full_vocab: int, temperature: float = 1.0) -> torch.Tensor:
    """[N, k] target top-k (ids, log-probs) -> [N, V'] log-probs on the draft vocabulary.

    Mass outside the top-k is spread evenly over the other tokens (a floor, so reverse KL and JSD stay finite), then
    the distribution is tempered and renormalized over the draft's vocabulary.
    """
    k = topk_ids.shape[-1]
    tail = (1 - topk_logp.float().exp().sum(-1, keepdim=True)).clamp_min(1e-8) / max(full_vocab - k, 1)
    dense = tail.log().expand(-1, draft_vocab).clone()
    idx = t2d[topk_ids]  # -1 where the target token is outside the draft vocabulary
    keep = idx >= 0
    rows = torch.arange(idx.shape[0], device=idx.device).unsqueeze(-1).expand_as(idx)
    dense[rows[keep], idx[keep]] = topk_logp.float()[keep]
    return torch.log_softmax(dense / temperature, dim=-1)


def divergence(kind: str, log_p: torch.Tensor, log_q: torch.Tensor, beta: float = 0.5) -> torch.Tensor:
    """Per-position divergence between teacher log_p and student log_q: [N, V] -> [N]."""
    p, q = log_p.exp(), log_q.exp()
    if kind == "fkl":
        return (p * (log_p - log_q)).sum(-1)
    if kind == "rkl":
        return (q * (log_q - log_p)).sum(-1)
    if kind == "jsd":
        if beta <= 0 or beta >= 1:  # the limits are the two KLs
            return divergence("rkl" if beta <= 0 else "fkl", log_p, log_q)
        log_m = torch.logsumexp(torch.stack([log_p + math.log(beta), log_q + math.log(1 - beta)]), dim=0)
        return beta * (p * (log_p - log_m)).sum(-1) + (1 - beta) * (q * (log_q - log_m)).sum(-1)
    if kind == "tvd":
        return 0.5 * (p - q).abs().sum(-1)
    raise ValueError(f"unknown distillation loss {kind!r}; choose one of {list(LOSSES)}")


class DistillModule(WarmupAdamW, StepAcceptance, L.LightningModule):
    """Validation logs ``val/loss``, ``val/match_rate`` (greedy agreement with the target's next token),
    ``val/beta_lb`` and the acceptance per draft step (``StepAcceptance``): exact from teacher forcing, since the
    held-out continuations are the target's greedy ones, so a draft that agreed on steps < j saw the same prefix."""

    checkpoint_key, run_kind, acceptance_steps = "sacpolicy_distill_config", "distillation", ACCEPT_STEPS

    def __init__(self, draft: DraftModel, full_vocab: int, settings: DistillSettings, teacher=None,
                 config_id: dict | None = None):
        super().__init__()
        s = settings
        loss, beta, temperature, ce_weight = s.loss, s.beta, s.temperature, s.ce_weight
        lr, weight_decay, warmup_steps = s.lr, s.weight_decay, s.warmup_steps
        on_policy_fraction, on_policy_tokens = s.on_policy_fraction, s.on_policy_tokens
        if loss not in LOSSES:
            raise ValueError(f"unknown distillation loss {loss!r}; choose one of {list(LOSSES)}")
        if not 0.0 <= on_policy_fraction <= 1.0:
            raise ValueError(f"on_policy_fraction (lambda) must be in [0, 1], got {on_policy_fraction}")
        if on_policy_fraction > 0 and teacher is None:
            raise ValueError("on-policy batches need the teacher (target) to score draft samples")
        self.draft = draft.model
        self.draft_arch = draft
        self.full_vocab = full_vocab
        d2t = draft.d2t if draft.d2t is not None else torch.arange(full_vocab)
        t2d = torch.full((full_vocab,), -1, dtype=torch.long)
        t2d[d2t] = torch.arange(d2t.numel())
        self.register_buffer("d2t", d2t.long(), persistent=False)
        self.register_buffer("t2d", t2d, persistent=False)
        self.loss_kind, self.beta, self.temperature, self.ce_weight = loss, beta, temperature, ce_weight
        self.lr, self.weight_decay, self.warmup_steps = lr, weight_decay, warmup_steps
        self.on_policy_fraction, self.on_policy_tokens = on_policy_fraction, on_policy_tokens
        self._teacher = [teacher]  # a list: the frozen target is not a submodule (not trained, saved or wrapped)
        self.config_id = config_id or {}
        self.config_hash = config_hash(self.config_id)

    # ------------------------------------------------------------------ loss
    def _positions(self, batch):
        """Draft logits at the trained positions only: the LM head never runs on prompt or padding positions."""
        hidden = self.draft.base_model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
        mask = batch["loss_mask"]
        logits = self.draft.get_output_embeddings()(hidden.last_hidden_state[:, :-1][mask])
        return logits.float(), batch["topk_ids"][mask], batch["topk_logp"][mask]

    def _loss(self, batch):
        logits, top_ids, top_logp = self._positions(batch)
        log_q = torch.log_softmax(logits / self.temperature, dim=-1)
        log_p = teacher_logp(top_ids, top_logp, self.t2d, logits.shape[-1], self.full_vocab, self.temperature)
        loss = divergence(self.loss_kind, log_p, log_q, self.beta).mean()
        if self.ce_weight:
            labels = self.t2d[top_ids[:, 0]]  # greedy continuations: the target's own next token
            ok = labels >= 0
            if ok.any():
                ce = torch.nn.functional.cross_entropy(logits[ok], labels[ok])
                loss = (1 - self.ce_weight) * loss + self.ce_weight * ce
        agree = self.d2t[logits.argmax(-1)] == top_ids[:, 0]  # per position: the draft's greedy token is the target's
        return loss, agree, logits, top_ids, top_logp

    def training_step(self, batch, batch_idx):
        if self.on_policy_fraction and random.Random(self.global_step).random() < self.on_policy_fraction:
            batch = self._on_policy_batch(batch)
        loss, agree, *_ = self._loss(batch)
        match = agree.float().mean()
        if not torch.isfinite(loss):
            raise FloatingPointError(
                f"distillation loss is {loss.item()} at step {self.global_step} (batch {batch_idx}); lower "
                "distill.lr, raise distill.temperature or check the teacher cache, then resume from the last checkpoint"
            )
        self.log_dict({"train/loss": loss, "train/match": match}, prog_bar=True, batch_size=batch["input_ids"].shape[0])
        return loss

    def validation_step(self, batch, batch_idx):
        loss, agree, logits, top_ids, top_logp = self._loss(batch)
        q = torch.softmax(logits, -1)
        idx = self.t2d[top_ids]
        q_top = torch.where(idx >= 0, q.gather(-1, idx.clamp_min(0)), torch.zeros_like(top_logp))
        beta_lb = torch.minimum(top_logp.float().exp(), q_top).sum(-1).mean()  # sum over top-k only: a lower bound
        mask = batch["loss_mask"]
        hit = torch.zeros_like(mask)  # [B, T - 1]: ``agree`` back at its rows
        hit[mask] = agree
        steps = range(self.acceptance_steps)  # the chain from row t: step j at row t + j
        self.count_chains(mask, [_ahead(mask, j) for j in steps], [_ahead(hit, j) for j in steps])
        n = logits.shape[0]
        self.log_dict({"val/loss": loss, "val/match_rate": agree.float().mean(), "val/beta_lb": beta_lb}, prog_bar=True,
                      batch_size=n, sync_dist=True)

    # ------------------------------------------------------------------ on-policy data (GKD)
    @torch.no_grad()
    def _on_policy_batch(self, batch):
        """Replace a batch by draft-sampled continuations of its prompts, scored by the teacher on the fly."""
        from sacpolicy.decoding import DraftRow, ModelDrafter, SamplingConfig
        from sacpolicy.training.distill_data import collate, teacher_topk

        teacher = self._teacher[0]
        was_training = self.draft.training
        self.draft.eval()
        drafter = ModelDrafter(self.draft, name="on-policy", d2t=self.d2t if self.draft_arch.d2t is not None else None,
                               vocab_size=self.full_vocab if self.draft_arch.d2t is not None else None)
        sampling = SamplingConfig(temperature=1.0)
        gen = torch.Generator(device=self.device).manual_seed(self.global_step)
        seqs = []
        for b in range(batch["input_ids"].shape[0]):
            prompt = batch["input_ids"][b, : int(batch["prompt_len"][b])]
            block = drafter.propose([DraftRow(drafter.new_state(), prompt, self.on_policy_tokens, sampling, gen)])[0]
            seqs.append({"input_ids": prompt.tolist() + block.tokens.tolist(), "prompt_len": prompt.numel(),
                         "prompt_id": str(b), "sample": 0})
        self.draft.train(was_training)
        scored = teacher_topk(teacher, seqs, k=batch["topk_ids"].shape[-1], progress=False)
        return {key: v.to(self.device) for key, v in collate(list(scored)).items()}


def _ahead(x: torch.Tensor, j: int) -> torch.Tensor:
    """[B, T] -> [B, T]: row t holds row t + j of ``x`` (False past the end)."""
    return torch.cat([x[:, j:], torch.zeros_like(x[:, :j])], dim=1)


# ---------------------------------------------------------------------- the whole stage
def train_draft(target, datamodule, settings: DistillSettings, trainer_factory, out_dir, logger=None,
                callbacks=()) -> dict:
    """Distil a draft, resuming from ``out_dir/checkpoints/last.ckpt`` when it exists; export the best checkpoint (by
    validation greedy match rate) to ``out_dir/draft`` and return its metrics.

    ``trainer_factory(**kwargs)`` builds a ``lightning.Trainer`` (the Hydra ``trainer`` partial)."""
    from pathlib import Path

    from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint

    from sacpolicy.training.distill_data import token_counts
    from sacpolicy.training.drafts import build_draft, export_draft

    from sacpolicy import ranks

    s, out_dir = settings, Path(out_dir)
    ranks.rank_zero_first(datamodule.prepare_data, "the distillation data")  # generated by rank 0, read by all
    vocab = int(target.model.get_output_embeddings().out_features)
    counts = token_counts(datamodule.train, vocab) if s.vocab_size else None
    draft = build_draft(target, arch=s.arch, num_layers=s.num_layers, spec=s.spec, fresh=s.fresh,
                        vocab_size=s.vocab_size, token_counts=counts, freeze_embeddings=s.freeze_embeddings, seed=s.seed)
    # float32 master weights whatever the target's dtype: half precision is the trainer's (precision=bf16-mixed),
    # not the parameters' (bf16 weights lose the small updates); the export casts back to the target's dtype
    draft.model.float()
    if draft.full_head is not None:
        draft.full_head = draft.full_head.float()
    module = DistillModule(draft, vocab, s, teacher=target, config_id={"target": target.spec, **s.identity()})
    ckpt_dir = out_dir / "checkpoints"
    best = ModelCheckpoint(dirpath=ckpt_dir, filename="best", monitor="val/match_rate", mode="max", save_last=True)
    callbacks = [best, EarlyStopping(monitor="val/match_rate", mode="max", patience=s.patience,
                                     check_on_train_epoch_end=False), MinuteLog("distillation"), *callbacks]
    kwargs = {"callbacks": callbacks, "logger": logger if logger is not None else False,
              "val_check_interval": s.val_check_interval}
    if s.budget_minutes:
        kwargs["max_time"] = {"minutes": s.budget_minutes}
    if s.max_steps:
        kwargs["max_steps"] = s.max_steps
    trainer = trainer_factory(**kwargs)
    last = ckpt_dir / "last.ckpt"
    trainer.fit(module, datamodule=datamodule, ckpt_path=str(last) if last.is_file() else None)
    if best.best_model_path:
        state = torch.load(best.best_model_path, map_location="cpu", weights_only=True)["state_dict"]
        module.load_state_dict(state)
    score = best.best_model_score
    metrics = {"val/match_rate": None if score is None else float(score), "global_step": trainer.global_step,
               "world_size": trainer.world_size, "train_batches_per_rank": int(trainer.num_training_batches),
               "train_tokens": sum(len(r) - p for r, p in zip(datamodule.train["input_ids"], datamodule.train["prompt_len"]))}
    if trainer.is_global_zero:
        export_draft(draft, target, out_dir / "draft", {"settings": asdict(s), "metrics": metrics})
    trainer.strategy.barrier("draft exported")  # the other ranks' next stages load it
    return metrics
