"""Production traces: the served proposer's step log (``sacpolicy.export.steplog``) turned into this project's trace
schema (``traces.schema``), so what vLLM served can be replayed, fitted on and compared like collected traces.

    from sacpolicy.traces.production import build_production_traces, replay_logged
    build_production_traces("logs/steps", "traces/prod", target="embedded:smollm2-135m-instruct")
    replay_logged("traces/prod", "deploy/vllm/policy")  # the logged policy's accepted counts, step for step

Writes two trace directories (``meta.source = "vllm"``):
- ``live``: one row per logged step whose outcome is known (the block's accepted tokens are read from the next
  step's committed tokens; the block drafted after a request's last step is never verified and has no row);
- ``tf``: ``teacher_forced`` rows rebuilt from each request's token sequence (the context on first sight, then the
  tokens committed each step) with the served drafters' token-only teacher forcing (``types.teacher_force``; a
  suffix drafter's in the order the server indexed every request, ``served_teacher_forcing``). For
  greedy serving they are exact: a drafted token is accepted when it equals the target's, so ``run_len`` and
  ``beta`` (1 where the first drafted token matches, else 0) need no target pass; ``p_target`` is unknown (NaN).
  With a target (``target=`` a loaded model, ``refit.target_pass=true``) the rows are the collector's own
  (``collect.teacher_forced_rows``: one teacher-forced target pass per request): ``p_target``, ``q_target`` and
  ``beta`` from the target's distributions processed at the request's sampling settings, exactly as collected
  traces of the same sequence record them. Sampled requests (temperature > 0) need that pass: without a target
  they are refused, never taken as greedy.

Each request's sampling settings (temperature, top_p, top_k) are in its first step's record when the proposer could
read them from vLLM's input batch; a request whose log has none (an older log) is taken at ``sampling`` (greedy unless
given), with a warning. One build holds one sampling setting (the trace schema records one per directory): a log of
several is refused unless ``select`` keeps one of them.

A request is rebuilt only when its steps are in the log from its first on (a step dropped by a full queue or a
deleted shard in the middle leaves it out, counted in ``meta.log.incomplete``; missing last steps leave it shorter,
its sequence a prefix of what was served). Shards that cannot be read, and logs of another target or
tokenizer than the one asked for, are refused with the file and the fix.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from sacpolicy.policy.base import Policy, PolicyRow
from sacpolicy.traces.schema import TraceError, write_meta, write_shard

logger = logging.getLogger(__name__)

LOG_FORMAT = 1  # the step log's record layout (STEP_SCHEMA) and shard metadata
META_KEY = "sacpolicy.steplog"  # the Parquet schema metadata key of a shard's provenance (JSON)
SHARD_PREFIX = "steps-"
CATEGORY = "other"  # the served proposer sees no prompt category: its feature rows read "unknown" = "other"
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
    if not 0.0 < rate <= 1.0:
        raise StepLogError(f"the step log's sampling rate must be in (0, 1], got {rate}; set {env} (or --log-rate) "
                           "to the share of requests to log, e.g. 0.1")
    return float(rate)


# ---------------------------------------------------------------------- reading a log
def read_step_log(log_dir, *, target: str | None = None, tokenizer: str | None = None) -> tuple[list[dict], dict]:
    """Every record of the log at ``log_dir`` and its provenance (the first shard's metadata; ``dropped`` summed over
    server runs). Refuses a shard that cannot be read, a shard without step-log metadata, shards of different
    targets, and (when given) a log of another ``target`` (sacpolicy model spec) or ``tokenizer``."""
    files = sorted(Path(log_dir).glob(f"{SHARD_PREFIX}*.parquet"))
    if not files:
        raise StepLogError(f"{log_dir} holds no step-log shards ({SHARD_PREFIX}*.parquet); serve with "
                           "scripts/serve.py --log-steps DIR (SACPOLICY_PROPOSER_LOG) and send requests first")
    records, meta, dropped = [], None, {}
    for path in files:
        try:
            table = pq.read_table(path)
        except Exception as exc:  # pyarrow raises several types for damaged files
            raise StepLogError(f"corrupt step-log shard {path}: {exc}; it was cut short (a crash or an incomplete "
                               "copy: shards are written atomically). Delete it or copy it again; its requests are "
                               "then left out as incomplete") from exc
        raw = (table.schema.metadata or {}).get(META_KEY.encode())
        if raw is None or json.loads(raw).get("format") != LOG_FORMAT:
            raise StepLogError(f"{path} is not a step-log shard of format {LOG_FORMAT} (written by "
                               f"sacpolicy.export.steplog); move it out of {log_dir} or log again with this sacpolicy")
        m = json.loads(raw)
        meta = meta or m
        _check_provenance(path, m, meta, files[0], target, tokenizer)
        dropped[m["run_id"]] = max(dropped.get(m["run_id"], 0), int(m.get("dropped", 0)))
        records += table.to_pylist()
    return records, {**meta, "dropped": sum(dropped.values()), "shards": len(files)}


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


def prompt_key(prompt) -> str:
    """A request's prompt token ids, hashed (hex): the key production requests are split by."""
    return hashlib.blake2b(np.asarray(prompt, dtype=np.int64).tobytes(), digest_size=8).hexdigest()


