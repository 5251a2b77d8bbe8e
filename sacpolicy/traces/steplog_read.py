"""Reading the served proposer's step log (``sacpolicy.export.steplog``; its files: ``traces.logformat``): every
record and the servers' provenance (``read_step_log``, refusing shards of another target, tokenizer or server setting
with the file and the fix; skipping damaged ones on request), the requests rebuilt from their records
(``requests_of``), the lookup drafters the server ran (``logged_drafters``) and each request's sampling settings
(``served_sampling``, ``request_settings``). What builds on it: ``traces.production`` (traces),
``traces.vllm_compare`` (vLLM's own per-request arrays), ``traces.served_replay`` (the logged policy's replay).

A request is rebuilt only when its steps are in the log from its first on (a step dropped by a full queue, a bad
record, or a deleted or skipped shard in the middle leaves it out, counted as incomplete; missing last steps leave it
shorter, its sequence a prefix of what was served).
"""

from __future__ import annotations

import logging

import pyarrow.parquet as pq

from sacpolicy.traces.logformat import DAMAGED, SHARD_PREFIX, CorruptShard, StepLogError, shard_files, shard_meta

logger = logging.getLogger(__name__)


def read_step_log(log_dir, *, target: str | None = None, tokenizer: str | None = None,
                  skip_corrupt: bool = False) -> tuple[list[dict], dict]:
    """Every record of the log at ``log_dir`` and its provenance (the first shard's metadata; every policy that planned
    steps, by policy id, from all shards: ``served_policies``, a hot reload's and a canary's too; what each writer lost,
    summed over server runs: ``dropped`` and ``bad_records`` records, ``write_failures`` shards; ``shards`` read and
    ``corrupt_shards`` skipped). Refuses shards of different targets or server settings, a shard of another log
    format, and (when given) a log of another ``target`` (sacpolicy model spec) or ``tokenizer``, each with the file
    and the fix. A shard that cannot be read, or whose metadata or columns are damaged (``logformat.CorruptShard``),
    is refused too, unless ``skip_corrupt``: then it is left out with a warning naming it (its requests are then
    incomplete, or end early), so one damaged file does not block a whole log."""
    files = shard_files(log_dir)
    if not files:
        raise StepLogError(f"{log_dir} holds no step-log shards ({SHARD_PREFIX}*.parquet); serve with "
                           "scripts/serve.py --log-steps DIR (SACPOLICY_PROPOSER_LOG) and send requests first")
    records, meta, first_path, corrupt, served = [], None, None, 0, {}
    lost: dict[str, dict] = {"dropped": {}, "bad_records": {}, "write_failures": {}}
    for path in files:
        try:
            table, m = _read_shard(path)
        except CorruptShard as exc:
            if not skip_corrupt:
                raise
            logger.warning("skipped a damaged step-log shard (skip_corrupt): %s", exc)
            corrupt += 1
            continue
        if meta is None:
            meta, first_path = m, path
        _check_provenance(path, m, meta, first_path, target, tokenizer)
        for key, runs in lost.items():  # a writer's counts grow from shard to shard: its last shard's
            runs[m["run_id"]] = max(runs.get(m["run_id"], 0), int(m.get(key, 0)))
        served |= m.get("served_policies") or {}
        records += table.to_pylist()
    if meta is None:
        raise StepLogError(f"{log_dir}: none of its {len(files)} step-log shards can be read (each damaged, warned "
                           "above); copy the log again from the server, or serve and log anew")
    return records, {**meta, **{key: sum(runs.values()) for key, runs in lost.items()},
                     "shards": len(files) - corrupt, "corrupt_shards": corrupt, "served_policies": served}


def _read_shard(path):
    """(table, provenance) of the shard at ``path``; ``CorruptShard`` when it cannot be read or is damaged."""
    try:
        table = pq.read_table(path)
    except Exception as exc:  # pyarrow raises several types for damaged files
        raise CorruptShard(f"corrupt step-log shard {path}: {exc}; {DAMAGED}") from exc
    return table, shard_meta(path, table.schema)


def _check_provenance(path, m: dict, first: dict, first_path, target, tokenizer) -> None:
    prov, same = m["target"], ("target", "model", "tokenizer", "vocab_size")
    if any(prov.get(k) != first["target"].get(k) for k in same):
        raise StepLogError(f"{path} was logged by a server of {prov}, {first_path} by one of {first['target']}: a "
                           "log directory holds one target's logs; move the other target's shards to their own")
    if target is not None and prov.get("target") != target:
        raise StepLogError(f"{path} was logged serving target {prov.get('target')!r} (vLLM model "
                           f"{prov.get('model')!r}), not {target!r}: its token ids mean other tokens. Rebuild traces "
                           "from that target's logs, or pass target=<the log's target>")
    if tokenizer is not None and prov.get("tokenizer") != tokenizer:
        raise StepLogError(f"{path} was logged with tokenizer {prov.get('tokenizer')!r}, not {tokenizer!r}: its "
                           "token ids mean other tokens. Use logs of a server with that tokenizer")
    if m["drafter"] != first["drafter"] or m["k_cap"] != first["k_cap"]:
        raise StepLogError(f"{path} was logged by a server of drafter {m['drafter']} with k cap {m['k_cap']}, "
                           f"{first_path} by one of drafter {first['drafter']} with k cap {first['k_cap']}: keep one "
                           "server setting per log directory; move the other setting's shards to their own")


