"""The served proposer's step log as files: what the writer (``sacpolicy.export.steplog``) and the readers
(``traces.steplog_read`` and what builds on it) agree on, and nothing else. A leaf: pyarrow and ``traces.schema``'s
error only, so the writer in vLLM's worker and every reader import one definition.

A log is a directory of Parquet shards named ``steps-<UTC start, YYYYmmddTHHMMSS>-<server run id>-<n>.parquet``, each
a table of ``STEP_SCHEMA`` whose schema metadata holds, under ``META_KEY``, the server's provenance as JSON
(its target, policy, drafters and k cap, and the counts its writer kept: ``dropped``, ``bad_records``,
``write_failures``).
"""

from __future__ import annotations

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
])

class StepLogError(TraceError):
    pass


def check_rate(rate: float, env: str) -> float:
    """``rate`` (the share of requests logged), refused unless in (0, 1]; ``env``: the setting to name in the fix."""
    if not 0.0 < rate <= 1.0:
        raise StepLogError(f"the step log's sampling rate must be in (0, 1], got {rate}; set {env} (or --log-rate) "
                           "to the share of requests to log, e.g. 0.1")
    return float(rate)
