"""Trace collection over a prompt set: live (decoder step records) and teacher-forced (one pass per drafter).

Both are sharded and resumable: prompts are split into shards (``shard=(i, n)``, or torchrun's RANK / WORLD_SIZE) and
each shard into chunks of ``chunk_size`` prompts; every chunk is one Parquet file written atomically, so a rerun
skips finished chunks and an interruption loses at most the chunk in progress, never duplicates one.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Sequence

import torch

from sacpolicy.decoding import ModelDrafter, SamplingConfig, SpeculativeDecoder
from sacpolicy.decoding.sampling import draft_stats, probs_from_logits
from sacpolicy.policy import Autoregressive
from sacpolicy.traces.schema import SCHEMA_VERSION, TraceError, read_meta, write_meta, write_shard

logger = logging.getLogger(__name__)

_T1 = SamplingConfig(temperature=1.0)


def resolve_shard(shard: tuple[int, int] | str | None) -> tuple[int, int]:
    """``(i, n)``, ``"i/n"``, or None: torchrun's RANK / WORLD_SIZE when set, else the whole set."""
    if shard is None:
        return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
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
        keys = [k for k in meta if k not in ("device_name",)]
        if any(old.get(k) != meta[k] for k in keys):
            diff = {k: (old.get(k), meta[k]) for k in keys if old.get(k) != meta[k]}
            raise TraceError(f"{out_dir} holds traces of another collection {diff}; use a new directory")
        return
    from sacpolicy import __version__

    write_meta(out_dir, {**meta, "schema_version": SCHEMA_VERSION, "package_version": __version__})


def collect_live(decoder: SpeculativeDecoder, prompts, out_dir, *, max_new_tokens: int, meta: dict,
                 shard=None, chunk_size: int = 8, progress: bool = True) -> Path:
    """Decode each prompt with the decoder's policy and write its step records (kind ``live``)."""
    from tqdm.auto import tqdm

    out_dir = Path(out_dir)
    weights = next(decoder.target.parameters())
    _prepare(out_dir, {**meta, "kind": "live", "policy": repr(decoder.policy), "max_new_tokens": max_new_tokens,
                       "drafters": list(decoder.drafters), "sampling": vars(decoder.sampling),
                       "device": str(weights.device), "dtype": str(weights.dtype)})
    for name, chunk in tqdm(list(_chunks(prompts, shard, chunk_size)), desc="live traces", disable=not progress):
        if (out_dir / f"{name}.parquet").exists():
            continue
        rows = []
        for r in chunk:
            res = decoder.generate(r["input_ids"], max_new_tokens, category=r["category"])
            for s in res.steps:
                rows.append({"prompt_id": r["prompt_id"], "category": r["category"], "prompt_len": res.prompt_len,
                             "policy": repr(decoder.policy), **s.to_dict()})
        write_shard(rows, "live", out_dir, name)
    return out_dir