def compare_with_vllm(requests: dict, served: list[tuple[list[int], list[int], dict | None]],
                      k_cap: int | None = None) -> dict:
    """The log's (drafted, accepted) per verified step against vLLM's own per-request arrays
    (``--per-request-spec-decode-metrics detailed``: ``per_step_drafted`` / ``per_step_accepted``). ``requests``:
    ``requests_of``'s; ``served``: per request sent, (prompt ids, output ids, vLLM's ``speculative_decoding`` metrics
    or None). A served request is found in the log by its prompt and output (vLLM's output is a prefix of what its
    engine committed: it cuts a last block at max_tokens or EOS); identical requests pair in order.

    ``k_cap``: the server's ``num_speculative_tokens`` (the log's ``k_cap``). While a request of the batch is within it
    of the context limit, vLLM calls no proposer and verifies dummy drafts of ``k_cap`` zeros for every request
    instead, and its arrays count those steps; the log holds their tokens as a step's ``unseen``, from which the
    dummy steps are rebuilt here (each accepts the leading zeros among them, then commits one token). Without it a
    request with unseen tokens differs. A request whose last steps fell there (the one that reached the limit, or any
    that ended then) is logged up to its last step seen, and differs. -> {"served", "logged" (served requests found
    in the log), "steps" (vLLM's verify steps of those), "equal_steps", "mismatched": [served index, ...]}."""
    out = {"served": len(served), "logged": 0, "steps": 0, "equal_steps": 0, "mismatched": []}
    used: set = set()
    for i, (prompt, output, spec) in enumerate(served):
        L, prompt, output = len(prompt), list(prompt), list(output)
        # the proposer may first see a request a few tokens into its decode (vLLM drafts nothing for it until
        # then): its logged prompt is then the prompt and those tokens, and the matching request the one that starts
        # with this prompt and output, the exact prompt length preferred
        found = [rid for rid, r in requests.items() if rid not in used and r["prompt_len"] >= L
                 and r["tokens"][:L] == prompt and r["tokens"][L: L + len(output)] == output
                 and len(r["tokens"]) - L >= len(output)]
        mine = min(found, key=lambda rid: (requests[rid]["prompt_len"] - L, rid)) if found else None
        theirs = list(zip((spec or {}).get("per_step_drafted") or [], (spec or {}).get("per_step_accepted") or []))
        out["steps"] += len(theirs)
        if mine is None:
            out["mismatched"].append(i)
            continue
        used.add(mine)
        out["logged"] += 1
        logged = _verified_steps(requests[mine]["steps"], k_cap)
        out["equal_steps"] += sum(a == b for a, b in zip(logged, theirs)) if len(logged) == len(theirs) else 0
        if logged != theirs:
            out["mismatched"].append(i)
    return out


