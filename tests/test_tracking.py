"""With ``logger=wandb`` one W&B run holds what a user looks for, read back from the offline run's own files: the
evaluation table with its intervals, bar charts of tokens/s and of tokens per target call, per-category rows,
calibration curves, draft-training curves and histograms of k chosen and of accepted length per policy.

wandb 0.31 ships no reader of an offline run (``wandb sync`` only uploads it), so ``read_offline_run`` parses the
run's transaction log (``run-<id>.wandb``) into wandb's own protobuf records, checksums checked; tables, images and
histograms are read from what those records point at.
"""

import csv
import functools
import json
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path

import datasets
import lightning as L
import numpy as np
import pytest
import wandb
from test_config import cfg_for
from wandb.proto import wandb_internal_pb2

from sacpolicy.decoding.types import GenerationResult, StepRecord
from sacpolicy.evaluation import add_intervals, add_speedups, flag_artefacts, row_from_results
from sacpolicy.pipeline.context import RunContext
from sacpolicy.pipeline.evaluate import track
from sacpolicy.pipeline.fit import track_calibration
from sacpolicy.pipeline.tracking import Tracker, flat_rows, make_tracker
from sacpolicy.training.distill import ACCEPT_STEPS, DistillSettings, train_draft
from sacpolicy.training.distill_data import DistillDataModule
from sacpolicy.training.predictor import Examples

BLOCK = 32768  # the log is LevelDB's format: 32 KiB blocks of chunks, each with a 7-byte header


@dataclass
class OfflineRun:
    dir: Path
    history: list[dict]  # one dict per logged step, nested where wandb nests (a table's "_type", "path", ...)
    config: dict
    summary: dict

    def logged(self, key: str) -> list:
        """Every value ``key`` was logged with, in order."""
        return [step[key] for step in self.history if key in step]

    def media(self, key: str, kind: str) -> dict:
        """The one ``kind`` ("table-file", "image-file", "histogram") logged under ``key``; files are read in."""
        (value,) = self.logged(key)
        assert value["_type"] == kind, value
        if kind == "table-file":
            return json.loads((self.dir / "files" / value["path"]).read_text())
        return value


def read_records(path):
    """The protobuf records of a transaction log: a header (":W&B", magic 0xBEE1, version), then chunks (crc32 of
    type + data, length, type: 1 a whole record, 2/3/4 its first/middle/last part) that never straddle a block."""
    data = Path(path).read_bytes()
    ident, magic, _ = struct.unpack("<4sHB", data[:7])
    assert (ident, magic) == (b":W&B", 0xBEE1), f"{path} is not a W&B transaction log"
    pos, part = 7, b""
    while pos + 7 <= len(data):
        if BLOCK - pos % BLOCK < 7:  # a block's tail too short for a header is padding
            pos += BLOCK - pos % BLOCK
            continue
        crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        assert zlib.crc32(chunk, zlib.crc32(bytes([kind]))) == crc, f"corrupt chunk before byte {pos} of {path}"
        part += chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(part)
            part = b""
            yield record


