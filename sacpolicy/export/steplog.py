"""The served proposer's step log: what ``PolicyProposer`` saw, chose and got, per request and step, in vLLM.

Opt-in: ``SACPOLICY_PROPOSER_LOG=<dir>`` (``scripts/serve.py --log-steps DIR``) turns it on, and
``SACPOLICY_PROPOSER_LOG_RATE`` (``--log-rate``, default 1) samples requests by a hash of the context they are first
seen with, so a request is logged whole or not at all. With logging off the proposer pays one ``if`` per step. One
writer per engine: vLLM builds the proposer on every tensor-parallel rank, all seeing the same rows, and only the
first of them logs (``engine_rank``; the others pay the same one ``if``), so a log holds each request once.

Per logged request step (``traces.logformat.STEP_SCHEMA``): the request's log id (vLLM's hook gives no request ids;
requests are found again by their committed tokens, as ``_History`` finds them), its step, the feature row the policy
read (``runtime.features.feature_row`` of the state the policy decided on for the drafter it chose, the primary
drafter's when it chose none, position 0 of the block; the plan's other positions differ only in
``position``/``log_context_len``), the drafter, the k chosen, the tokens drafted, the live batch size,
the id of the policy that planned it (``PolicyProposer.policy_id``: a deploy's version, a canary's own), the
proposer's seconds for the whole engine step, and the tokens: the whole context on first sight (the prompt plus the
prefill's token), then the tokens committed since the previous step, whose count minus one is the previous block's
accepted tokens. On first sight also the request's sampling settings (temperature, top_p, top_k), read from vLLM's
input batch (``PolicyProposer`` finds it on the model runner that calls its hook, which passes token arrays
only; the temperature rounded to 6 decimals, as vLLM holds it in float32): null where it could not be read.
Penalties (repetition, frequency, presence) are not logged; traces take the logged settings as all there was.
``traces.steplog_read`` rebuilds every request's token sequence from these alone and ``traces.production`` turns the
log into traces.

The engine thread only hands one record per engine step to the writer's bounded queue (``steplog_writer``, never
waiting: a full queue drops the step's records, counted in ``dropped``; a request missing a step in the middle cannot
be rebuilt and is left out of the traces, one missing its last steps is rebuilt up to them); a daemon thread writes
them as Parquet shards every ``SACPOLICY_PROPOSER_LOG_FLUSH_S`` seconds and on ``close`` (also at interpreter exit,
and when a multiprocessing child that holds the log ends normally), leaving out and counting a record it cannot
build or store (``bad_records``) and going on. What the log costs is counted where it is spent (``cost``): the engine
thread's seconds in ``step`` and the writer thread's CPU seconds (building records and shards), which
``PolicyProposer``'s stats file reports and ``bench_serve`` sets against the served run's time. A request is found
again only from the engine step just before (vLLM proposes for every running request each step), so a later request
with the same prompt starts its own log, and a request vLLM preempted and resumed later is logged as a new one whose
first context holds its tokens so far. vLLM force-kills its worker process when the server shuts down, so the records
of the last flush interval are lost then: stop a server at least that long after its last request, or set the
interval lower (``bench_serve``'s reload drill and ``serve_logged.py`` use 1-2 s). Each shard's metadata names the
target (the policy's provenance and vLLM's model, tokenizer and vocabulary), the policy, the drafter and the server's
k cap, so logs of another target are refused when they are read.

Privacy and retention: the log stores the token ids of the prompts and of the outputs (detokenizing them gives the
text back), so treat the directory as you treat request logs. Nothing is ever deleted by sacpolicy: shards are named
``steps-<UTC start of the shard, YYYYmmddTHHMMSS>-<server run id>-<shard number>.parquet``, so they sort by time;
delete old ones yourself (e.g. ``find DIR -name 'steps-*.parquet' -mtime +30 -delete``). A request whose steps span
a deleted shard is incomplete and is skipped (with a count) when traces are rebuilt.
"""

from __future__ import annotations

import atexit
import hashlib
import logging
import os
import time
import uuid
from multiprocessing import util as mp_util
from pathlib import Path