def _verified_steps(steps: list[dict], k_cap: int | None) -> list[tuple[int, int]]:
    """(drafted, accepted) of every verify step with drafts that vLLM's per-request arrays count, in order: the
    logged blocks, and after a block the dummy steps of the tokens the next record holds as ``unseen``
    (``compare_with_vllm``)."""
    out = []
    for s, nxt in zip(steps, steps[1:] + [None]):
        if s["accepted"] is not None and s["drafted"]:
            out.append((s["drafted"], s["accepted"]))
        unseen = (nxt or {}).get("unseen") or 0
        if unseen and k_cap:
            tokens, i = (nxt["committed"] or [])[-unseen:], 0
            while i < len(tokens):
                a = 0
                while a < k_cap and i + a < len(tokens) and tokens[i + a] == 0:
                    a += 1
                out.append((k_cap, a))
                i += a + 1
    return out


# ---------------------------------------------------------------------- building traces
def live_rows(rid: str, req: dict, drafter: str) -> list[dict]:
    """The ``live`` trace rows of a request's verified steps: the proposer's seconds as ``draft_s`` (the whole
    engine step's, shared by its rows), ``verify_s`` unknown (NaN), the drafted tokens' confidence the peeked one."""
    from sacpolicy.runtime.features import FEATURE_NAMES

    top1, ent, mar = (FEATURE_NAMES.index(n) for n in ("top1", "entropy", "margin"))
    out = []
    for s in req["steps"]:
        if s["accepted"] is None:
            continue
        f, d = s["features"], s["drafted"]
        out.append({"prompt_id": rid, "category": CATEGORY, "prompt_len": req["prompt_len"], "policy": s["policy"],
                    "step": s["step"], "drafter": (s.get("drafter") or drafter) if d else None, "k": s["k"],
                    "drafted": d,
                    "accepted": s["accepted"], "emitted": s["accepted"] + 1, "context_len": s["context_len"],
                    "draft_s": s["proposer_s"], "verify_s": math.nan, "cooldown": False, "top1": [f[top1]] * d,
                    "entropy": [f[ent]] * d, "margin": [f[mar]] * d, "q": [], "p": [], "beta": [],
                    "batch_size": s["batch_size"]})
    return out


def token_teacher_forced_rows(drafter, rid: str, req: dict, k_max: int) -> list[dict]:
    """``teacher_forced`` rows of a request from its tokens alone (``decoding.types.teacher_force``, runs as
    ``collect.teacher_forced_rows`` reads them): exact for greedy decoding, ``p_target`` unknown (NaN)."""
    from sacpolicy.decoding.teacher import teacher_force
    from sacpolicy.traces.collect import proposal_runs

    ids, L = torch.tensor(req["tokens"]), req["prompt_len"]
    gen = ids[L:]
    tf = teacher_force(drafter, ids, L, k_max)
    run, plen = proposal_runs(tf, gen, k_max)
    first, stats = tf.tokens[:, 0].tolist(), tf.confidence.tolist()
    return [{"prompt_id": rid, "category": CATEGORY, "prompt_len": L, "drafter": drafter.name, "position": g,
             "target_token": int(gen[g]), "draft_token": int(first[g]), "match": run[g] > 0, "top1": stats[g][0],
             "entropy": stats[g][1], "margin": stats[g][2], "p_target": math.nan,
             "q_target": 1.0 if run[g] > 0 else 0.0, "beta": 1.0 if run[g] > 0 else 0.0, "run_len": int(run[g]),
             "proposal_len": int(plen[g]), "proposal": True,
             "proposal_confidence": tf.proposal_confidence(g)} for g in range(len(gen))]