def requests_of(records: list[dict]) -> tuple[dict, int]:
    """{log id: {"prompt_len", "tokens" (the whole sequence), "steps" (records by step, each with its block's
    ``accepted``, None when never verified)}} of the complete requests, and how many were incomplete (a step missing,
    or the steps' tokens inconsistent)."""
    by: dict = {}
    for r in records:
        by.setdefault(r["request"], []).append(r)
    out, incomplete = {}, 0
    for rid, steps in by.items():
        steps.sort(key=lambda r: r["step"])
        tokens = _sequence(steps)
        if tokens is None:
            incomplete += 1
            continue
        for s, nxt in zip(steps, steps[1:] + [None]):
            s["accepted"] = None if nxt is None else nxt["prev_accepted"]
        out[rid] = {"prompt_len": steps[0]["prompt_len"], "tokens": tokens, "steps": steps}
    return out, incomplete


def _sequence(steps: list[dict]) -> list[int] | None:
    """A request's token sequence, None unless its steps are 0, 1, 2, ... and each continues the one before."""
    if [s["step"] for s in steps] != list(range(len(steps))) or steps[0]["context"] is None:
        return None
    tokens = list(steps[0]["context"])
    for prev, s in zip(steps, steps[1:]):
        new = s["committed"] or []
        if s["prev_drafted"] != prev["drafted"] or s["prev_accepted"] + 1 + (s.get("unseen") or 0) != len(new) or \
                s["context_len"] != len(tokens) + len(new):
            return None
        tokens += new
    return tokens


def logged_drafters(log: dict) -> dict:
    """{name: ``DrafterSpec``} of the lookup drafters a step log's server ran, the first policy's primary first, then
    those of every policy that planned steps after it (a hot reload's, a canary's: ``served_policies``) (``log``: the
    log's meta, ``read_step_log``'s; a log written before servers named them all: its one n-gram drafter)."""
    from sacpolicy.runtime.spec import DrafterSpec

    spec = log["drafter"]
    specs = dict(log.get("drafters") or {spec["name"]: {"kind": "ngram", "max_ngram": spec["max_ngram"],
                                                        "min_ngram": spec["min_ngram"]}})
    for served in (log.get("served_policies") or {}).values():
        for name, d in served["drafters"].items():
            if name in specs and specs[name] != d:
                raise StepLogError(f"the log's policies serve two drafters named {name!r} ({specs[name]} and {d}); "
                                   "their traces cannot share one column. Keep the drafters' names unique across the "
                                   "versions a server reloads, or split the log at the reload")
            specs.setdefault(name, d)
    return {name: DrafterSpec.from_dict(name, d) for name, d in specs.items()}


def served_sampling(req: dict, vocab_size: int | None) -> tuple[float, int, float] | None:
    """(temperature, top_k, top_p) a request was served at, from its first step's record (greedy: (0, 0, 1); top_k 0
    where vLLM's is off: at or above the vocabulary); None when the log does not record them."""
    first = req["steps"][0]
    if first.get("temperature") is None:
        return None
    return _setting(first["temperature"], first.get("top_k") or 0, first.get("top_p") or 1.0, vocab_size)


def _setting(temperature, top_k, top_p, vocab_size=None) -> tuple[float, int, float]:
    if float(temperature) <= 0.0:
        return 0.0, 0, 1.0  # greedy: top_k / top_p change nothing
    top_k = int(top_k)
    if top_k < 0 or (vocab_size and top_k >= vocab_size):
        top_k = 0
    return float(temperature), top_k, float(top_p)


def _as_setting(sampling) -> tuple[float, int, float]:
    """A ``SamplingConfig`` or {"temperature", "top_k", "top_p"} as (temperature, top_k, top_p)."""
    get = sampling.get if isinstance(sampling, dict) else lambda k, d: getattr(sampling, k, d)
    return _setting(get("temperature", 0.0), get("top_k", 0), get("top_p", 1.0))


def request_settings(log_dir, reqs: dict, vocab_size, sampling, select) -> tuple[tuple[float, int, float], dict]:
    """The one sampling setting of the requests kept (``select``'s, else the only one there is) and the counts behind
    it {"logged", "assumed" (no setting in the log: ``sampling``'s), "left_out" (another setting than ``select``)};
    drops the others from ``reqs``. Refuses requests of several settings without ``select``."""
    default = _as_setting(sampling or {})
    logged = {rid: served_sampling(r, vocab_size) for rid, r in reqs.items()}
    assumed = sum(s is None for s in logged.values())
    if assumed:
        logger.warning("%d of %d logged requests record no sampling settings (a log of an older proposer, or one that "
                       "could not read vLLM's input batch); taken as temperature %s, top_k %d, top_p %s (sampling=)",
                       assumed, len(logged), *default)
    setting = {rid: default if s is None else s for rid, s in logged.items()}
    left_out = 0
    if select is not None:
        keep = _as_setting(select)
        for rid in [rid for rid, s in setting.items() if s != keep]:
            del reqs[rid]
            left_out += 1
        return keep, {"logged": len(logged) - assumed, "assumed": assumed, "left_out": left_out}
    found: dict = {}
    for s in setting.values():
        found[s] = found.get(s, 0) + 1
    if len(found) > 1:
        listed = ", ".join(f"{n} at temperature {t}, top_k {k}, top_p {p}" for (t, k, p), n in sorted(found.items()))
        raise StepLogError(f"{log_dir} holds requests served at several sampling settings ({listed}); a trace "
                           "directory holds one. Build one per setting: select={'temperature': ..., 'top_k': ..., "
                           "'top_p': ...} keeps that setting's requests")
    return next(iter(found), default), {"logged": len(logged) - assumed, "assumed": assumed, "left_out": 0}
