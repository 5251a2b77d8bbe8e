"""What the draft-training LightningModules share: AdamW over the trainable parameters with a linear warm-up, and
checkpoints stamped with the run's configuration, so resuming under other settings is refused instead of mixing, and
the held-out acceptance per draft step that validation logs."""

from __future__ import annotations

import functools
import hashlib
import json
import math
import time

import lightning as L
import torch
from lightning.pytorch.callbacks import Timer

from sacpolicy.progress import LOG_EVERY_S, duration, logger


def config_hash(config_id: dict | None) -> str:
    return hashlib.sha256(json.dumps(config_id or {}, sort_keys=True, default=str).encode()).hexdigest()


def lr_factor(step: int, warmup_steps: int, decay_steps: int | None = None) -> float:
    """The learning rate's multiplier at optimizer step ``step``: linear warm-up over ``warmup_steps``, then constant,
    or with ``decay_steps`` a cosine decay to 0 over that many steps after the warm-up (0 beyond them)."""
    warm = max(warmup_steps, 1)
    if step < warm:
        return (step + 1) / warm
    if not decay_steps:
        return 1.0
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, (step - warm) / decay_steps)))


class WarmupAdamW:
    """Mixin for a LightningModule with ``lr``, ``weight_decay``, ``warmup_steps``, ``config_hash`` and the class
    attributes ``checkpoint_key`` / ``run_kind`` (for the refusal message); ``decay_steps`` (optional): see
    ``lr_factor``."""

    checkpoint_key = "sacpolicy_config"
    run_kind = "training"
    decay_steps: int | None = None

    def configure_optimizers(self):
        opt = torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=self.lr,
                                weight_decay=self.weight_decay)
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, functools.partial(lr_factor, warmup_steps=self.warmup_steps, decay_steps=self.decay_steps))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def on_save_checkpoint(self, checkpoint):
        checkpoint[self.checkpoint_key] = self.config_hash

    def on_load_checkpoint(self, checkpoint):
        if checkpoint.get(self.checkpoint_key) != self.config_hash:
            raise ValueError(f"this checkpoint was written by a {self.run_kind} run with a different configuration "
                             "(target, architecture, vocabulary or settings); start a fresh run directory or restore "
                             "the original settings")


class StepAcceptance:
    """Mixin for a draft LightningModule with ``acceptance_steps``: held-out greedy acceptance per draft step,
    ``val/acc_step{j}`` (step j's agreement with the target among chains whose steps < j all agreed) and
    ``val/accept_len`` = sum_k prod_{i <= k} acc_i, the expected accepted tokens per block of ``acceptance_steps``
    greedy drafts. ``validation_step`` passes each batch's chains to ``count_chains``; the epoch's totals are logged
    at its end."""

    acceptance_steps: int

    def count_chains(self, start: torch.Tensor, in_range: list[torch.Tensor], right: list[torch.Tensor]) -> None:
        """start: [B, T] rows where a chain may start; in_range[j], right[j]: [B, T] whether step j of the chain that
        starts at a row has a target token to compare with, and agrees with it."""
        prev = start
        for j, (ok, hit) in enumerate(zip(in_range, right)):
            counted = prev & ok
            prev = counted & hit
            self._chains[j] += torch.stack([prev.sum(), counted.sum()]).float()

    def on_validation_epoch_start(self):
        # [steps, 2]: per step, (chains right through it, chains counted at it)
        self._chains = torch.zeros(self.acceptance_steps, 2, device=self.device)

    def on_validation_epoch_end(self):
        counts = self.trainer.strategy.reduce(self._chains, reduce_op="sum") if self.trainer is not None else self._chains
        acc = counts[:, 0] / counts[:, 1].clamp_min(1)
        for j in range(self.acceptance_steps):
            self.log(f"val/acc_step{j}", acc[j], sync_dist=False)
        self.log("val/accept_len", torch.cumprod(acc, 0).sum(), prog_bar=True, sync_dist=False)


class MinuteLog(L.Callback):
    """One log line per minute of training (step, epoch, elapsed, ETA, the latest loss and held-out metrics) and one
    when training ends, as ``sacpolicy.progress`` does for plain loops. The ETA is the nearest of the step limit (at
    the mean step time so far), the epoch limit and the time budget; early stopping may end training sooner."""

    def __init__(self, desc: str, every_s: float = LOG_EVERY_S):
        self.desc, self.every_s = desc, every_s
        self.start = self.last = time.monotonic()

    def on_train_start(self, trainer, pl_module):
        self.start = self.last = time.monotonic()

    @staticmethod
    def eta(trainer, elapsed: float) -> float | None:
        step, left = max(trainer.global_step, 1), []
        if trainer.max_steps and trainer.max_steps > 0:
            left.append(elapsed / step * (trainer.max_steps - trainer.global_step))
        batches = trainer.num_training_batches
        if trainer.max_epochs and trainer.max_epochs > 0 and batches not in (None, float("inf")):
            left.append(elapsed / step * (trainer.max_epochs * batches - trainer.global_step))
        timer = next((c for c in trainer.callbacks if isinstance(c, Timer)), None)
        if timer is not None and timer.time_remaining("train") is not None:
            left.append(timer.time_remaining("train"))
        return max(min(left), 0.0) if left else None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        now = time.monotonic()
        if now - self.last < self.every_s or not trainer.is_global_zero:
            return
        self.last = now
        eta = self.eta(trainer, now - self.start)
        shown = {k: float(v) for k, v in trainer.callback_metrics.items()
                 if v.numel() == 1 and ("loss" in k or k.startswith("val"))}
        metrics = "".join(f", {k} {v:.4g}" for k, v in sorted(shown.items()))
        logger.info("%s: step %d, epoch %d, %s elapsed, ETA %s%s", self.desc, trainer.global_step,
                    trainer.current_epoch, duration(now - self.start),
                    "unknown" if eta is None else f"<= {duration(eta)}", metrics)

    def on_train_end(self, trainer, pl_module):
        if trainer.is_global_zero:
            logger.info("%s: %d steps in %s", self.desc, trainer.global_step, duration(time.monotonic() - self.start))