def served_teacher_forcing(make_drafter, records: list[dict], reqs: dict, k_max: int) -> dict:
    """A suffix drafter's teacher-forced proposals over the logged requests ({log id: ``TeacherForced``}), its global
    index grown in the order the served proposer grew it: the proposer indexes a row's new tokens when it peeks at the
    row, every engine step, in the step's row order, so a request's proposals depend on how far every other request
    in flight had got. The records are walked in engine order (each server run, ``run_id``, with a drafter of its
    own from ``make_drafter()``, as each server had); at a request's record the positions up to the context it was
    seen at are teacher-forced (each syncing the row to it, so the visited one reads the index exactly as the
    proposer did), positions before its first sighting read the index without joining it (the proposer never saw
    them). Exact at every visited position when every request of the run is in the log (sampling rate 1, nothing
    dropped, no canary trial: a candidate's rows peek after the current policy's) and the drafter's spec did not
    change by a policy swap mid-run."""
    from sacpolicy.decoding.teacher import TeacherForced

    drafters, states, made, out = {}, {}, {}, {}
    for r in records:
        rid = r["request"]
        req = reqs.get(rid)
        if req is None:
            continue
        run = rid.rsplit("-", 1)[0]
        drafter = drafters.get(run) or drafters.setdefault(run, make_drafter())
        tokens, L, n = req["tokens"], req["prompt_len"], r["context_len"]
        ids = torch.tensor(tokens[:n], dtype=torch.long)
        rows = made.setdefault(rid, [])
        if rid not in states:
            for c in range(L + len(rows), n):  # before the first sighting: never seen, indexed nothing
                rows.append(drafter.draft(None, ids[:c]))
            states[rid] = drafter.new_state()
        for c in range(L + len(rows), min(n, len(tokens) - 1) + 1):
            rows.append(drafter.draft(states[rid], ids[:c]))
        drafter.draft(states[rid], ids)  # the row as seen at this step (indexed: the proposer peeked it)
    for rid, drafts in made.items():
        tokens = torch.full((len(drafts), k_max), -1, dtype=torch.long)
        conf, each = [], []
        for g, d in enumerate(drafts):
            m = min(k_max, len(d.tokens))
            tokens[g, :m] = torch.tensor(d.tokens[:m], dtype=torch.long)
            conf.append(list(d.confidence[0]) if m else [0.0, 0.0, 0.0])
            each.append(list(d.confidence[:m]))
        out[rid] = TeacherForced(tokens, chained=True, confidence=torch.tensor(conf, dtype=torch.float32).view(-1, 3),
                                 block_confidence=each)
    return out


class _Forced:
    """A drafter whose teacher forcing is already done (``served_teacher_forcing``'s): what ``teacher_force`` returns
    for it, in the collector's rows and in the token-only ones alike."""

    def __init__(self, name: str, forced):
        self.name, self.forced = name, forced

    def teacher_force(self, ids, start, k_max, aux=None):
        return self.forced


def logged_drafters(log: dict) -> dict:
    """{name: ``DrafterSpec``} of the lookup drafters a step log's server ran, its primary first (``log``: the log's
    meta, ``read_step_log``'s; a log written before servers named them all: its one n-gram drafter)."""
    from sacpolicy.runtime.spec import DrafterSpec

    spec = log["drafter"]
    specs = log.get("drafters") or {spec["name"]: {"kind": "ngram", "max_ngram": spec["max_ngram"],
                                                   "min_ngram": spec["min_ngram"]}}
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