import numpy as np

from sacpolicy.export.steplog_writer import FLUSH_S, SHARD_ROWS, ShardWriter
from sacpolicy.export.vllm_adapter import engine_rank
from sacpolicy.policy.features import row_context
from sacpolicy.runtime.features import accepted_prefix
from sacpolicy.traces.logformat import LOG_FORMAT, check_rate

logger = logging.getLogger(__name__)

RATE_ENV = "SACPOLICY_PROPOSER_LOG_RATE"  # share of requests logged, in (0, 1] (default 1)
FLUSH_ENV = "SACPOLICY_PROPOSER_LOG_FLUSH_S"  # seconds between shards while records arrive (default FLUSH_S)
QUEUE_SIZE = 4096  # engine steps queued at most


def target_provenance(vllm_config, art) -> dict:
    """What a log's tokens mean: the policy's target and vLLM's served model, tokenizer and vocabulary size."""
    mc = vllm_config.model_config
    vocab = getattr(mc, "get_vocab_size", None)
    return {"target": (art.provenance or {}).get("target"), "model": getattr(mc, "model", None),
            "tokenizer": getattr(mc, "tokenizer", None), "vocab_size": vocab() if callable(vocab) else None}


class StepLogger:
    """The step log of one proposer (see the module docstring). ``step`` runs on the engine thread; ``writer`` (a
    ``ShardWriter``: a daemon thread) writes. ``meta``: the shard metadata (``for_proposer``). The log keeps no
    request table of its own: each row brings the request's memory from the proposer's one table (``_History``),
    where the log keeps its entry (``memo.log``)."""

    def __init__(self, out_dir, meta: dict, *, rate: float = 1.0, queue_size: int = QUEUE_SIZE,
                 shard_rows: int = SHARD_ROWS, flush_s: float = FLUSH_S):
        self.out_dir, self.rate = Path(out_dir), check_rate(rate, RATE_ENV)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.run_id = uuid.uuid4().hex[:8]
        self.meta = {"format": LOG_FORMAT, "run_id": self.run_id, "rate": self.rate, **meta}
        self._ids = self._steps = 0
        self.engine_s = 0.0  # the log's own cost on the engine thread (the writer counts its CPU seconds)
        self.writer = ShardWriter(self.out_dir, self.meta, queue_size=queue_size, shard_rows=shard_rows,
                                  flush_s=flush_s)
        # written at exit: atexit for a main process; a multiprocessing child exits through os._exit (no atexit)
        # after running multiprocessing's finalizers. A killed process writes nothing (module docstring)
        atexit.register(self.close)
        mp_util.Finalize(self, self.close, exitpriority=10)

    @classmethod
    def for_proposer(cls, vllm_config, art, proposer, out_dir) -> StepLogger | None:
        """The log of ``proposer`` (a ``PolicyProposer``, its artifact ``art``) in ``out_dir``; None on a worker
        that is not its engine's writer (``engine_rank``: one writer per engine, the first of the workers that run
        the proposer; the others see the same rows and would log every request again)."""
        rank, peers = engine_rank(vllm_config)
        if rank:
            logger.info("the step log of this engine is written by its first proposer worker; this one (%d of %d) "
                        "logs nothing", rank, peers)
            return None
        served = proposer.served
        meta = {"target": target_provenance(vllm_config, art), **served.describe(),  # the policy it started with
                "k_cap": int(proposer.k_cap), "max_model_len": int(proposer.max_model_len),
                "proposer_workers": peers,  # the engine's workers that ran the proposer (this one alone logs)
                "served_policies": {served.policy_id: served.describe()}}
        return cls(out_dir, meta, rate=float(os.environ.get(RATE_ENV, "1")), queue_size=QUEUE_SIZE,
                   flush_s=float(os.environ.get(FLUSH_ENV, FLUSH_S)))

    def describe(self, served) -> None:
        """Record a policy that plans steps (a hot reload's, a canary's: ``reload.ServedPolicy``) in the metadata of
        every shard written from now on (``served_policies``, by policy id), so shards after a swap describe the
        policy that made their steps. Copy on write: the writer thread reads the metadata it was handed whole."""
        known = self.writer.meta.get("served_policies", {})
        if served.policy_id not in known:
            self.writer.meta = {**self.writer.meta,
                                "served_policies": {**known, served.policy_id: served.describe()}}

    # ------------------------------------------------------------------ the engine thread
    def _sampled(self, context: np.ndarray) -> bool:
        if self.rate >= 1.0:
            return True
        h = hashlib.blake2b(context.tobytes(), digest_size=8).digest()
        return int.from_bytes(h, "little") < self.rate * 2.0**64

    def step(self, rows, batch: int, seconds: float, drafter: str) -> None:
        """One engine step's rows: (context, tokens committed since the last step, the state the policy decided on,
        k chosen, the drafted block's tokens, the planning policy's id: ``ServedPolicy.policy_id``, a canary's own,
        the request's sampling settings (temperature, top_p, top_k) or None, the drafter that drafted the block or
        None, the request's memory and whether the policy's guard decided the step (``Decision.guard``); the memory
        is found again by the proposer's one request table (``_History``, which also
        finds a request after engine steps vLLM ran without the hook); ``drafter``: the primary one, whose feature
        row a step without a block keeps). Queues the sampled requests' records; never blocks.

        Where vLLM skipped the proposer (while any request of the batch is within ``num_speculative_tokens`` of the
        context limit, vLLM drafts for no request of it and does not call the hook: ``_input_fits_in_drafter``), the
        rows come back several tokens on: the tokens since the last record are its ``committed``, the last block's
        accepted tokens are those equal to the block (a rejected draft token is never the one committed in its
        place), and the tokens committed in the steps the proposer did not see are the record's ``unseen``."""
        t0 = time.perf_counter()
        try:
            self._step(rows, batch, seconds, drafter)
        except Exception as exc:  # the log must never take the engine down: the step's records are lost, counted
            self.writer.lost(len(rows), "rows of an engine step", exc)
        finally:
            self.engine_s += time.perf_counter() - t0

    def _step(self, rows, batch: int, seconds: float, drafter: str) -> None:
        out = []
        self._steps += 1
        for context, committed, state, k, block, policy, sampling, name, memo, guard in rows:
            entry, first = memo.log, memo.log is None
            if first:  # [log id (None: not sampled), step, drafted, prompt length, last block, context length seen]
                self._ids += 1
                entry = [f"{self.run_id}-{self._ids:08d}" if self._sampled(context) else None, -1, 0,
                         len(context) - committed, [], len(context) - committed]
            new = context[entry[5]:]
            accepted = accepted_prefix(entry[4], new) if len(new) != committed else committed - 1
            entry[1] += 1
            if entry[0] is not None:
                out.append((entry[0], entry[1], entry[3], context.copy() if first else None,
                            None if first else new.copy(), -1 if first else entry[2], -1 if first else accepted,
                            0 if first else len(new) - accepted - 1, k, len(block),
                            row_context(state, name or drafter), len(context), policy,
                            sampling if first else None, name if block else None, bool(guard)))
            entry[2], entry[4], entry[5] = len(block), list(block), len(context)
            memo.log = entry
        if out:
            self.writer.put((time.time(), seconds, batch, out))

    @property
    def dropped(self) -> int:
        """Records dropped because the writer's queue was full."""
        return self.writer.dropped

    def cost(self) -> dict:
        """What the log has cost so far: ``engine_s``, seconds the engine thread spent in ``step``; ``writer_cpu_s``,
        CPU seconds of the writer thread (records, Parquet, files); the steps, and the writer's counts (records
        written, dropped for a full queue, bad: ``bad_records``; shards written and failed: ``write_failures``)."""
        return {"engine_s": round(self.engine_s, 6), "writer_cpu_s": round(self.writer.cpu_s, 6),
                "steps": self._steps, **self.writer.counts()}

    def close(self, timeout: float = 30.0) -> None:
        """Write what is queued and stop the writer (idempotent; also run at interpreter exit); at most ``timeout``
        seconds for a busy writer, none for one that is gone."""
        self.writer.close(timeout)
