"""The served proposer's step log: what ``PolicyNgramProposer`` saw, chose and got, per request and step, in vLLM.

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
the id of the policy that planned it (``PolicyNgramProposer.policy_id``: a deploy's version, a canary's own), the
proposer's seconds for the whole engine step, and the tokens: the whole context on first sight (the prompt plus the
prefill's token), then the tokens committed since the previous step, whose count minus one is the previous block's
accepted tokens. On first sight also the request's sampling settings (temperature, top_p, top_k), read from vLLM's
input batch (``PolicyNgramProposer`` finds it on the model runner that calls its hook, which passes token arrays
only; the temperature rounded to 6 decimals, as vLLM holds it in float32): null where it could not be read.
Penalties (repetition, frequency, presence) are not logged; traces take the logged settings as all there was.
``traces.steplog_read`` rebuilds every request's token sequence from these alone and ``traces.production`` turns the
log into traces.

The engine thread only appends one record per engine step to a bounded ``queue.Queue`` (``put_nowait``): when the
queue is full the step's records are dropped and counted (``dropped``; a request missing a step in the middle cannot
be rebuilt and is left out of the traces, one missing its last steps is rebuilt up to them), never waited for. What
the log costs is counted where it is spent (``cost``): the engine thread's seconds in ``step`` and the writer thread's
CPU seconds (building records and shards), which ``PolicyNgramProposer``'s stats file reports and ``bench_serve`` sets
against the served run's time. A request is found again only from the engine step just before (vLLM proposes for every
running request each step), so a later request with the same prompt starts its own log, and a request vLLM preempted
and resumed later is logged as a new one whose first context holds its tokens so far. A daemon thread writes the
records as Parquet shards atomically (a temporary file, then a rename); it wakes every ``DRAIN_S`` to take what is
queued, not at every step, and writes every ``SACPOLICY_PROPOSER_LOG_FLUSH_S`` seconds, every ``SHARD_ROWS`` rows, and
on ``close`` (also at interpreter exit, and when a multiprocessing child that holds the log ends normally). A record
that cannot be built or does not fit the schema is left out and counted (``bad_records``), a shard that cannot be
written too (``write_failures``), each logged once; the writer goes on with later steps, and both counts are in the
stats (``cost``) and in every shard's metadata. vLLM force-kills its worker process when the server shuts down, so
the records of the last flush interval are lost then: stop a server at least that long after its last request, or set
the interval lower (``bench_serve``'s reload drill and ``serve_logged.py`` use 1-2 s). Each shard's metadata names the target (the policy's provenance and vLLM's model,
tokenizer and vocabulary), the policy, the drafter and the server's k cap, so logs of another target are refused when
they are read.

Privacy and retention: the log stores the token ids of the prompts and of the outputs (detokenizing them gives the
text back), so treat the directory as you treat request logs. Nothing is ever deleted by sacpolicy: shards are named
``steps-<UTC start of the shard, YYYYmmddTHHMMSS>-<server run id>-<shard number>.parquet``, so they sort by time;
delete old ones yourself (e.g. ``find DIR -name 'steps-*.parquet' -mtime +30 -delete``). A request whose steps span
a deleted shard is incomplete and is skipped (with a count) when traces are rebuilt.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import logging
import os
import queue
import threading
import time
import uuid
from collections import OrderedDict
from datetime import datetime, timezone
from multiprocessing import util as mp_util
from pathlib import Path

import numpy as np

from sacpolicy.policy.features import row_context
from sacpolicy.runtime.features import accepted_prefix, feature_row
from sacpolicy.traces.logformat import LOG_FORMAT, META_KEY, SHARD_PREFIX, STEP_SCHEMA, check_rate

logger = logging.getLogger(__name__)

RATE_ENV = "SACPOLICY_PROPOSER_LOG_RATE"  # share of requests logged, in (0, 1] (default 1)
FLUSH_ENV = "SACPOLICY_PROPOSER_LOG_FLUSH_S"  # seconds between shards while records arrive (default FLUSH_S)
QUEUE_SIZE, SHARD_ROWS, FLUSH_S = 4096, 50_000, 30.0  # engine steps queued at most; rows per shard at most
DRAIN_S = 0.5  # the writer takes the queued steps this often (a wake per engine step would cost the engine more)
_STOP = object()


def target_provenance(vllm_config, art) -> dict:
    """What a log's tokens mean: the policy's target and vLLM's served model, tokenizer and vocabulary size."""
    mc = vllm_config.model_config
    vocab = getattr(mc, "get_vocab_size", None)
    return {"target": (art.provenance or {}).get("target"), "model": getattr(mc, "model", None),
            "tokenizer": getattr(mc, "tokenizer", None), "vocab_size": vocab() if callable(vocab) else None}