def build_production_traces(log_dir, out_dir, *, target=None, tokenizer: str | None = None, sampling=None,
                            select=None, chunk: int = 256, progress: bool = True) -> dict:
    """``out_dir/live`` and ``out_dir/tf`` from the step log at ``log_dir`` (see the module docstring); returns the
    meta written. ``target``: the log's target, as a spec (checked against the log) or a loaded model
    (``models.LoadedModel``: checked by its spec, and run over every sequence for the collector's own teacher-forced
    rows, which sampled requests need). ``sampling`` ({"temperature", "top_k", "top_p"} or a ``SamplingConfig``):
    the settings of requests whose log records none (default greedy); ``select``: keep only the requests served at
    these settings."""
    from sacpolicy.decoding import SamplingConfig
    from sacpolicy.decoding.lookup import lookup_drafter
    from sacpolicy.decoding.protocols import Resettable, fresh_drafters
    from sacpolicy.progress import progress_iter

    model = None if target is None or isinstance(target, str) else target
    records, log = read_step_log(log_dir, target=target if model is None else model.spec, tokenizer=tokenizer)
    reqs, incomplete = requests_of(records)
    if incomplete:
        logger.warning("%d of %d logged requests are incomplete (steps dropped or a shard missing) and are left out",
                       incomplete, incomplete + len(reqs))
    setting, counts = request_settings(log_dir, reqs, log["target"]["vocab_size"], sampling, select)
    if not reqs:
        raise StepLogError(f"{log_dir} holds no complete request" + (" served at select=" + str(select) if select
                           is not None else "") + "; log with a larger queue or fewer dropped steps")
    temperature, top_k, top_p = setting
    if temperature > 0 and model is None:
        raise StepLogError(f"{log_dir}: its {len(reqs)} requests were served sampled (temperature {temperature}, top_k "
                           f"{top_k}, top_p {top_p}); their teacher-forced beta and p_target need a target pass over "
                           "the logged sequences: pass target=<the loaded target> (sacpolicy.models.load_model), or "
                           "refit.target_pass=true in a refit")
    spec, k_max = log["drafter"], int(log["k_cap"])
    drafters = [lookup_drafter(s) for s in logged_drafters(log).values()]
    # a suffix drafter's proposals depend on the order the server saw every request in: replayed in that order
    served = {d.name: served_teacher_forcing(lambda d=d: fresh_drafters([d])[0], records, reqs, k_max)
              for d in drafters if isinstance(d, Resettable)}
    config = SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p, seed=None)
    meta = {"source": "vllm", "target": log["target"]["target"], "vocab_size": log["target"]["vocab_size"],
            "sampling": {"temperature": temperature, "top_k": top_k, "top_p": top_p},
            **({"beta": "processed"} if temperature > 0 else {}),
            "teacher_forcing": "target" if model is not None else "tokens",  # who computed beta / p_target
            "log": {"dir": str(Path(log_dir).resolve()), "requests": len(reqs), "incomplete": incomplete,
                    "dropped": log["dropped"], "shards": log["shards"], "k_cap": k_max,
                    "max_model_len": log["max_model_len"], "load_aware": log["load_aware"],
                    "rule_drafters": log["rule_drafters"], "sampling": counts,
                    "policies": sorted({s["policy"] for r in reqs.values() for s in r["steps"]}),
                    # each request's prompt, hashed: what splits requests (identical prompts land in one split)
                    "prompts": {rid: prompt_key(r["tokens"][: r["prompt_len"]]) for rid, r in reqs.items()}}}

    def teacher_forced(rid):
        each = [_Forced(d.name, served[d.name][rid]) if d.name in served else d for d in drafters]
        if model is None:
            return [row for d in each for row in token_teacher_forced_rows(d, rid, reqs[rid], k_max)]
        return target_teacher_forced_rows(model, each, rid, reqs[rid], k_max, config)

    out = Path(out_dir)
    ids = sorted(reqs)
    for kind, sub, make in (("live", "live", lambda rid: live_rows(rid, reqs[rid], spec["name"])),
                            ("teacher_forced", "tf", teacher_forced)):
        write_meta(out / sub, {**meta, "kind": kind, **({"drafters": [d.name for d in drafters], "k_max": k_max}
                                                         if kind == "teacher_forced" else {})})
        for c in range(0, len(ids), chunk):
            part = ids[c: c + chunk]
            if kind == "teacher_forced" and model is not None:  # one target forward per request
                part = progress_iter(part, f"target pass, requests {c}-{c + len(part) - 1} of {len(ids)}",
                                     unit="request", enabled=progress)
            write_shard([row for rid in part for row in make(rid)], kind, out / sub, f"c{c // chunk:05d}")
    return meta


def target_teacher_forced_rows(target, drafters, rid: str, req: dict, k_max: int, sampling) -> list[dict]:
    """``teacher_forced`` rows of a request from one teacher-forced pass of ``target`` over its logged sequence: the
    collector's own (``collect.teacher_forced_rows``), ``sampling`` the settings it was served at; ``drafters``: one
    or a list."""
    from sacpolicy.traces.collect import teacher_forced_rows

    L, tokens = req["prompt_len"], [int(t) for t in req["tokens"]]
    row = {"prompt_id": rid, "category": CATEGORY, "input_ids": tokens[:L]}
    drafters = drafters if isinstance(drafters, (list, tuple)) else [drafters]
    return teacher_forced_rows(target, drafters, row, tokens[L:], k_max, sampling=sampling)


