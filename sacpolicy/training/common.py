"""What the draft-training LightningModules share: AdamW over the trainable parameters with a linear warm-up, and
checkpoints stamped with the run's configuration, so resuming under other settings is refused instead of mixing."""

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
