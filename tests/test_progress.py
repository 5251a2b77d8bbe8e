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


def test_progress_logs_while_an_item_runs_and_at_the_end(caplog):
    import time

    def lines():
        return [r.getMessage() for r in caplog.records if r.name == "sacpolicy.progress"]

    with caplog.at_level(logging.INFO, logger="sacpolicy.progress"):
        for i in progress_iter(range(2), "work", unit="chunk", every_s=0.02):
            deadline = time.monotonic() + 10
            while not any(f"work: {i}/2 chunks" in m for m in lines()) and time.monotonic() < deadline:
                time.sleep(0.005)  # the heartbeat speaks while item i is still running
    got = lines()
    assert any(m.startswith("work: 0/2 chunks (0%), ") and m.endswith("ETA unknown") for m in got)
    assert any(m.startswith("work: 1/2 chunks (50%), ") and "ETA " in m for m in got)
    assert got[-1].startswith("work: 2 chunks in ")
    assert status_line("rows", 1, 3, 1.0, "policy").startswith("rows: 1/3 policies")
    assert status_line("data", 1, 3, 1.0, "batch").startswith("data: 1/3 batches")


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