# ---------------------------------------------------------------------- replaying the logged policy
def replay_logged(trace_dir, policy) -> dict:
    """Replay ``policy`` (the logged one: an artifact path or ``PolicyArtifact``) over ``trace_dir/tf`` as the
    served proposer saw each request (``AsServed``) and set its accepted tokens per step beside the logged ones in
    ``trace_dir/live``: {"replayed": {id: [...]}, "logged": {id: [...]}, "mismatched": [ids]}. Exact for greedy logs
    of a proposer that planned each row alone; sampled logs (replayed in expectation only) are refused, and so is a
    load-aware proposer's (``SACPOLICY_PROPOSER_LOAD``), which planned a step's rows together, as a replay of one
    request cannot."""
    from sacpolicy.decoding import DecoderConfig
    from sacpolicy.policy.learned import LearnedPolicy
    from sacpolicy.runtime.artifact import PolicyArtifact, load_artifact
    from sacpolicy.traces.schema import load_traces, read_meta
    from sacpolicy.traces.simulate import group_traces, simulate

    trace_dir = Path(trace_dir)
    meta = read_meta(trace_dir / "tf")
    log = meta["log"]
    if float(meta.get("sampling", {}).get("temperature", 0.0)) > 0:
        raise StepLogError(f"{trace_dir} holds sampled requests: the served tokens were drawn at random, so a replay "
                           "reproduces their accepted counts in expectation, not step for step. Replay logs of greedy "
                           "requests (temperature 0) to check a policy step for step")
    if log["load_aware"]:
        raise StepLogError(f"{trace_dir} was logged by a load-aware proposer, which plans a step's rows together; a "
                           "replay of one request cannot reproduce that. Serve with SACPOLICY_PROPOSER_LOAD=0 for "
                           "exactly replayable logs")
    art = policy if isinstance(policy, PolicyArtifact) else load_artifact(policy)
    grouped = group_traces(load_traces(trace_dir / "tf"), meta)
    served = AsServed(LearnedPolicy(art.rule), tuple(log["rule_drafters"]), log["k_cap"], log["max_model_len"])
    sim = simulate(served, grouped, art.rule.cost, vocab_size=int(meta["vocab_size"] or 0) or _vocab(grouped),
                   config=DecoderConfig(k_max=max(art.rule.k_max, log["k_cap"])))
    logged: dict = {}
    for r in sorted(load_traces(trace_dir / "live"), key=lambda r: (r["prompt_id"], r["step"])):
        logged.setdefault(r["prompt_id"], []).append(r["accepted"])
    replayed = {pid: acc for pid, (_, acc) in sim.per_prompt.items()}
    return {"replayed": replayed, "logged": logged,
            "mismatched": sorted(p for p in replayed if replayed[p] != logged.get(p, []))}


def _vocab(grouped: dict) -> int:
    return 1 + max(max(c["target_token"]) for p in grouped.values() for c in p["drafters"].values())


class AsServed(Policy):
    """A policy seen through the served proposer's eyes, for a replay (``replay_logged``): the request knows the
    rule's drafters (vLLM serves one of them, as when a decoder drops the others), no category, each row is priced
    alone, and room for a block is what the server had (``min(k_cap, max_model_len - context - 1)``: the proposer
    cannot see a request's ``max_tokens``; the replay's decoder still stops at the logged sequence's end, where the
    logged block's accepted tokens end too)."""

    def __init__(self, policy, drafters: tuple[str, ...], k_cap: int, max_model_len: int):
        self.inner, self.drafters, self.k_cap, self.max_model_len = policy, drafters, k_cap, max_model_len
        self.name, self.uses_peeks = policy.name, policy.uses_peeks
        self.needs_token_feedback = policy.needs_token_feedback

    def validate(self, drafters, k_max) -> None:
        for name in drafters:
            self.inner.rule.check_drafter(name)

    def start(self, request):
        return self.inner.start(request)

    def _row(self, row):
        s = row.state
        room = min(self.k_cap, self.max_model_len - s.context_len - 1)
        state = replace(s, request=replace(s.request, drafters=self.drafters, category=None), remaining=room + 1,
                        batch_size=1, load=None)
        return PolicyRow(state, row.memory)

    def decide(self, rows):
        return self.inner.decide([self._row(r) for r in rows])

    def should_stop(self, row, token) -> bool:
        return self.inner.should_stop(self._row(row), token)

    def observe(self, row, record) -> None:
        self.inner.observe(self._row(row), record)
