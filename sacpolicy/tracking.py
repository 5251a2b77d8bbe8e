"""Experiment tracking for the pipeline's decoding and evaluation stages (training stages use Lightning loggers).

``logger=wandb``: one wandb run per pipeline run, offline by default (``wandb sync`` uploads it later); Lightning's
WandbLogger attaches to the same run. Online mode without credentials falls back to offline with a warning.
``logger=csv``: the same metrics in ``metrics.jsonl`` and tables as CSV files in the run directory.
"""

from __future__ import annotations

import csv
import json
import logging
import os
from pathlib import Path

logger = logging.getLogger(__name__)


class Tracker:
    """CSV/JSON tracker: ``log`` appends to metrics.jsonl, ``table`` writes tables/<name>.csv."""

    def __init__(self, out_dir, config: dict | None = None):
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)

    def log(self, metrics: dict, stage: str) -> None:
        flat = {f"{stage}/{k}": v for k, v in metrics.items() if isinstance(v, (int, float, bool))}
        with open(self.out_dir / "metrics.jsonl", "a") as f:
            f.write(json.dumps(flat) + "\n")

    def table(self, name: str, rows: list[dict]) -> None:
        if not rows:
            return
        path = self.out_dir / "tables" / f"{name}.csv"
        path.parent.mkdir(parents=True, exist_ok=True)
        cols = _columns(rows)
        with open(path, "w", newline="") as f:
            w = csv.DictWriter(f, cols, extrasaction="ignore")
            w.writeheader()
            w.writerows(rows)

    def image(self, name: str, path) -> None:
        """Plots already sit in the run directory."""

    def summary(self, metrics: dict) -> None:
        self.log(metrics, "summary")

    def finish(self) -> None:
        pass


class WandbTracker(Tracker):
    def __init__(self, out_dir, config: dict | None = None, *, project: str = "sacpolicy", offline: bool = True,
                 name: str | None = None, entity: str | None = None):
        import wandb

        super().__init__(out_dir)
        if not offline and not _has_credentials():
            logger.warning("logger=wandb is online but no W&B credentials were found (WANDB_API_KEY or `wandb login`); "
                           "logging offline instead: run `wandb sync %s/wandb/offline-run-*` once you have them",
                           out_dir)
            offline = True
        self.wandb = wandb
        self.run = wandb.init(project=project, entity=entity, name=name, dir=str(out_dir), config=config,
                              mode="offline" if offline else "online", reinit="finish_previous")

    def log(self, metrics: dict, stage: str) -> None:
        super().log(metrics, stage)
        self.run.log({f"{stage}/{k}": v for k, v in metrics.items() if isinstance(v, (int, float, bool))})

    def table(self, name: str, rows: list[dict]) -> None:
        super().table(name, rows)
        if rows:
            cols = _columns(rows)
            self.run.log({name: self.wandb.Table(columns=cols, data=[[r.get(c) for c in cols] for r in rows])})

    def image(self, name: str, path) -> None:
        self.run.log({name: self.wandb.Image(str(path))})

    def summary(self, metrics: dict) -> None:
        super().summary(metrics)
        self.run.summary.update({k: v for k, v in metrics.items() if isinstance(v, (int, float, bool, str))})

    def finish(self) -> None:
        self.run.finish()


def _columns(rows: list[dict]) -> list[str]:
    """Scalar columns of table rows, in first-seen order (nested histograms and per-category dicts stay out)."""
    return list(dict.fromkeys(k for r in rows for k in r if not isinstance(r[k], (dict, list))))


def _has_credentials() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    netrc = Path(os.environ.get("NETRC", Path.home() / ".netrc"))
    return netrc.is_file() and "api.wandb.ai" in netrc.read_text(errors="ignore")


def make_tracker(tracker_cfg, out_dir, config: dict | None = None) -> Tracker:
    """The tracker the config's ``tracker`` node names (the logger group picks it: ``logger=wandb`` -> W&B)."""
    from hydra.utils import instantiate

    if tracker_cfg is None:
        return Tracker(out_dir, config)
    return instantiate(tracker_cfg)(out_dir, config)
