"""Progress lines: one per interval with count, elapsed and ETA, one at the end; the same for Lightning training."""

from __future__ import annotations

import logging

import lightning as L
import pytest
import torch

from sacpolicy.progress import duration, progress_iter, status_line
from sacpolicy.training.common import MinuteLog


def test_duration_and_status_line():
    assert [duration(s) for s in (0, 45.4, 192, 3725)] == ["0s", "45s", "3m12s", "1h02m"]
    assert status_line("traces", 12, 40, 192.0, "chunk") == "traces: 12/40 chunks (30%), 3m12s elapsed, ETA 7m28s"
    assert status_line("traces", 0, 40, 5.0, "chunk").endswith("ETA unknown")
    assert status_line("rows", 3, None, 6.0) == "rows: 3 its, 6s elapsed (0.50 it/s)"


def test_progress_logs_every_interval_and_at_the_end(caplog, monkeypatch):
    clock = iter(range(0, 1000, 30))  # each call to the clock is 30 s later
    monkeypatch.setattr("sacpolicy.progress.time.monotonic", lambda: next(clock))
    with caplog.at_level(logging.INFO, logger="sacpolicy.progress"):
        assert list(progress_iter(range(6), "work", unit="chunk", every_s=60)) == list(range(6))
    lines = [r.getMessage() for r in caplog.records]
    # start at 0 s; items end at 30, 60, ..., 180 s: lines at 60 s (2 done) and 120 s (4 done), 180 s (6 done)
    assert lines[0] == "work: 2/6 chunks (33%), 1m00s elapsed, ETA 2m00s"
    assert lines[-1] == "work: 6 chunks in 3m30s" and len(lines) == 4


def test_disabled_progress_is_silent(caplog):
    with caplog.at_level(logging.INFO, logger="sacpolicy.progress"):
        assert list(progress_iter([1, 2], "quiet", enabled=False, every_s=0)) == [1, 2]
    assert caplog.records == []


class _Tiny(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Linear(2, 1)

    def training_step(self, batch, _):
        loss = self.w(batch[0]).pow(2).mean()
        self.log("train/loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_training_logs_steps_eta_and_loss(caplog, tmp_path):
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 2)), batch_size=2)
    trainer = L.Trainer(max_steps=6, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
                        callbacks=[MinuteLog("tiny", every_s=0)])
    with caplog.at_level(logging.INFO, logger="sacpolicy.progress"):
        trainer.fit(_Tiny(), data)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("tiny")]
    assert len(lines) == 7 and lines[-1].startswith("tiny: 6 steps in ")
    assert lines[0].startswith("tiny: step 1, epoch 0, ") and "ETA <= " in lines[0] and "train/loss" in lines[0]
    assert "step 5, epoch 1" in lines[4]


@pytest.mark.parametrize("steps,epochs,expect", [(10, -1, 8.0), (-1, 2, 6.0)])
def test_eta_reads_the_nearest_limit(steps, epochs, expect):
    from types import SimpleNamespace

    trainer = SimpleNamespace(global_step=2, max_steps=steps, max_epochs=epochs, num_training_batches=4, callbacks=[])
    assert MinuteLog.eta(trainer, elapsed=2.0) == pytest.approx(expect)
