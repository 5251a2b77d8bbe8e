"""Trace collection over a prompt set, teacher-forced: the target decodes each prompt once, then each drafter runs one
pass over the target's sequence. (Live decoding is measured by the evaluate stage, which writes no traces.)

Collection is sharded and resumable: prompts are split into shards (``shard=(i, n)``, or torchrun's RANK /
WORLD_SIZE) and each shard into chunks of ``chunk_size`` prompts; every chunk is one Parquet file written atomically,
so a rerun skips finished chunks and an interruption loses at most the chunk in progress, never duplicates one. A
finished shard leaves its manifest; ``traces.shards.merge_shards`` checks that all n are there (done here when n is
1).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path

import torch

from sacpolicy.decoding import RequestInfo, SamplingConfig, SpeculativeDecoder, feature_layers, teacher_force
from sacpolicy.decoding.aux import aux_pass
from sacpolicy.decoding.sampling import draft_stats, probs_from_logits
from sacpolicy.progress import progress_iter
from sacpolicy.traces.schema import (
    SCHEMA_VERSION,
    TraceError,
    read_meta,
    write_meta,
    write_shard,
)
from sacpolicy.traces.shards import merge_shards, write_shard_manifest

logger = logging.getLogger(__name__)

_T1 = SamplingConfig(temperature=1.0)


def resolve_shard(shard: tuple[int, int] | str | None) -> tuple[int, int]:
    """``(i, n)``, ``"i/n"``, or None: torchrun's RANK / WORLD_SIZE when set, else the whole set."""
    if shard is None:
        return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    i, n = (int(x) for x in shard.split("/")) if isinstance(shard, str) else shard
    if not 0 <= i < n:
        raise TraceError(f"shard {i}/{n} is out of range: use shard=i/n with 0 <= i < n")
    return i, n


def _chunks(prompts, shard, chunk_size):
    i, n = resolve_shard(shard)
    mine = [r for j, r in enumerate(prompts) if j % n == i]
    for c in range(0, len(mine), chunk_size):
        yield f"s{i:03d}of{n:03d}-c{c // chunk_size:05d}", mine[c : c + chunk_size]


def _prepare(out_dir: Path, meta: dict) -> None:
    """Write the sidecar, or check that an existing one describes the same collection (so resuming is safe)."""
    if (out_dir / "meta.json").exists():
        old = read_meta(out_dir)
        keys = [k for k in meta if k not in ("device_name", "device")]  # shards run on several devices
        if any(old.get(k) != meta[k] for k in keys):
            diff = {k: (old.get(k), meta[k]) for k in keys if old.get(k) != meta[k]}
            raise TraceError(f"{out_dir} holds traces of another collection {diff}; use a new directory")
        return
    from sacpolicy import __version__

    write_meta(out_dir, {**meta, "schema_version": SCHEMA_VERSION, "package_version": __version__})


@torch.inference_mode()
def teacher_forced_rows(target, drafters: Sequence, row: dict, generated: list[int], k_max: int,
                        target_logits: torch.Tensor | None = None,
                        sampling: SamplingConfig | None = None) -> list[dict]:
    """Per generated position and drafter: the draft's proposal given the target's own prefix (each drafter
    teacher-forced by ``decoding.teacher.teacher_force``) and the accepted run from there.

    ``target_logits`` ([G, V]): the target's logits behind each generated token, as kept by the decode that produced
    them (``generate(keep_logits=True)``); without them the target runs one teacher-forced pass to recompute them.
    ``sampling``: the settings ``generated`` was sampled with. Then p and q (``p_target``, ``q_target``, ``beta``) are
    the processed distributions (temperature, top-k, top-p applied to both) that verification at those settings
    accepts with, as the live decoder's records are; greedy (None): the temperature-1 ones, which stay informative.
    Draft confidence is at temperature 1 either way, as the policies read it."""
    prompt = list(row["input_ids"])
    L, G = len(prompt), len(generated)
    ids = torch.tensor(prompt + generated, device=target.device)
    aux = None
    layers = [feature_layers(d) for d in drafters]
    if target_logits is None or any(layers):
        # logits_to_keep: the LM head runs only where a generated token is predicted, not over the prompt
        logits, aux = aux_pass(target.model, ids, G + 1, [i for ls in layers for i in ls])
        target_logits = logits[:-1] if target_logits is None else target_logits
    if target_logits.shape[0] != G:
        raise ValueError(f"target_logits has {target_logits.shape[0]} rows for {G} generated tokens")
    cfg = _T1 if sampling is None or sampling.greedy else sampling
    p = probs_from_logits(target_logits.float(), cfg)  # [G, V]
    gen = torch.tensor(generated, device=target.device)
    p_target = p.gather(-1, gen.view(-1, 1)).squeeze(-1)
    out = []
    for d, ls in zip(drafters, layers):
        tf = teacher_force(d, ids, L, k_max, aux.rows(ls) if ls else None)
        first = tf.tokens[:, 0]
        run, plen = proposal_runs(tf, gen, k_max)
        if tf.logits is not None:
            logits = tf.logits.float()
            q = probs_from_logits(logits, cfg)
            stats = draft_stats(logits).tolist()
            q_target = q.gather(-1, gen.view(-1, 1)).squeeze(-1).tolist()
            beta = torch.minimum(p, q).sum(-1).tolist()
        else:  # deterministic proposals: q is the one-hot of the proposed token
            stats = tf.confidence.tolist()
            q_target = [1.0 if r > 0 else 0.0 for r in run]
            has = first >= 0
            beta = torch.where(has, p.gather(-1, first.clamp_min(0).view(-1, 1)).squeeze(-1), 0.0).tolist()
        first = first.tolist()
        for g in range(G):
            out.append({
                "prompt_id": row["prompt_id"], "category": row["category"], "prompt_len": L, "drafter": d.name,
                "position": g, "target_token": generated[g], "draft_token": int(first[g]), "match": run[g] > 0,
                "top1": stats[g][0], "entropy": stats[g][1], "margin": stats[g][2], "p_target": float(p_target[g]),
                "q_target": float(q_target[g]), "beta": float(beta[g]), "run_len": int(run[g]),
                "proposal_len": int(plen[g]), "proposal": tf.logits is None,
                "proposal_confidence": tf.proposal_confidence(g),
            })
    return out