@torch.inference_mode()
def teacher_forced_rows(target, drafters: Sequence, row: dict, generated: list[int], k_max: int,
                        target_logits: torch.Tensor | None = None) -> list[dict]:
    """Per generated position and drafter: the draft's prediction given the target's own prefix (one batched pass
    for model drafters; one proposal per position for the others) and the accepted run from there.

    ``target_logits`` ([G, V]): the target's logits behind each generated token, as kept by the decode that produced
    them (``generate(keep_logits=True)``); without them the target runs one teacher-forced pass to recompute them."""
    prompt = list(row["input_ids"])
    L, G = len(prompt), len(generated)
    ids = torch.tensor([prompt + generated], device=target.device)
    if target_logits is None:
        # logits_to_keep: the LM head runs only where a generated token is predicted, not over the prompt
        target_logits = target.model(input_ids=ids, logits_to_keep=G + 1).logits[0, :-1]
    if target_logits.shape[0] != G:
        raise ValueError(f"target_logits has {target_logits.shape[0]} rows for {G} generated tokens")
    p = probs_from_logits(target_logits.float(), _T1)  # [G, V]
    gen = torch.tensor(generated, device=target.device)
    p_target = p.gather(-1, gen.view(-1, 1)).squeeze(-1)
    out = []
    for d in drafters:
        if isinstance(d, ModelDrafter):
            logits = d.full_logits(d.model(input_ids=ids, logits_to_keep=G + 1).logits[0, :-1].float())
            q = probs_from_logits(logits, _T1)
            stats = draft_stats(logits)
            draft = q.argmax(-1)
            match = draft == gen
            q_target = q.gather(-1, gen.view(-1, 1)).squeeze(-1)
            beta = torch.minimum(p, q).sum(-1)
            run = _runs(match.tolist(), k_max)
            plen = [k_max] * G
            draft, match = draft.tolist(), match.tolist()
        else:  # any other drafter: ask it, position by position, what it would propose
            draft, match, run, plen, st, q_target, beta = [], [], [], [], [], [], []
            for g in range(G):
                d.reset()
                block = d.propose(ids[0, : L + g], k_max, SamplingConfig(), None)
                toks = block.tokens.tolist()
                r = 0
                while r < len(toks) and g + r < G and toks[r] == generated[g + r]:
                    r += 1
                draft.append(toks[0] if toks else -1)
                match.append(r > 0)
                run.append(r)
                plen.append(len(toks))
                if not toks:
                    st.append([0.0, 0.0, 0.0])
                else:
                    st.append([1.0, 0.0, 1.0] if block.confidence is None else block.confidence[0].tolist())
                q_target.append(1.0 if r > 0 else 0.0)
                beta.append(float(p[g, toks[0]]) if toks else 0.0)
            stats, q_target, beta = torch.tensor(st), torch.tensor(q_target), torch.tensor(beta)
        stats = stats.tolist()
        for g in range(G):
            out.append({
                "prompt_id": row["prompt_id"], "category": row["category"], "prompt_len": L, "drafter": d.name,
                "position": g, "target_token": generated[g], "draft_token": int(draft[g]), "match": bool(match[g]),
                "top1": stats[g][0], "entropy": stats[g][1], "margin": stats[g][2], "p_target": float(p_target[g]),
                "q_target": float(q_target[g]), "beta": float(beta[g]), "run_len": int(run[g]),
                "proposal_len": int(plen[g]), "proposal": not isinstance(d, ModelDrafter),
            })
    return out


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
    each drafter once over the target's sequence (kind ``teacher_forced``)."""
    from tqdm.auto import tqdm

    sampling = sampling or SamplingConfig()
    out_dir = Path(out_dir)
    _prepare(out_dir, {**meta, "kind": "teacher_forced", "drafters": [d.name for d in drafters], "k_max": k_max,
                       "max_new_tokens": max_new_tokens, "sampling": vars(sampling), "device": str(target.device),
                       "dtype": str(target.dtype)})
    decoder = SpeculativeDecoder(target.model, [], Autoregressive(), sampling=sampling,
                                 stop_token_ids=target.eos_token_ids)
    for name, chunk in tqdm(list(_chunks(prompts, shard, chunk_size)), desc="teacher-forced traces",
                            disable=not progress):
        if (out_dir / f"{name}.parquet").exists():
            continue
        rows = []
        for r in chunk:
            seed = None if sampling.greedy else (sampling.seed or 0) + hash_id(r["prompt_id"])
            res = decoder.generate(r["input_ids"], max_new_tokens, seed=seed, keep_logits=True)
            rows += teacher_forced_rows(target, drafters, r, res.tokens, k_max, target_logits=res.logits)
        write_shard(rows, "teacher_forced", out_dir, name)
    return out_dir


def hash_id(prompt_id: str) -> int:
    """A stable small integer per prompt id (sampling seeds that do not depend on shard layout)."""
    import hashlib

    return int(hashlib.sha256(prompt_id.encode()).hexdigest()[:8], 16)
