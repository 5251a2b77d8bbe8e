"""What the draft-training LightningModules share: AdamW over the trainable parameters with a linear warm-up, and
checkpoints stamped with the run's configuration, so resuming under other settings is refused instead of mixing, and
the held-out acceptance per draft step that validation logs."""

from __future__ import annotations

import hashlib
import json

import torch


def config_hash(config_id: dict | None) -> str:
    return hashlib.sha256(json.dumps(config_id or {}, sort_keys=True, default=str).encode()).hexdigest()


class WarmupAdamW:
    """Mixin for a LightningModule with ``lr``, ``weight_decay``, ``warmup_steps``, ``config_hash`` and the class
    attributes ``checkpoint_key`` / ``run_kind`` (for the refusal message)."""

    checkpoint_key = "sacpolicy_config"
    run_kind = "training"

    def configure_optimizers(self):
        opt = torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=self.lr,
                                weight_decay=self.weight_decay)
        warm = max(self.warmup_steps, 1)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / warm))
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
