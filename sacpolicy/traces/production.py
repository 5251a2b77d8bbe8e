"""Production traces: the served proposer's step log (``sacpolicy.export.steplog``, read by ``traces.steplog_read``)
turned into this project's trace schema (``traces.schema``), so what vLLM served can be replayed, fitted on and
compared like collected traces.

    from sacpolicy.traces.production import build_production_traces
    from sacpolicy.traces.served_replay import replay_logged
    build_production_traces("logs/steps", "traces/prod", target="embedded:smollm2-135m-instruct")
    replay_logged("traces/prod", "deploy/vllm/policy")  # the logged policy's accepted counts, step for step

Writes two trace directories (``meta.source = "vllm"``):
- ``live``: one row per logged step whose outcome is known (the block's accepted tokens are read from the next
  step's committed tokens; the block drafted after a request's last step is never verified and has no row);
- ``tf``: ``teacher_forced`` rows rebuilt from each request's token sequence (the context on first sight, then the
  tokens committed each step) with the served drafters' token-only teacher forcing (``teacher.teacher_force``; a
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
its sequence a prefix of what was served). Shards that cannot be read (unless ``skip_corrupt``: then left out and
counted), and logs of another target or tokenizer than the one asked for, are refused with the file and the fix.
"""

from __future__ import annotations

import hashlib
import logging
import math
from pathlib import Path

import numpy as np
import torch

from sacpolicy.traces.logformat import StepLogError
from sacpolicy.traces.schema import write_meta, write_shard
from sacpolicy.traces.steplog_read import logged_drafters, read_step_log, request_settings, requests_of

logger = logging.getLogger(__name__)

CATEGORY = "other"  # the served proposer sees no prompt category: its feature rows read "unknown" = "other"


def prompt_key(prompt) -> str:
    """A request's prompt token ids, hashed (hex): the key production requests are split by."""
    return hashlib.blake2b(np.asarray(prompt, dtype=np.int64).tobytes(), digest_size=8).hexdigest()


def build_production_traces(log_dir, out_dir, *, target=None, tokenizer: str | None = None, sampling=None,
                            select=None, skip_corrupt: bool = False, chunk: int = 256, progress: bool = True) -> dict:
    """``out_dir/live`` and ``out_dir/tf`` from the step log at ``log_dir`` (see the module docstring); returns the
    meta written. ``target``: the log's target, as a spec (checked against the log) or a loaded model
    (``models.LoadedModel``: checked by its spec, and run over every sequence for the collector's own teacher-forced
    rows, which sampled requests need). ``sampling`` ({"temperature", "top_k", "top_p"} or a ``SamplingConfig``):
    the settings of requests whose log records none (default greedy); ``select``: keep only the requests served at
    these settings; ``skip_corrupt``: leave damaged shards out (``read_step_log``'s, counted in
    ``meta.log.corrupt_shards``) rather than refuse the log."""
    from sacpolicy.decoding import SamplingConfig
    from sacpolicy.decoding.lookup import lookup_drafter
    from sacpolicy.decoding.protocols import Resettable, fresh_drafters
    from sacpolicy.progress import progress_iter

    model = None if target is None or isinstance(target, str) else target
    records, log = read_step_log(log_dir, target=target if model is None else model.spec, tokenizer=tokenizer,
                                 skip_corrupt=skip_corrupt)
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
                    "dropped": log["dropped"], "bad_records": log["bad_records"], "shards": log["shards"],
                    "corrupt_shards": log["corrupt_shards"], "k_cap": k_max,
                    "max_model_len": log["max_model_len"], "load_aware": log["load_aware"] or any(
                        p["load_aware"] for p in log["served_policies"].values()),
                    "rule_drafters": log["rule_drafters"], "served_policies": log["served_policies"], "sampling": counts,
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


# ---------------------------------------------------------------------- the rows of one request
def target_teacher_forced_rows(target, drafters, rid: str, req: dict, k_max: int, sampling) -> list[dict]:
    """``teacher_forced`` rows of a request from one teacher-forced pass of ``target`` over its logged sequence: the
    collector's own (``collect.teacher_forced_rows``), ``sampling`` the settings it was served at; ``drafters``: one
    or a list."""
    from sacpolicy.traces.collect import teacher_forced_rows

    L, tokens = req["prompt_len"], [int(t) for t in req["tokens"]]
    row = {"prompt_id": rid, "category": CATEGORY, "input_ids": tokens[:L]}
    drafters = drafters if isinstance(drafters, (list, tuple)) else [drafters]
    return teacher_forced_rows(target, drafters, row, tokens[L:], k_max, sampling=sampling)


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
    """``teacher_forced`` rows of a request from its tokens alone (``decoding.teacher.teacher_force``, runs as
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