def proposal_runs(tf, gen: torch.Tensor, k_max: int) -> tuple[list[int], list[int]]:
    """(run_len, proposal_len) per generated position of a drafter's ``TeacherForced`` over the generated tokens
    ``gen`` [G]: the tokens a block drafted from there gets accepted (greedy: matched), capped at ``k_max``, and the
    tokens the drafter can propose from there."""
    G, first = gen.shape[0], tf.tokens[:, 0]
    if tf.chained:  # row g is the whole block: its accepted run is its prefix that matches the target
        ahead = torch.full((G, k_max), -2, dtype=torch.long, device=gen.device)
        for j in range(min(k_max, G)):
            ahead[: G - j, j] = gen[j:]
        proposal = tf.tokens[:, :k_max]
        run = torch.cumprod((proposal == ahead[:, : proposal.shape[1]]).long(), 1).sum(1).tolist()
        return run, (proposal >= 0).sum(1).tolist()
    return _runs((first == gen).tolist(), k_max), [k_max] * G  # one token a row: runs are read down the rows


def _runs(match: list[bool], k_max: int) -> list[int]:
    """r_i = consecutive matches starting at i, capped at k_max."""
    runs, r = [0] * len(match), 0
    for i in range(len(match) - 1, -1, -1):
        r = r + 1 if match[i] else 0
        runs[i] = min(r, k_max)
    return runs


def collect_teacher_forced(target, drafters: Sequence, prompts, out_dir, *, max_new_tokens: int, meta: dict,
                           sampling: SamplingConfig | None = None, k_max: int = 16, shard=None, chunk_size: int = 8,
                           progress: bool = True) -> Path:
    """Decode each prompt once with the target (greedy, or sampled with ``sampling.seed`` + prompt index), then run
    each drafter once over the target's sequence (kind ``teacher_forced``). Sampled traces record beta from the
    processed distributions (``teacher_forced_rows``), which their meta says (``"beta": "processed"``)."""
    sampling = sampling or SamplingConfig()
    out_dir = Path(out_dir)
    _prepare(out_dir, {**meta, "kind": "teacher_forced", "drafters": [d.name for d in drafters], "k_max": k_max,
                       "max_new_tokens": max_new_tokens, "sampling": vars(sampling), "device": str(target.device),
                       "dtype": str(target.dtype), **({} if sampling.greedy else {"beta": "processed"})})
    decoder = SpeculativeDecoder(target.model, [], None, sampling=sampling,
                                 stop_token_ids=target.eos_token_ids)
    i, n = resolve_shard(shard)
    chunks = list(_chunks(prompts, (i, n), chunk_size))
    for name, chunk in progress_iter(chunks, "teacher-forced traces", unit="chunk", enabled=progress):
        if (out_dir / f"{name}.parquet").exists():
            continue
        rows = []
        for r in chunk:
            seed = None if sampling.greedy else (sampling.seed or 0) + hash_id(r["prompt_id"])
            res = decoder.generate(r["input_ids"], max_new_tokens, request=RequestInfo(seed=seed), keep_logits=True)
            rows += teacher_forced_rows(target, drafters, r, res.tokens, k_max, target_logits=res.logits,
                                        sampling=sampling)
        write_shard(rows, "teacher_forced", out_dir, name)
    write_shard_manifest(out_dir, i, n, [r["prompt_id"] for _, chunk in chunks for r in chunk],
                         [name for name, _ in chunks])
    if n == 1:
        merge_shards(out_dir, 1)
    return out_dir


def hash_id(prompt_id: str) -> int:
    """A stable small integer per prompt id (sampling seeds that do not depend on shard layout)."""
    import hashlib

    return int(hashlib.sha256(prompt_id.encode()).hexdigest()[:8], 16)
