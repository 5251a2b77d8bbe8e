"""The served proposer's step log as files: what the writer (``sacpolicy.export.steplog``) and the readers
(``traces.steplog_read`` and what builds on it) agree on, and nothing else. A leaf: pyarrow, the standard library and
``traces.schema``'s error only, so the writer in vLLM's worker and every reader import one definition.

A log is a directory of Parquet shards named ``steps-<UTC start, YYYYmmddTHHMMSS>-<server run id>-<n>.parquet``, each
a table of ``STEP_SCHEMA`` whose schema metadata holds, under ``META_KEY``, the server's provenance as JSON
(its target, policy, drafters and k cap, and the counts its writer kept: ``dropped``, ``bad_records``,
``write_failures``).
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa

from sacpolicy.traces.schema import TraceError

LOG_FORMAT = 1  # the step log's record layout (STEP_SCHEMA) and shard metadata
META_KEY = "sacpolicy.steplog"  # the Parquet schema metadata key of a shard's provenance (JSON)
SHARD_PREFIX = "steps-"
STEP_SCHEMA = pa.schema([
    ("request", pa.string()), ("step", pa.int32()),  # the request's log id and its step (0: first sight)
    ("unix_s", pa.float64()), ("policy", pa.string()),  # when, and the id of the policy that planned the step
    ("prompt_len", pa.int32()), ("context_len", pa.int32()),  # committed tokens when the policy decided
    ("context", pa.list_(pa.int32())),  # step 0 only: the whole context (prompt + the prefill's token)
    ("committed", pa.list_(pa.int32())),  # steps > 0: the tokens committed since the previous step
    ("prev_drafted", pa.int32()), ("prev_accepted", pa.int32()),  # the previous block's (-1 at step 0)
    # tokens committed in engine steps the proposer did not see since the previous step (vLLM skips the hook while a
    # request of the batch is near the context limit): committed = prev_accepted + 1 + unseen; null in older logs
    ("unseen", pa.int32()),
    ("k", pa.int32()), ("drafted", pa.int32()),  # k chosen (0: no draft) and tokens proposed this step
    ("features", pa.list_(pa.float32())),  # runtime.features.feature_row at position 0 of the policy's plan
    ("batch_size", pa.int32()), ("proposer_s", pa.float64()),  # live rows; the proposer's seconds for the step
    # step 0 only, null when the proposer could not read them (logs written before these columns existed have none):
    # the request's sampling settings as vLLM's input batch held them (top_k: vLLM's, the vocabulary size when off)
    ("temperature", pa.float64()), ("top_p", pa.float64()), ("top_k", pa.int32()),
    # the lookup drafter that drafted the block (null: none; logs written before this column: the primary drafter)
    ("drafter", pa.string()),
    # the learning policy's guard decided the step (it fell back to a static block: ``Decision.guard``); null in
    # logs written before this column
    ("guard", pa.bool_()),
])
# columns that logs of this format written before they existed lack (readers take them as null)
LATER_COLUMNS = frozenset({"unseen", "temperature", "top_p", "top_k", "drafter", "guard"})
# what every shard's metadata holds besides "format" (the counts are optional: older shards lack some)
META_FIELDS = ("run_id", "target", "drafter", "k_cap", "max_model_len", "load_aware", "rule_drafters")
# the fix for a damaged shard, in every error that names one
DAMAGED = ("the shard is damaged (a crash or an incomplete copy: shards are written atomically). Delete it or copy it "
           "again, or read the log with skip_corrupt=True (refit.skip_corrupt=true), which skips and counts it; its "
           "requests are then left out as incomplete")


class StepLogError(TraceError):
    pass


class CorruptShard(StepLogError):
    """A shard that cannot be read or whose metadata or columns are damaged (``read_step_log(skip_corrupt=True)``
    skips these, and only these)."""


def check_rate(rate: float, env: str) -> float:
    """``rate`` (the share of requests logged), refused unless in (0, 1]; ``env``: the setting to name in the fix."""
    if not 0.0 < rate <= 1.0:
        raise StepLogError(f"the step log's sampling rate must be in (0, 1], got {rate}; set {env} (or --log-rate) "
                           "to the share of requests to log, e.g. 0.1")
    return float(rate)


def shard_files(log_dir) -> list[Path]:
    """The shards of the log at ``log_dir``, in name order (the time each began)."""
    return sorted(Path(log_dir).glob(f"{SHARD_PREFIX}*.parquet"))


def shard_meta(path, schema: pa.Schema) -> dict:
    """The provenance of the shard at ``path`` (``schema``: its Parquet schema), checked against this format: a
    ``StepLogError`` naming the file and the fix when the metadata is missing or damaged, or the columns are not a
    step log's (``CorruptShard``, which readers may skip), or the shard is of another format."""
    raw = (schema.metadata or {}).get(META_KEY.encode())
    if raw is None:
        raise CorruptShard(f"{path} is not a step-log shard of format {LOG_FORMAT}: it holds no {META_KEY} metadata "
                           "(another tool's file under the shards' name, or a shard whose metadata was lost); move it "
                           f"out of {Path(path).parent} or log again with this sacpolicy")
    try:
        meta = json.loads(raw)
    except ValueError as exc:  # invalid JSON, or bytes that are not UTF-8
        raise CorruptShard(f"{path}'s step-log metadata ({META_KEY}) is not valid JSON ({exc}): {DAMAGED}") from exc
    if not isinstance(meta, dict):
        raise CorruptShard(f"{path}'s step-log metadata ({META_KEY}) is not a JSON object: {DAMAGED}")
    if "format" in meta and meta["format"] != LOG_FORMAT:
        raise StepLogError(f"{path} is not a step-log shard of format {LOG_FORMAT} (its format: {meta['format']!r}, "
                           f"another sacpolicy's); move it out of {Path(path).parent} or read it with the sacpolicy "
                           "that wrote it")
    missing = [k for k in ("format", *META_FIELDS) if k not in meta]
    if missing:
        raise CorruptShard(f"{path}'s step-log metadata ({META_KEY}) lacks {missing}: {DAMAGED}")
    if not isinstance(meta["target"], dict) or not isinstance(meta["drafter"], dict):
        raise CorruptShard(f"{path}'s step-log metadata ({META_KEY}) holds a target or drafter that is not a JSON "
                           f"object: {DAMAGED}")
    absent = sorted(set(STEP_SCHEMA.names) - LATER_COLUMNS - set(schema.names))
    if absent:
        raise CorruptShard(f"{path} lacks the step log's columns {absent}: {DAMAGED}")
    return meta
