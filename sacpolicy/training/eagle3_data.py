"""EAGLE-3 training data: the target's hidden states over token sequences, computed once and cached on disk.

One teacher-forced target pass per batch of sequences (prompt + target continuation) captures, per position p:
``aux`` [A] the inputs of the decoder layers the head reads (forward pre-hooks on ``model.model.layers[i]``: only
those layers, never ``output_hidden_states``), ``final`` [H] the final (post-norm) hidden state, from which training
computes the target's logits over the draft vocabulary with the target's LM-head rows, and ``top`` the target's
full-vocabulary argmax (which the draft vocabulary may miss). Stored as fp16 safetensors shards under one directory:

    meta.json                 format, aux layer ids, target, sequence count and hash, shard size
    shard-00000.safetensors   input_ids [N] int32, aux [N, A], final [N, H], top [N] int32 (N = the shard's tokens),
                              offsets [S + 1] int64 (sequence s = rows offsets[s] .. offsets[s + 1]), prompt_len [S]

A shard that exists is complete (written to a temporary name, then renamed), so an interrupted build resumes.
Reading opens each shard once per process (lazily, so each DataLoader worker maps its own) and slices its sequences
out of the memory map.

Online (``head.features=online``): no cache; ``Sequences`` batches token ids (``collate_sequences``) and the training
step turns them into the same layout with ``online_features``, one target pass under ``torch.no_grad``.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch.utils.data import Dataset, Sampler

from sacpolicy.decoding.aux import AuxCapture
from sacpolicy.io import write_json
from sacpolicy.progress import progress_iter

FEATURE_FORMAT = 1
META_FILE = "meta.json"


@torch.no_grad()  # not inference_mode: online training feeds these tensors to the head's autograd graph
def capture_features(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, layer_ids):
    """One target pass: input_ids, attention_mask [B, T] -> aux [B, T, len(layer_ids) * H] (the inputs of decoder
    layers ``layer_ids``, in that order), final [B, T, H] (post-norm last hidden state)."""
    capture = AuxCapture(model, layer_ids)
    with capture:
        final = model.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
    return capture.batch(layer_ids), final


@torch.no_grad()
def sequence_features(model, ids: torch.Tensor, mask: torch.Tensor, layer_ids) -> list[dict]:
    """One target pass over right-padded sequences ids, mask [B, T] -> per sequence its real positions' ``input_ids``
    [n] long, ``aux`` [n, A], ``final`` [n, H] (the target's dtype) and ``top`` [n] long (the target's
    full-vocabulary argmax), on the target's device: what a feature cache stores, before its storage dtype."""
    aux, final = capture_features(model, ids, mask, layer_ids)
    head, out = model.get_output_embeddings(), []
    for i, n in enumerate(mask.sum(1).tolist()):
        out.append({"input_ids": ids[i, :n], "aux": aux[i, :n], "final": final[i, :n],
                    "top": head(final[i, :n]).argmax(-1)})
    return out


def sequences_hash(sequences) -> str:
    h = hashlib.sha256()
    for r in sequences:
        h.update(json.dumps([list(r["input_ids"]), int(r["prompt_len"])]).encode())
    return h.hexdigest()[:16]


def _batches(rows: list[dict], batch_size: int | None, batch_tokens: int | None) -> list[list[dict]]:
    """Consecutive rows in batches of ``batch_size``, or of at most ``batch_tokens`` padded tokens."""
    if batch_tokens is None:
        return [rows[s : s + batch_size] for s in range(0, len(rows), batch_size)]
    out, cur, width = [], [], 0
    for r in rows:
        w = max(width, len(r["input_ids"]))
        if cur and w * (len(cur) + 1) > batch_tokens:
            out.append(cur)
            cur, w = [], len(r["input_ids"])
        cur.append(r)
        width = w
    return out + [cur] if cur else out


