"""Lightning pieces of the MLP acceptance predictor: a DataModule over trace examples and a LightningModule.
``training.predictor.fit_mlp`` wires them with early stopping and checkpoints and compiles the result to numpy."""

from __future__ import annotations

import lightning as L
import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class AcceptanceDataModule(L.LightningDataModule):
    """Standardized features (unknown = the training mean), labels and weights; soft labels are kept as targets."""

    def __init__(self, train, val, mean: np.ndarray, scale: np.ndarray, batch_size: int, seed: int = 0):
        super().__init__()
        self.train_ex, self.val_ex, self.mean, self.scale = train, val, mean, scale
        self.batch_size, self.seed = batch_size, seed

    def _tensors(self, ex) -> TensorDataset:
        z = np.nan_to_num((ex.X - self.mean) / self.scale, nan=0.0, posinf=0.0, neginf=0.0)
        return TensorDataset(torch.tensor(z, dtype=torch.float32), torch.tensor(ex.y, dtype=torch.float32))

    def setup(self, stage=None) -> None:
        self.train_set, self.val_set = self._tensors(self.train_ex), self._tensors(self.val_ex)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(self.seed)
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True, generator=g)

    def val_dataloader(self):
        return DataLoader(self.val_set, batch_size=4 * self.batch_size)


class AcceptanceMLP(L.LightningModule):
    """Features -> logit of acceptance; binary cross-entropy against 0/1 labels or beta."""

    def __init__(self, n_features: int, hidden: tuple[int, ...], lr: float, weight_decay: float):
        super().__init__()
        self.save_hyperparameters()
        layers, width = [], n_features
        for h in hidden:
            layers += [nn.Linear(width, h), nn.ReLU()]
            width = h
        self.net = nn.Sequential(*layers, nn.Linear(width, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x).squeeze(-1)

    def _loss(self, batch) -> torch.Tensor:
        x, y = batch
        return nn.functional.binary_cross_entropy_with_logits(self(x), y)

    def training_step(self, batch, batch_idx):
        loss = self._loss(batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self._loss(batch), prog_bar=True)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=self.hparams.weight_decay)