def engine_rank(vllm_config) -> tuple[int, int]:
    """(this worker's place among the workers of its engine that run the proposer, how many run it). vLLM builds the
    proposer on every worker of the last pipeline stage: each tensor-parallel (and prefill-context-parallel) rank,
    each seeing the same rows and drafting the same blocks. From ``vllm_config.parallel_config``: ``rank``, which
    vLLM's worker sets to its global rank, tensor-parallel ranks innermost, then prefill-context-parallel ones, so
    ``rank`` modulo their product is the place; without a parallel config (not in vLLM), torch.distributed's rank
    and world size when a process group is initialised, else (0, 1)."""
    pc = getattr(vllm_config, "parallel_config", None)
    if pc is None:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
        return 0, 1
    peers = int(getattr(pc, "tensor_parallel_size", 1)) * int(getattr(pc, "prefill_context_parallel_size", 1))
    return int(getattr(pc, "rank", 0)) % peers, peers


class StepLogger:
    """The step log of one proposer (see the module docstring). ``step`` runs on the engine thread; a daemon thread
    writes. ``meta``: the shard metadata (``for_proposer``); ``key``: a context's key (the proposer's ``_History``'s).
    """

    def __init__(self, out_dir, meta: dict, key, *, rate: float = 1.0, capacity: int = 1024,
                 queue_size: int = QUEUE_SIZE, shard_rows: int = SHARD_ROWS, flush_s: float = FLUSH_S):
        self.key = key
        self.out_dir, self.rate = Path(out_dir), check_rate(rate, RATE_ENV)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.run_id = uuid.uuid4().hex[:8]
        self.meta = {"format": LOG_FORMAT, "run_id": self.run_id, "rate": self.rate, **meta}
        self.capacity, self.shard_rows, self.flush_s = capacity, shard_rows, flush_s
        # key of a request's context -> [entry]; entry = [log id (None: not sampled), step, drafted, prompt length,
        # the engine step it was last seen at, its last block's tokens, the context length it was last seen at]
        self.requests: OrderedDict = OrderedDict()
        self._last: list = []  # (key, entry) of the rows of the step before
        self.queue: queue.Queue = queue.Queue(maxsize=queue_size)
        self.dropped = self.written = self.shards = self.write_failures = self._ids = self._steps = 0
        self.bad_records = 0  # records that could not be built or did not fit STEP_SCHEMA: left out, counted
        self._told: set[str] = set()  # the failures already logged (each kind once)
        self.engine_s = self.writer_cpu_s = 0.0  # the log's own cost: engine-thread seconds, writer CPU seconds
        self._closed = False
        self.drain_s = min(DRAIN_S, flush_s)
        self._wake = threading.Event()  # set by close: drain now
        self.thread = threading.Thread(target=self._run, name="sacpolicy-steplog", daemon=True)
        self.thread.start()
        # written at exit: atexit for a main process; a multiprocessing child exits through os._exit (no atexit)
        # after running multiprocessing's finalizers. A killed process writes nothing (module docstring)
        atexit.register(self.close)
        mp_util.Finalize(self, self.close, exitpriority=10)

    @classmethod
    def for_proposer(cls, vllm_config, art, proposer, out_dir) -> StepLogger | None:
        """The log of ``proposer`` (a ``PolicyNgramProposer``, its artifact ``art``) in ``out_dir``; None on a worker
        that is not its engine's writer (``engine_rank``: one writer per engine, the first of the workers that run
        the proposer; the others see the same rows and would log every request again)."""
        rank, peers = engine_rank(vllm_config)
        if rank:
            logger.info("the step log of this engine is written by its first proposer worker; this one (%d of %d) "
                        "logs nothing", rank, peers)
            return None
        spec = art.drafters[proposer.drafter]
        meta = {"target": target_provenance(vllm_config, art), "policy_dir": str(art.path),
                "drafter": {"name": proposer.drafter, "kind": spec.kind, "max_ngram": spec.max_ngram,
                            "min_ngram": spec.min_ngram},
                # every lookup drafter served, the primary first: what production traces teacher-force
                "drafters": {n: s.to_dict() for n, s in proposer.lookup_specs.items()},
                "k_cap": int(proposer.k_cap), "max_model_len": int(proposer.max_model_len),
                "load_aware": bool(proposer.load_aware), "rule_drafters": list(proposer.rule.drafters),
                "proposer_workers": peers}  # the engine's workers that ran the proposer (this one alone logs)
        return cls(out_dir, meta, proposer.history._key, rate=float(os.environ.get(RATE_ENV, "1")),
                   capacity=proposer.history.capacity, queue_size=QUEUE_SIZE,
                   flush_s=float(os.environ.get(FLUSH_ENV, FLUSH_S)))

    # ------------------------------------------------------------------ the engine thread
    def _sampled(self, context: np.ndarray) -> bool:
        if self.rate >= 1.0:
            return True
        h = hashlib.blake2b(context.tobytes(), digest_size=8).digest()
        return int.from_bytes(h, "little") < self.rate * 2.0**64

    def step(self, rows, batch: int, seconds: float, drafter: str) -> None:
        """One engine step's rows: (context, tokens committed since the last step, the state the policy decided on,
        k chosen, the drafted block's tokens, the planning policy's id: ``PolicyNgramProposer.policy_id``, a canary's
        own; optionally the request's sampling settings (temperature, top_p, top_k) or None, and the drafter that
        drafted the block, None for none; ``drafter``: the primary one, whose feature row a step without a block
        keeps). Finds each request (all
        lookups before any new entry, so a request one step behind an identical one never takes its entry), queues
        the sampled ones' records; never blocks.

        A request is found again only from the step just before: vLLM proposes for every running request each step,
        so an entry older than that is a finished request's, and a later request reaching the same context (the
        same prompt sent again) starts its own log instead of continuing that one. Except where vLLM skips the
        proposer: while any request of the batch is within ``num_speculative_tokens`` of the context limit, vLLM
        drafts for no request of it and does not call the hook (``_input_fits_in_drafter``), so the rows come back
        several tokens on. A row found under no entry is then matched to one of the step before whose context is a
        prefix of its own; the tokens since are its ``committed``, the last block's accepted tokens are those equal to
        the block (a rejected draft token is never the one committed in its place), and the tokens committed in the
        steps the proposer did not see are the record's ``unseen``."""
        t0 = time.perf_counter()
        try:
            self._step(rows, batch, seconds, drafter)
        except Exception as exc:  # the log must never take the engine down: the step's records are lost, counted
            self._bad(len(rows), "an engine step's rows", exc)
        finally:
            self.engine_s += time.perf_counter() - t0

    def _step(self, rows, batch: int, seconds: float, drafter: str) -> None:
        entries, out = [], []
        self._steps += 1
        last, self._last = self._last, []
        for context, committed, *_ in rows:
            key = self.key(context[: len(context) - committed])
            found = self.requests.get(key)
            if found is not None:
                found[:] = [e for e in found if e[4] == self._steps - 1]  # finished requests' entries go
                if not found:
                    del self.requests[key]
            entries.append(found.pop(0) if found else None)
        for j, (context, *_) in enumerate(rows):
            if entries[j] is None and last:
                entries[j] = self._after_unseen_steps(context, last)
        for entry, (context, committed, state, k, block, policy, *rest) in zip(entries, rows):
            sampling, name = (rest + [None, None])[:2]
            first = entry is None
            if first:
                self._ids += 1
                entry = [f"{self.run_id}-{self._ids:08d}" if self._sampled(context) else None, -1, 0,
                         len(context) - committed, 0, [], len(context) - committed]
            seen = entry[6]  # the context length the request was last seen at
            new = context[seen:]
            accepted = accepted_prefix(entry[5], new) if len(new) != committed else committed - 1
            entry[1] += 1
            if entry[0] is not None:
                out.append((entry[0], entry[1], entry[3], context.copy() if first else None,
                            None if first else new.copy(), -1 if first else entry[2], -1 if first else accepted,
                            0 if first else len(new) - accepted - 1, k, len(block),
                            row_context(state, name or drafter), len(context), policy,
                            sampling if first else None, name if block else None))
            entry[2], entry[4], entry[5], entry[6] = len(block), self._steps, list(block), len(context)
            key = self.key(context)
            self.requests.setdefault(key, []).append(entry)
            self._last.append((key, entry))
        while len(self.requests) > self.capacity:  # finished requests are never looked up again
            self.requests.popitem(last=False)
        if out:
            try:
                self.queue.put_nowait((time.time(), seconds, batch, out))
            except queue.Full:
                self.dropped += len(out)

    def _after_unseen_steps(self, context: np.ndarray, last: list) -> list | None:
        """The entry of the step before whose context is a proper prefix of ``context`` and that no row took yet
        (taken out of ``requests``), None if there is none."""
        for key, entry in last:
            n = entry[6]
            if n >= len(context) or entry[4] != self._steps - 1:
                continue
            waiting = self.requests.get(key)
            if waiting and any(e is entry for e in waiting) and self.key(context[:n]) == key:
                waiting[:] = [e for e in waiting if e is not entry]  # by identity: unsampled twins compare equal
                if not waiting:
                    del self.requests[key]
                return entry
        return None

    # ------------------------------------------------------------------ the writer thread
    def cost(self) -> dict:
        """What the log has cost so far: ``engine_s``, seconds the engine thread spent in ``step``; ``writer_cpu_s``,
        CPU seconds of the writer thread (records, Parquet, files); the steps, records written, dropped (a full
        queue) and bad (``bad_records``: records that could not be built or did not fit ``STEP_SCHEMA``), and the
        shards written and failed (``write_failures``: their rows are lost)."""
        return {"engine_s": round(self.engine_s, 6), "writer_cpu_s": round(self.writer_cpu_s, 6),
                "steps": self._steps, "written": self.written, "dropped": self.dropped,
                "bad_records": self.bad_records, "shards": self.shards, "write_failures": self.write_failures}

    def _run(self) -> None:
        """Every ``drain_s`` (or at once on ``close``): take every queued step and turn its records into one Arrow
        batch at once (Python objects kept for a shard's whole interval would grow the heap the garbage collector
        walks), write a shard when one is due. Waking per engine step instead would put a thread on the CPU between
        every two steps. Nothing a record or a shard does stops it: a bad record is left out and counted
        (``bad_records``), a shard that cannot be written too (``write_failures``), and later steps are written."""
        batches, rows, last, stop = [], 0, time.monotonic(), False
        while not stop:
            self._wake.wait(self.drain_s)
            self._wake.clear()  # close sets it after queueing _STOP, so this drain or the next one sees it
            cpu = time.thread_time()
            try:
                stop, batch = self._drain()
                if batch is not None:
                    batches.append(batch)
                    rows += batch.num_rows
                if batches and (stop or rows >= self.shard_rows or time.monotonic() - last >= self.flush_s):
                    self._write(batches, rows)
                    batches, rows, last = [], 0, time.monotonic()
                elif not batches:
                    last = time.monotonic()
            except Exception as exc:  # a bug of ours: what this round held is lost, the writer goes on
                self._failed("a round of the writer", exc)
                batches, rows, stop = [], 0, stop or self._closed  # it may have taken _STOP with it
            self.writer_cpu_s += time.thread_time() - cpu

    def _drain(self) -> tuple[bool, object]:
        """(whether ``close`` asked to stop, the records of every queued step as one Arrow batch or None)."""
        drained, stop = [], False
        while True:
            try:
                item = self.queue.get_nowait()
            except queue.Empty:
                break
            if item is _STOP:
                stop = True
                break
            records, errors = _records(item)
            drained += records
            if errors:
                self._bad(len(errors), "records", errors[0])
        return stop, self._arrow(drained) if drained else None

    def _arrow(self, records: list[dict]):
        """The records as one Arrow batch of ``STEP_SCHEMA``; a record that does not fit it is left out (counted in
        ``bad_records``), the others kept. None when none fits."""
        import pyarrow as pa

        try:
            return pa.RecordBatch.from_pylist(records, schema=STEP_SCHEMA)
        except Exception as exc:  # find the bad ones: one at a time, only on this rare path
            good = [r for r in records if _fits(r)]
            self._bad(len(records) - len(good), "records that do not fit the step log's schema", exc)
            return pa.RecordBatch.from_pylist(good, schema=STEP_SCHEMA) if good else None

    def _write(self, batches: list, rows: int) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        from sacpolicy.io import write_bytes

        stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S")
        path = self.out_dir / f"{SHARD_PREFIX}{stamp}-{self.run_id}-{self.shards:05d}.parquet"
        try:
            meta = {**self.meta, "dropped": self.dropped, "write_failures": self.write_failures,
                    "bad_records": self.bad_records}
            table = pa.Table.from_batches(batches, schema=STEP_SCHEMA).replace_schema_metadata(
                {META_KEY: json.dumps(meta)})
            sink = pa.BufferOutputStream()
            pq.write_table(table, sink)
            write_bytes(path, sink.getvalue().to_pybytes())
            self.shards, self.written = self.shards + 1, self.written + rows
        except Exception as exc:  # a full disk must not stop the writer; the rows are lost and counted
            self._failed(str(path), exc)

    def _failed(self, what: str, exc: BaseException) -> None:
        self._tell("write", exc, "the proposer's step log could not write %s; its rows are dropped (counted as "
                   "write_failures in its shards and stats)", what)
        self.write_failures += 1

    def _bad(self, n: int, what: str, exc: BaseException) -> None:
        """``n`` records that could not be built or stored: left out, counted (``bad_records``), logged once."""
        self._tell("bad", exc, "the proposer's step log left out %d %s it could not build or store (counted as "
                   "bad_records in its shards and stats; their requests are incomplete); later steps are logged",
                   n, what)
        self.bad_records += n

    def _tell(self, kind: str, exc: BaseException, msg: str, *args) -> None:
        """Log a failure with ``exc``'s traceback the first time one of its ``kind`` happens (a bad record tends to
        repeat every step: one message, the counts say the rest)."""
        if kind not in self._told:
            self._told.add(kind)
            logger.error(msg, *args, exc_info=exc)

    def close(self, timeout: float = 30.0) -> None:
        """Write what is queued and stop the writer (idempotent; also run at interpreter exit). Waits at most
        ``timeout`` seconds for a busy writer, and not at all for one that is not running."""
        if self._closed:
            return
        self._closed = True
        deadline = time.monotonic() + timeout
        while True:
            if not self.thread.is_alive():
                logger.error("the step log's writer thread is not running; the %d engine steps queued for %s are "
                             "lost", self.queue.qsize(), self.out_dir)
                return
            try:
                self.queue.put(_STOP, timeout=0.05)
                break
            except queue.Full:  # the writer drains it: hurry it on
                self._wake.set()
                if time.monotonic() >= deadline:
                    logger.warning("the step log's writer did not drain its queue in %.0f s; %s is left incomplete",
                                   timeout, self.out_dir)
                    return
        self._wake.set()
        self.thread.join(max(0.0, deadline - time.monotonic()))
        if self.dropped:
            logger.warning("the step log dropped %d records (its queue was full); their requests are incomplete",
                           self.dropped)