def shard_tensors(target, rows: list[dict], layer_ids, dtype: torch.dtype, *, batch_size: int | None = 8,
                  batch_tokens: int | None = None) -> dict:
    """The cached tensors of one shard's sequences (right-padded batches of ``batch_size`` rows or of at most
    ``batch_tokens`` padded tokens; real rows kept)."""
    model, parts = target.model.eval(), {"input_ids": [], "aux": [], "final": [], "top": []}
    for chunk in _batches(rows, batch_size, batch_tokens):
        width = max(len(r["input_ids"]) for r in chunk)
        ids = torch.zeros(len(chunk), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, r in enumerate(chunk):
            ids[i, : len(r["input_ids"])] = torch.tensor(r["input_ids"])
            mask[i, : len(r["input_ids"])] = 1
        for seq in sequence_features(model, ids.to(target.device), mask.to(target.device), layer_ids):
            parts["top"].append(seq["top"].int().cpu())
            parts["input_ids"].append(seq["input_ids"].int().cpu())
            parts["aux"].append(seq["aux"].to(dtype).cpu())
            parts["final"].append(seq["final"].to(dtype).cpu())
    out = {k: torch.cat(v).contiguous() for k, v in parts.items()}
    if not (torch.isfinite(out["aux"]).all() and torch.isfinite(out["final"]).all()):
        raise ValueError(f"the target's hidden states overflow {dtype}, the feature cache's storage dtype; build it "
                         "with bfloat16 (a run: head.cache_dtype=bfloat16; here: dtype=torch.bfloat16)")
    lens = torch.tensor([0] + [len(r["input_ids"]) for r in rows])
    out["offsets"] = lens.cumsum(0)
    out["prompt_len"] = torch.tensor([int(r["prompt_len"]) for r in rows], dtype=torch.int32)
    return out


def build_feature_cache(target, sequences, cache_dir, aux_layer_ids, *, batch_size: int = 8, shard_size: int = 64,
                        dtype: torch.dtype = torch.float16, progress: bool = True) -> FeatureCache:
    """Cache the target's features of ``sequences`` (rows with ``input_ids`` and ``prompt_len``) under ``cache_dir``;
    shards already there are kept. A cache built for other layers, another target or other sequences is refused."""
    cache_dir, rows = Path(cache_dir), list(sequences)
    meta = {"format": FEATURE_FORMAT, "aux_layer_ids": [int(i) for i in aux_layer_ids], "target": target.spec,
            "hidden_size": int(target.model.config.hidden_size), "sequences": len(rows),
            "sequences_hash": sequences_hash(rows), "shard_size": shard_size, "dtype": str(dtype)}
    old = cache_dir / META_FILE
    if old.is_file():
        _check_meta(json.loads(old.read_text()), meta, cache_dir)
    else:
        write_json(old, meta)
    shards = range(0, len(rows), shard_size)
    for k, s in enumerate(progress_iter(shards, "EAGLE-3 features", unit="shard", enabled=progress)):
        path = cache_dir / f"shard-{k:05d}.safetensors"
        if path.is_file():
            continue
        tensors = shard_tensors(target, rows[s : s + shard_size], meta["aux_layer_ids"], dtype, batch_size=batch_size)
        tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
        save_file(tensors, str(tmp))
        os.replace(tmp, path)
    return FeatureCache(cache_dir)


def _check_meta(found: dict, wanted: dict, cache_dir: Path) -> None:
    for key, what in (("format", "format"), ("aux_layer_ids", "aux layer ids"), ("target", "target"),
                      ("hidden_size", "hidden size"), ("sequences_hash", "sequences"), ("shard_size", "shard size"),
                      ("dtype", "dtype")):
        if found.get(key) != wanted[key]:
            raise ValueError(f"the feature cache at {cache_dir} was built for {what} {found.get(key)!r}, not "
                             f"{wanted[key]!r}; delete it or pick another cache directory")


class FeatureCache(Dataset):
    """The sequences of a feature cache, read lazily (memory-mapped slices of the shards). Item: ``input_ids`` [n]
    long, ``aux`` [n, A], ``final`` [n, H], ``top`` [n] long, ``prompt_len`` int.

    Each shard is opened once per process, at its first read: handles are not pickled (spawned DataLoader workers
    open their own) and a forked worker drops the ones it inherited, so every worker reads through its own maps."""

    def __init__(self, cache_dir):
        self.dir = Path(cache_dir)
        self._handles, self._pid = {}, os.getpid()
        self.meta = json.loads((self.dir / META_FILE).read_text())
        self.aux_layer_ids = list(self.meta["aux_layer_ids"])
        self._index = []  # (shard path, first row, last row, prompt_len) per sequence
        if "sequences" in self.meta:  # a cache of given sequences: every shard must be there
            paths = [self.dir / f"shard-{k:05d}.safetensors"
                     for k in range(-(-self.meta["sequences"] // self.meta["shard_size"]))]
        else:  # a streamed cache (sacpolicy.training.head_data): the shards built so far, in order
            paths = sorted(self.dir.glob("shard-*.safetensors"))
        for path in paths:
            if not path.is_file():
                raise FileNotFoundError(f"feature shard {path} is missing; rerun build_feature_cache to finish it")
            with safe_open(str(path), framework="pt") as f:
                offsets, plen = f.get_tensor("offsets").tolist(), f.get_tensor("prompt_len").tolist()
            self._index += [(str(path), a, b, p) for a, b, p in zip(offsets[:-1], offsets[1:], plen)]

    def __len__(self) -> int:
        return len(self._index)

    @property
    def lengths(self) -> list[int]:
        """Tokens per sequence."""
        return [b - a for _, a, b, _ in self._index]

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_handles": {}}

    def _shard(self, path: str):
        """The open (memory-mapped) shard at ``path``, opened at this process's first read of it."""
        if self._pid != os.getpid():  # a forked worker: its own handles, not the parent's
            self._handles, self._pid = {}, os.getpid()
        f = self._handles.get(path)
        if f is None:
            f = self._handles[path] = safe_open(path, framework="pt")
        return f

    def sequences(self):
        """``input_ids`` (a list) and ``prompt_len`` of every sequence, without reading the features."""
        for path, a, b, plen in self._index:
            yield {"input_ids": self._shard(path).get_slice("input_ids")[a:b].tolist(), "prompt_len": plen}

    def __getitem__(self, i: int) -> dict:
        path, a, b, plen = self._index[i]
        f = self._shard(path)
        item = {k: f.get_slice(k)[a:b] for k in ("input_ids", "aux", "final", "top")}
        item["input_ids"], item["top"] = item["input_ids"].long(), item["top"].long()
        item["prompt_len"] = plen
        return item


class FeatureCaches(Dataset):
    """Several feature caches read as one (concatenated in order): the sources of a head's data mix."""

    def __init__(self, caches: list[FeatureCache]):
        if not caches:
            raise ValueError("FeatureCaches needs at least one cache")
        layers = {tuple(c.aux_layer_ids) for c in caches}
        if len(layers) > 1:
            raise ValueError(f"the caches {[str(c.dir) for c in caches]} hold different aux layers {sorted(layers)}; "
                             "build every source for the head's layers")
        self.caches, self.aux_layer_ids = list(caches), list(caches[0].aux_layer_ids)
        self._where = [(j, i) for j, c in enumerate(caches) for i in range(len(c))]

    @property
    def dir(self) -> str:
        return ", ".join(str(c.dir) for c in self.caches)

    def __len__(self) -> int:
        return len(self._where)

    @property
    def lengths(self) -> list[int]:
        return [n for c in self.caches for n in c.lengths]

    def sequences(self):
        for c in self.caches:
            yield from c.sequences()

    def __getitem__(self, i: int) -> dict:
        j, k = self._where[i]
        return self.caches[j][k]


class Sequences(Dataset):
    """Token sequences for online features (``head.features=online``), from rows with ``input_ids`` and
    ``prompt_len`` (another ``Sequences`` too), held as one int32 tensor. Item: ``input_ids`` [n] long,
    ``prompt_len`` int; iterating gives the rows back."""

    def __init__(self, rows):
        ids, self.prompt_len = [], []
        for r in rows:
            ids.append(torch.as_tensor(r["input_ids"], dtype=torch.int32))
            self.prompt_len.append(int(r["prompt_len"]))
        self.ids = torch.cat(ids) if ids else torch.zeros(0, dtype=torch.int32)
        self.offsets = torch.tensor([0] + [len(x) for x in ids]).cumsum(0).tolist()

    def __len__(self) -> int:
        return len(self.prompt_len)

    @property
    def lengths(self) -> list[int]:
        return [b - a for a, b in zip(self.offsets[:-1], self.offsets[1:])]

    def sequences(self):
        for i in range(len(self)):
            yield {"input_ids": self.ids[self.offsets[i] : self.offsets[i + 1]].tolist(),
                   "prompt_len": self.prompt_len[i]}

    __iter__ = sequences

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[self.offsets[i] : self.offsets[i + 1]].long(), "prompt_len": self.prompt_len[i]}


def collate_sequences(items: list[dict]) -> dict:
    """Right-padded token ids for an online feature pass: ``ids``, ``mask`` [B, N], ``prompt_len`` [B]."""
    N = max(it["input_ids"].shape[0] for it in items)
    ids, mask = torch.zeros(len(items), N, dtype=torch.long), torch.zeros(len(items), N, dtype=torch.long)
    for b, it in enumerate(items):
        ids[b, : it["input_ids"].shape[0]], mask[b, : it["input_ids"].shape[0]] = it["input_ids"], 1
    return {"ids": ids, "mask": mask, "prompt_len": torch.tensor([it["prompt_len"] for it in items])}


def online_features(model, batch: dict, layer_ids) -> dict:
    """A ``collate_sequences`` batch -> the ``collate_features`` batch of its features, computed now by ``model``
    (the frozen target, in eval mode) on the batch's device: what the cache path would read, in the target's own
    dtype (no storage rounding)."""
    seqs = sequence_features(model, batch["ids"], batch["mask"], layer_ids)
    return collate_features([{**seq, "prompt_len": int(p)} for seq, p in zip(seqs, batch["prompt_len"].tolist())])


def collate_features(items: list[dict]) -> dict:
    """Right-padded batch in the training-time-test layout: TTT row t pairs the target's aux at position t with token
    x_{t+1}; its step-j draft predicts x_{t+2+j}, whose target distribution comes from ``final``/``top`` at row t + j.

    input_ids [B, T] = x_{t+1}; aux [B, T, A]; final [B, T, H] and top [B, T] = the target at position t + 1;
    valid [B, T] = row t exists; length [B] = rows; first [B] = prompt_len - 2, the first row whose prediction is a
    continuation token (row u carries a training target when first <= u < length)."""
    lens = [it["input_ids"].shape[0] - 1 for it in items]
    B, T = len(items), max(lens)
    A, H = items[0]["aux"].shape[-1], items[0]["final"].shape[-1]
    on = {"device": items[0]["aux"].device}
    batch = {"input_ids": torch.zeros(B, T, dtype=torch.long, **on),
             "aux": torch.zeros(B, T, A, dtype=items[0]["aux"].dtype, **on),
             "final": torch.zeros(B, T, H, dtype=items[0]["final"].dtype, **on),
             "top": torch.zeros(B, T, dtype=torch.long, **on), "valid": torch.zeros(B, T, dtype=torch.bool, **on)}
    for b, (it, n) in enumerate(zip(items, lens)):
        batch["input_ids"][b, :n] = it["input_ids"][1:]
        batch["aux"][b, :n] = it["aux"][:n]
        batch["final"][b, :n] = it["final"][1:]
        batch["top"][b, :n] = it["top"][1:]
        batch["valid"][b, :n] = True
    batch["length"] = torch.tensor(lens, **on)
    batch["first"] = torch.tensor([it["prompt_len"] - 2 for it in items], **on)
    return batch


class LengthBuckets(Sampler):
    """Batches of ``batch_size`` sequences of similar length (little padding), in a new random order every epoch:
    the sequences are shuffled, cut into pools of ``pool`` batches, each pool sorted by length and cut into batches,
    and the batches shuffled. Seeded: epoch e of a run draws the same batches wherever it runs.

    Distributed (``num_replicas`` ranks, this one ``rank``): every rank draws the same batches and takes every
    ``num_replicas``-th of them from its rank on, so the ranks' shares are disjoint and bucketed alike; when the
    batches do not divide evenly, the last ranks repeat the epoch's first batches, so every rank steps as often (DDP
    syncs gradients each step). Lightning calls ``set_epoch`` each epoch (``use_distributed_sampler=False``: this
    sampler is the distributed one)."""

    def __init__(self, lengths: list[int], batch_size: int, seed: int = 0, pool: int = 64, num_replicas: int = 1,
                 rank: int = 0):
        if batch_size < 1 or not lengths:
            raise ValueError(f"LengthBuckets needs batch_size >= 1 and sequences (got {batch_size}, {len(lengths)})")
        if not 0 <= rank < num_replicas:
            raise ValueError(f"LengthBuckets: rank {rank} is not one of {num_replicas} replicas")
        self.lengths, self.batch_size, self.seed, self.pool, self.epoch = list(lengths), batch_size, seed, pool, 0
        self.num_replicas, self.rank = num_replicas, rank

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return -(-self._batches() // self.num_replicas)

    def _batches(self) -> int:
        return -(-len(self.lengths) // self.batch_size)

    def __iter__(self):
        gen = torch.Generator().manual_seed(self.seed + self.epoch)
        self.epoch += 1
        order = torch.randperm(len(self.lengths), generator=gen).tolist()
        span, batches = self.batch_size * self.pool, []
        for s in range(0, len(order), span):
            pool = sorted(order[s : s + span], key=self.lengths.__getitem__)
            batches += [pool[i : i + self.batch_size] for i in range(0, len(pool), self.batch_size)]
        batches = [batches[i] for i in torch.randperm(len(batches), generator=gen).tolist()]
        padded = [batches[i % len(batches)] for i in range(len(self) * self.num_replicas)]
        yield from padded[self.rank :: self.num_replicas]


class Strided(Sampler):
    """Rank ``rank``'s share of ``n`` items for evaluation: every ``num_replicas``-th from ``rank`` on, in order,
    none repeated (validation sums its counts over ranks; uneven shares are fine without gradients)."""

    def __init__(self, n: int, num_replicas: int = 1, rank: int = 0):
        self.n, self.num_replicas, self.rank = n, num_replicas, rank

    def __len__(self) -> int:
        return len(range(self.rank, self.n, self.num_replicas))

    def __iter__(self):
        return iter(range(self.rank, self.n, self.num_replicas))
