"""Experiment tracking for the pipeline's decoding and evaluation stages (training stages use Lightning loggers).

``logger=wandb``: one wandb run per pipeline run, offline by default (``wandb sync`` uploads it later); Lightning's
WandbLogger attaches to the same run. Online mode without credentials falls back to offline with a warning. The run
holds the evaluation table with its intervals (``eval/rows``) and per-category rows (``eval/per_category``), bar
charts of tokens/s and tokens per target call (``eval/tokens_per_s_live``, ...), histograms of the k each policy chose
and of the tokens it got accepted (``k_chosen/<policy> (<mode>)``, ``accepted_len/...``), the plots (calibration:
``fit/calibration_<predictor>``) and the draft-training curves, keyed by stage (``distill-train/loss``,
``head-val/acc_step<j>``, ...).
``logger=csv``: the same metrics in ``metrics.jsonl`` and the data of every table, chart and histogram as CSV files
(``tables/<name>.csv``) in the run directory, beside the plots.
"""

from __future__ import annotations

import csv
import json
import logging
import os
from pathlib import Path

logger = logging.getLogger(__name__)


class Tracker:
    """CSV/JSON tracker: ``log`` appends to metrics.jsonl; ``table``, ``bar`` and ``histograms`` write the data
    behind them as tables/<name>.csv (what a W&B run would chart)."""

    def __init__(self, out_dir, config: dict | None = None):
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)

    def log(self, metrics: dict, stage: str) -> None:
        flat = {f"{stage}/{k}": v for k, v in metrics.items() if isinstance(v, (int, float, bool))}
        with open(self.out_dir / "metrics.jsonl", "a") as f:
            f.write(json.dumps(flat) + "\n")

    def table(self, name: str, rows: list[dict]) -> None:
        """Rows with their scalar cells and intervals (``flat_rows``)."""
        self._write_csv(name, flat_rows(rows))

    def bar(self, name: str, values: dict[str, float], *, label: str = "policy", value: str = "value",
            title: str = "") -> None:
        """One bar per label: ``values`` is {label: value}."""
        self._write_csv(name, [{label: k, value: v} for k, v in values.items()])

    def histograms(self, name: str, counts: dict[str, dict], *, label: str = "policy") -> None:
        """One histogram of integer values per label: ``counts`` is {label: {value: count}} (values as int or str,
        as JSON keeps them); empty ones are skipped."""
        self._write_csv(name, [{label: key, "value": int(v), "count": n} for key, c in counts.items()
                               for v, n in c.items()])

    def image(self, name: str, path) -> None:
        """Plots already sit in the run directory."""

    def summary(self, metrics: dict) -> None:
        self.log(metrics, "summary")

    def finish(self) -> None:
        pass

    def _write_csv(self, name: str, rows: list[dict]) -> None:
        if not rows:
            return
        path = self.out_dir / "tables" / f"{name}.csv"
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "w", newline="") as f:
            w = csv.DictWriter(f, _columns(rows))
            w.writeheader()
            w.writerows(rows)


class SilentTracker(Tracker):
    """What a rank other than 0 of a distributed run tracks: nothing (rank 0's tracker holds the run)."""

    def __init__(self, out_dir=None, config: dict | None = None):
        self.out_dir = None

    def log(self, metrics: dict, stage: str) -> None:
        pass

    def _write_csv(self, name: str, rows: list[dict]) -> None:
        pass


class WandbTracker(Tracker):
    """The CSV tracker's files, and the same data in one W&B run: tables as ``wandb.Table``, bars as
    ``wandb.plot.bar`` charts, histograms as one ``wandb.Histogram`` per label under ``<name>/<label>``."""

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
        rows = flat_rows(rows)
        if rows:
            self.run.log({name: self._table(rows)})

    def bar(self, name: str, values: dict[str, float], *, label: str = "policy", value: str = "value",
            title: str = "") -> None:
        super().bar(name, values, label=label, value=value, title=title)
        if values:
            table = self._table([{label: k, value: v} for k, v in values.items()])
            self.run.log({name: self.wandb.plot.bar(table, label, value, title=title or name)})

    def histograms(self, name: str, counts: dict[str, dict], *, label: str = "policy") -> None:
        super().histograms(name, counts, label=label)
        counts = {key: {int(v): n for v, n in c.items()} for key, c in counts.items() if c}
        if not counts:
            return
        # one bin per integer, over the values of every label: histograms of one name share their x axis
        lo, hi = min(min(c) for c in counts.values()), max(max(c) for c in counts.values())
        edges = [v - 0.5 for v in range(lo, hi + 2)]
        self.run.log({f"{name}/{key}": self.wandb.Histogram(np_histogram=([c.get(v, 0) for v in range(lo, hi + 1)],
                                                                          edges)) for key, c in counts.items()})

    def image(self, name: str, path) -> None:
        self.run.log({name: self.wandb.Image(str(path))})

    def summary(self, metrics: dict) -> None:
        super().summary(metrics)
        self.run.summary.update({k: v for k, v in metrics.items() if isinstance(v, (int, float, bool, str))})

    def finish(self) -> None:
        self.run.finish()

    def _table(self, rows: list[dict]):
        cols = _columns(rows)
        return self.wandb.Table(columns=cols, data=[[r.get(c) for c in cols] for r in rows])


def flat_rows(rows: list[dict]) -> list[dict]:
    """Table rows with scalar cells only: an interval ``<key>_ci`` ([lo, hi], or None where there is none) becomes
    the columns ``<key>_lo`` and ``<key>_hi``; other nested values (histograms, per-category and per-prompt data) are
    left out, since they have tables of their own."""
    out = []
    for row in rows:
        flat = {}
        for key, v in row.items():
            if key.endswith("_ci") and (v is None or isinstance(v, (list, tuple)) and len(v) == 2):
                flat[f"{key[:-3]}_lo"], flat[f"{key[:-3]}_hi"] = v or (None, None)
            elif not isinstance(v, (dict, list, tuple)):
                flat[key] = v
        out.append(flat)
    return out


def _columns(rows: list[dict]) -> list[str]:
    """The keys of every row, in first-seen order."""
    return list(dict.fromkeys(k for r in rows for k in r))


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