def read_offline_run(out_dir) -> OfflineRun:
    """The one offline run under ``out_dir/wandb``: its history steps, config and summary. Stops wandb's service
    first: ``run.finish()`` may return before the service has written the log out, which it does at the latest when
    it stops (at exit, or here)."""
    wandb.teardown()
    runs = list((Path(out_dir) / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, f"one W&B run per pipeline run, found {runs}"
    run = OfflineRun(runs[0], [], {}, {})
    for record in read_records(next(runs[0].glob("run-*.wandb"))):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            run.history.append(_nested(record.history.item))
        elif kind == "config":
            _merge(run.config, _nested(record.config.update))
        elif kind == "summary":
            _merge(run.summary, _nested(record.summary.update))
    return run


def _nested(items) -> dict:
    out = {}
    for item in items:
        *path, last = list(item.nested_key) or [item.key]
        d = out
        for key in path:
            d = d.setdefault(key, {})
        d[last] = json.loads(item.value_json)
    return out


def _merge(into: dict, new: dict) -> None:
    for key, value in new.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = value


# ---------------------------------------------------------------------- evaluation rows, built as evaluate builds them
CATEGORIES = ["code"] * 3 + ["chat"] * 3 + ["math"]  # math: one prompt, too few for an interval
POLICIES = {"ar": [(0, 0)], "best-static": [(3, 2), (3, 3)], "learned-hgb": [(4, 4), (2, 1), (0, 0), (4, 2)]}


def _result(plan, prompt: int, step_s: float):
    """A generation stepping through ``plan`` [(k, accepted)] twice, a step taking step_s plus noise per prompt."""
    rng = np.random.default_rng(prompt)
    steps = [StepRecord(step=i, drafter="draft" if k else None, k=k, drafted=k, accepted=a, emitted=a + 1,
                        context_len=10 + i, draft_s=0.001 * k, verify_s=step_s * (1 + 0.2 * rng.random()))
             for i, (k, a) in enumerate(plan * 2)]
    total = step_s + sum(s.draft_s + s.verify_s for s in steps)
    return GenerationResult(tokens=list(range(1 + sum(s.emitted for s in steps))), steps=steps, prompt_len=10,
                            prefill_s=step_s, total_s=total, finish_reason="length")


def eval_rows() -> list[dict]:
    rows = [row_from_results(name, mode, [(c, _result(plan, i, s)) for i, c in enumerate(CATEGORIES)],
                             price_per_hour=0.1, extra={"fallbacks": 0})
            for mode, s in (("simulated", 0.02), ("live", 0.01)) for name, plan in POLICIES.items()]
    add_speedups(rows)
    add_intervals(rows, resamples=200)
    flag_artefacts(rows)
    return rows


def test_flat_rows_turn_intervals_into_columns_and_drop_nested_data():
    rows = flat_rows(eval_rows())
    row = rows[-1]
    assert row["name"] == "learned-hgb" and row["speedup_vs_ar_lo"] <= row["speedup_vs_ar"] <= row["speedup_vs_ar_hi"]
    assert "speedup_vs_ar_ci" not in row and not any(isinstance(v, (dict, list)) for v in row.values())
    assert flat_rows([{"x_ci": None}]) == [{"x_lo": None, "x_hi": None}]  # no interval: empty cells


# ---------------------------------------------------------------------- one W&B run, read back
def distill_data(target):
    """Greedy target continuations of a few prompts (the distill stage's data module, cached in $SACPOLICY_CACHE)."""
    texts = ["Write a haiku.", "Sort a list in Python.", "What is 2 + 2?", "Name a colour.", "Say hi.", "Count to 3."]
    prompts = datasets.Dataset.from_list([{"prompt_id": f"p{i}", "input_ids": target.tokenizer(t)["input_ids"]}
                                          for i, t in enumerate(texts)])
    return DistillDataModule(target, prompts.select(range(4)), prompts.select(range(4, 6)), max_new_tokens=8,
                             samples=0, topk=8, batch_size=4, synthetic={"count": 0})


class FirstFeature:
    def predict(self, X):
        return X[:, 0]


@pytest.fixture(scope="module")
def wandb_run(tiny_target, tmp_path_factory):
    """A tracker and Lightning's WandbLogger built from the config as the pipeline builds them (``logger=wandb``),
    fed with evaluation rows, a calibration curve and a tiny distillation run."""
    out = tmp_path_factory.mktemp("wandb_run")
    rows = eval_rows()
    with pytest.MonkeyPatch.context() as mp:  # WandbLogger sets WANDB_MODE for the process
        for key, value in {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "SACPOLICY_CACHE": str(out / "cache")}.items():
            mp.setenv(key, value)
        cfg = cfg_for("experiment=smoke", "logger=wandb", tmp_path=out)
        tracker = make_tracker(cfg.tracker, out)
        try:
            track(tracker, rows, [])
            rng = np.random.default_rng(0)
            p = rng.random(200)  # a calibrated predictor: its one feature is the acceptance probability
            test = Examples(p[:, None], (rng.random(200) < p).astype(float), *np.zeros((5, 200)))
            track_calibration(tracker, "hgb", FirstFeature(), test, out / "plots")
            settings = DistillSettings(num_layers=1, vocab_size=512, max_steps=2, budget_minutes=None,
                                       val_check_interval=1.0, warmup_steps=1)
            trainer = functools.partial(L.Trainer, accelerator="cpu", devices=1, max_epochs=5, log_every_n_steps=1,
                                        enable_progress_bar=False, enable_model_summary=False,
                                        default_root_dir=str(out))
            with pytest.warns(UserWarning, match="will reuse this run"):  # one W&B run: the tracker's
                train_draft(tiny_target, distill_data(tiny_target), settings, trainer, out / "distill",
                            logger=RunContext(cfg, out).lightning_logger("distill"))
        finally:
            tracker.finish()
    return out, rows, read_offline_run(out)


def test_the_eval_table_holds_each_interval_as_two_columns(wandb_run):
    out, rows, run = wandb_run
    table = run.media("eval/rows", "table-file")
    cols = table["columns"]
    assert {"speedup_vs_ar_lo", "speedup_vs_ar_hi", "speedup_vs_best_static_lo", "speedup_vs_best_static_hi"} <= set(cols)
    got = {(r[cols.index("name")], r[cols.index("mode")]): dict(zip(cols, r)) for r in table["data"]}
    for row in rows:
        cell = got[row["name"], row["mode"]]
        assert [cell["speedup_vs_ar_lo"], cell["speedup_vs_ar_hi"]] == pytest.approx(row["speedup_vs_ar_ci"])
        assert cell["tokens_per_s"] == pytest.approx(row["tokens_per_s"])
    with open(out / "tables" / "eval" / "rows.csv") as f:  # logger=csv users get the same columns
        assert cols == next(csv.reader(f))


def test_bar_charts_of_tokens_per_s_and_per_call_for_each_mode(wandb_run):
    out, rows, run = wandb_run
    for key in ("tokens_per_s", "tokens_per_call"):
        for mode in ("live", "simulated"):
            name = f"eval/{key}_{mode}"
            chart = run.config["_wandb"]["visualize"][name]
            assert chart["panel_config"]["panelDefId"] == "wandb/bar/v0"
            assert chart["panel_config"]["fieldSettings"] == {"label": "policy", "value": key}
            bars = dict(run.media(f"{name}_table", "table-file")["data"])
            assert bars == pytest.approx({r["name"]: r[key] for r in rows if r["mode"] == mode})
            assert (out / "tables" / f"{name}.csv").is_file()


def test_per_category_rows_with_intervals_where_there_are_enough_prompts(wandb_run):
    _, rows, run = wandb_run
    table = run.media("eval/per_category", "table-file")
    cols = table["columns"]
    cells = {(r[cols.index("name")], r[cols.index("mode")], r[cols.index("category")]): dict(zip(cols, r))
             for r in table["data"]}
    assert len(cells) == len(rows) * len(set(CATEGORIES))
    code, math = cells["learned-hgb", "live", "code"], cells["learned-hgb", "live", "math"]
    assert code["n_prompts"] == 3 and code["speedup_vs_ar_lo"] <= code["speedup_vs_ar"] <= code["speedup_vs_ar_hi"]
    assert math["n_prompts"] == 1 and math["speedup_vs_ar_lo"] is None and math["speedup_vs_ar"] is not None


def test_calibration_curve_image(wandb_run):
    out, _, run = wandb_run
    image = run.media("fit/calibration_hgb", "image-file")
    assert (run.dir / "files" / image["path"]).read_bytes().startswith(b"\x89PNG")
    assert (out / "plots" / "calibration_hgb.png").is_file()


def test_draft_training_curves_land_in_the_same_run(wandb_run):
    _, _, run = wandb_run  # read_offline_run found one run: Lightning's WandbLogger reused the tracker's
    # keys carry the stage, so the distilled draft's and the head's curves stay apart in one run
    loss = run.logged("distill-train/loss")
    assert len(loss) == 2 and all(v > 0 for v in loss) and not run.logged("train/loss")
    val = [s for s in run.history if "distill-val/loss" in s]
    assert len(val) == 2 and all("trainer/global_step" in s for s in val)
    steps = [f"distill-val/acc_step{j}" for j in range(ACCEPT_STEPS)]
    for s in val:
        assert {"distill-val/match_rate", "distill-val/accept_len", *steps} <= set(s), sorted(s)
        # step 1 of a chain is the next-token match
        assert s["distill-val/acc_step0"] == pytest.approx(s["distill-val/match_rate"])
        acc = np.array([s[k] for k in steps])
        assert s["distill-val/accept_len"] == pytest.approx(np.cumprod(acc).sum(), rel=1e-5)


def test_histograms_of_k_chosen_and_accepted_length_per_policy(wandb_run):
    out, rows, run = wandb_run
    for key, name in (("k_hist", "k_chosen"), ("accept_hist", "accepted_len")):
        for row in rows:
            label = f"{name}/{row['name']} ({row['mode']})"
            if not row[key]:  # AR drafts nothing: no accepted-length histogram
                assert not run.logged(label)
                continue
            hist = run.media(label, "histogram")
            centres = [(a + b) / 2 for a, b in zip(hist["bins"], hist["bins"][1:])]
            assert {str(round(c)): n for c, n in zip(centres, hist["values"]) if n} == row[key]
        with open(out / "tables" / f"{name}.csv") as f:
            assert next(csv.reader(f)) == ["policy", "value", "count"]


def test_csv_tracker_writes_the_same_tables_without_wandb(tmp_path):
    rows = eval_rows()
    track(Tracker(tmp_path), rows, [])
    tables = {str(p.relative_to(tmp_path / "tables")) for p in (tmp_path / "tables").rglob("*.csv")}
    assert tables == {"eval/rows.csv", "eval/per_category.csv", "k_chosen.csv", "accepted_len.csv",
                      *(f"eval/{k}_{m}.csv" for k in ("tokens_per_s", "tokens_per_call") for m in ("live", "simulated"))}
    with open(tmp_path / "tables" / "k_chosen.csv") as f:
        hist = [r for r in csv.DictReader(f) if r["policy"] == "learned-hgb (live)"]
    assert {r["value"]: int(r["count"]) for r in hist} == rows[-1]["k_hist"]