def _records(item) -> tuple[list[dict], list[Exception]]:
    """One engine step's queued rows as ``STEP_SCHEMA`` records (the feature rows are built here, off the engine), and
    what failed for each row that could not be built (left out)."""
    unix_s, seconds, batch, rows = item
    out, errors = [], []
    for row in rows:
        try:
            out.append(_record(row, unix_s, seconds, batch))
        except Exception as exc:  # a bad row loses itself, not its step
            errors.append(exc)
    return out, errors


def _record(row, unix_s: float, seconds: float, batch: int) -> dict:
    rid, step, prompt_len, ctx, new, prev_drafted, prev_accepted, unseen, k, drafted, rowctx, n, policy, sampling, \
        drafter = row
    return {"request": rid, "step": step, "unix_s": unix_s, "policy": policy, "prompt_len": prompt_len,
            "context_len": n, "context": None if ctx is None else ctx.tolist(),
            "committed": None if new is None else new.tolist(), "prev_drafted": prev_drafted,
            "prev_accepted": prev_accepted, "unseen": unseen, "k": k, "drafted": drafted,
            "features": feature_row(rowctx, 0), "batch_size": batch, "proposer_s": seconds, **_sampling(sampling),
            "drafter": drafter}


def _fits(record: dict) -> bool:
    import pyarrow as pa

    try:
        pa.RecordBatch.from_pylist([record], schema=STEP_SCHEMA)
        return True
    except Exception:  # pyarrow raises several types for a value of the wrong type or range
        return False


def _sampling(sampling) -> dict:
    """A first step's sampling columns ((temperature, top_p, top_k) or None: unknown, or not a first step)."""
    if sampling is None:
        return {"temperature": None, "top_p": None, "top_k": None}
    temperature, top_p, top_k = sampling
    return {"temperature": round(float(temperature), 6), "top_p": round(float(top_p), 6), "top_k": int(top_k)}
