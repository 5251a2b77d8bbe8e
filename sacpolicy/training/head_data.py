"""EAGLE-3 training data at scale: the target's features over chat text and its answers, teacher-forced (no
generation here), streamed into shards under a token and a disk budget.

Sources (``sources``, mixed by concatenation):

- ``sharegpt``: a sequence is one turn of a ShareGPT conversation: the chat template over the conversation's earlier
  turns and the user's turn (the prompt), then the dataset's own, fixed answer to it;
- ``regenerated``: the target's own greedy answers to chat and code prompts, generated once by
  ``scripts/regenerate_answers.py`` into the directory ``answers`` (kept beside the head, so no later leg pays for
  them again).

The target reads each sequence once; ``eagle3_data`` stores what the head trains on. The stream of sequences is
fixed by the recipe (file order), never by the budget, so a larger budget only adds shards after the ones already
built: data legs add up, and an interrupted build resumes at its next shard.

    settings = HeadDataSettings(max_tokens=2_000_000)
    caches = build_head_data(target, settings)            # {"train": FeatureCache, "val": FeatureCache}
    seqs = head_sequences(target, settings)               # online features: the same sequences, nothing cached

Cache directory per source (``cache_dir``, default
``$SACPOLICY_CACHE/head-features/<target>/<recipe hash>/<split>``):
``meta.json`` (the recipe, target, aux layers, dtype) and ``shard-NNNNN.safetensors`` in ``eagle3_data``'s layout,
whose metadata records the shard's prompt ids and a hash of its token ids, so a resumed build checks that the stream
it rebuilds is the same.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import logging
import os
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from sacpolicy.data.splits import assign_split
from sacpolicy.io import write_json
from sacpolicy.progress import duration
from sacpolicy.training.eagle3_data import (
    META_FILE,
    FeatureCache,
    FeatureCaches,
    Sequences,
    sequences_hash,
    shard_tensors,
)

logger = logging.getLogger(__name__)

STREAM_FORMAT = 2
SOURCES = ("sharegpt", "regenerated")
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


@dataclass
class HeadDataSettings:
    """Where the head's training text comes from and how much of it the target reads."""

    sources: list = field(default_factory=lambda: ["sharegpt"])  # "sharegpt" (fixed answers), "regenerated"
    answers: str | None = None  # "regenerated": a directory of scripts/regenerate_answers.py (all its rows are read)
    turns: str = "all"  # "first": first turns only; "all": every turn, the earlier turns as its context
    max_prompt_tokens: int = 384  # a turn whose prompt (template + context + request) is longer is skipped
    max_seq_tokens: int = 512  # prompt + answer; a longer answer is cut here
    min_answer_tokens: int = 16  # shorter answers are skipped
    max_tokens: int = 1_000_000  # sharegpt's training tokens (lengths summed); more shards are added as it grows
    val_sequences: int = 256  # held-out sequences per source (the val split's first ones) for checkpoint selection
    shard_tokens: int = 65_536  # tokens per shard (the unit of resumption)
    batch_tokens: int = 4_096  # padded tokens per teacher-forced pass (length-sorted within a shard)
    max_cache_gb: float = 60.0  # stop adding shards once the cache directory holds this much (a warning says so)
    dtype: str = "float16"
    cache_dir: str | None = None  # None: $SACPOLICY_CACHE/head-features/<target>/<recipe hash>, one per source

    def __post_init__(self) -> None:
        self.sources = list(self.sources)
        bad = [x for x in self.sources if x not in SOURCES]
        if bad or not self.sources:
            raise ValueError(f"head_data.sources={self.sources!r}: use one or more of {list(SOURCES)}; for the "
                             "target's continuations of the pipeline's prompt mix leave head_data unset (the distill "
                             "data)")
        if "regenerated" in self.sources and not (self.answers and (Path(self.answers) / "meta.json").is_file()):
            raise ValueError(f"head_data.sources has 'regenerated' but head_data.answers={self.answers!r} is not a "
                             "directory of scripts/regenerate_answers.py (with a meta.json); generate the answers "
                             "with that script and give its --out")
        if self.cache_dir and len(self.sources) > 1:
            raise ValueError("head_data.cache_dir names one cache; leave it unset to mix several sources")
        if self.turns not in ("first", "all"):
            raise ValueError(f"head_data.turns={self.turns!r}; use 'first' or 'all'")
        if not 0 < self.max_prompt_tokens < self.max_seq_tokens:
            raise ValueError("head_data needs 0 < max_prompt_tokens < max_seq_tokens")
        if self.dtype not in DTYPES:
            raise ValueError(f"head_data.dtype={self.dtype!r}; use one of {sorted(DTYPES)}")

    def recipe(self, source: str = "sharegpt") -> dict:
        """What fixes ``source``'s stream of sequences (not the budgets, which only say how far to read it)."""
        keep = ("turns", "max_prompt_tokens", "max_seq_tokens", "min_answer_tokens", "dtype")
        if source == "regenerated":
            meta = json.loads((Path(self.answers) / "meta.json").read_text())
            keep, extra = ("max_seq_tokens", "min_answer_tokens", "dtype"), {
                "answers": {k: meta.get(k) for k in ("target", "engine", "max_tokens", "prompt_list_sha")}}
        else:
            extra = {}
        return {"source": source, **{k: v for k, v in asdict(self).items() if k in keep}, **extra}


def recipe_hash(recipe: dict) -> str:
    return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:12]


def _template(tokenizer, messages: list[dict], generation_prompt: bool) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    return [int(t) for t in ids]


def chat_sequences(tokenizer, split: str, settings: HeadDataSettings, path=None) -> Iterator[dict]:
    """The sequences of one split, in the recipe's fixed order: ``prompt_id``, ``input_ids`` (prompt + answer, the
    answer closed by the template's end of turn unless cut), ``prompt_len``."""
    from sacpolicy.data.sharegpt import conversation_id, conversations

    s = settings
    for conv in conversations(path):
        cid = conversation_id(conv.id)
        if assign_split(cid) != split:
            continue
        for j in range(1, (1 if s.turns == "first" else len(conv.pairs)) + 1):
            prompt = _template(tokenizer, conv.messages(j), True)
            if len(prompt) > s.max_prompt_tokens:
                continue
            full = _template(tokenizer, conv.messages(j, with_answer=True), False)
            if full[: len(prompt)] != prompt:  # a template that rewrites earlier text: the answer alone
                full = prompt + tokenizer(conv.pairs[j - 1][1], add_special_tokens=False)["input_ids"]
            if len(full) - len(prompt) < s.min_answer_tokens:
                continue
            yield {"prompt_id": f"{cid}/turn{j}", "input_ids": full[: s.max_seq_tokens], "prompt_len": len(prompt)}


def regenerated_sequences(split: str, settings: HeadDataSettings) -> Iterator[dict]:
    """The rows of ``settings.answers`` (scripts/regenerate_answers.py) in ``split``, in file order, as sequences:
    the prompt, then the target's own answer (cut at ``max_seq_tokens``)."""
    s = settings
    parts = sorted(Path(s.answers).glob("part-*.jsonl.gz"))
    if not parts:
        raise FileNotFoundError(f"{s.answers} holds no part-*.jsonl.gz; run scripts/regenerate_answers.py --out "
                                f"{s.answers} to generate them")
    for part in parts:
        with gzip.open(part, "rt") as f:
            for line in f:
                row = json.loads(line)
                if row["split"] != split or len(row["answer_ids"]) < s.min_answer_tokens:
                    continue
                ids = row["prompt_ids"] + row["answer_ids"]
                yield {"prompt_id": row["prompt_id"], "input_ids": ids[: s.max_seq_tokens],
                       "prompt_len": len(row["prompt_ids"])}


def _dir_gb(path: Path) -> float:
    return sum(f.stat().st_size for f in path.glob("shard-*.safetensors")) / 2**30


def build_stream_cache(target, sequences: Iterator[dict], cache_dir, aux_layer_ids, *, max_tokens: int | None,
                       max_sequences: int | None = None, shard_tokens: int = 65_536, batch_tokens: int = 4_096,
                       max_cache_gb: float | None = None, dtype: torch.dtype = torch.float16, recipe: dict | None = None,
                       desc: str = "head features") -> FeatureCache:
    """Teacher-force ``sequences`` through ``target`` into shards under ``cache_dir`` until ``max_tokens`` tokens (or
    ``max_sequences`` sequences) are cached; shards already there are kept (checked against the stream) and the
    build goes on after them. Logs tokens/s and the ETA after every shard."""
    cache_dir = Path(cache_dir)
    cache_dir.mkdir(parents=True, exist_ok=True)
    meta = {"format": STREAM_FORMAT, "aux_layer_ids": [int(i) for i in aux_layer_ids], "target": target.spec,
            "hidden_size": int(target.model.config.hidden_size), "dtype": str(dtype), "recipe": recipe or {}}
    old = cache_dir / META_FILE
    if old.is_file():
        found = json.loads(old.read_text())
        for key in meta:
            if found.get(key) != meta[key]:
                raise ValueError(f"the feature cache at {cache_dir} was built with {key} {found.get(key)!r}, not "
                                 f"{meta[key]!r}; delete it or pick another head_data.cache_dir")
    else:
        write_json(old, meta)
    tokens = seqs = k = 0
    stream = iter(sequences)
    while True:  # shards already built: skip their sequences in the stream, checking that they are the same
        path = cache_dir / f"shard-{k:05d}.safetensors"
        if not path.is_file():
            break
        with safe_open(str(path), framework="pt") as f:
            stamp = f.metadata()
            n = int(f.get_tensor("offsets")[-1])
        ids = json.loads(stamp["prompt_ids"])
        rebuilt = sorted((r for r in (next(stream, None) for _ in ids) if r), key=lambda r: len(r["input_ids"]))
        if [r["prompt_id"] for r in rebuilt] != ids or stamp.get("sequences_hash", sequences_hash(rebuilt)) != \
                sequences_hash(rebuilt):
            raise ValueError(f"{path} holds other sequences than the recipe's stream gives now (the data file or "
                             "the tokenizer changed?); delete the cache directory and build it again")
        tokens, seqs, k = tokens + n, seqs + len(ids), k + 1
    t0, start_tokens = time.monotonic(), tokens

    def full() -> bool:
        return (max_tokens is not None and tokens >= max_tokens) or (max_sequences is not None
                                                                    and seqs >= max_sequences)

    while not full():
        if max_cache_gb is not None and _dir_gb(cache_dir) >= max_cache_gb:
            logger.warning("%s: the cache at %s holds %.1f GB, its budget (max_cache_gb=%g); stopping at %d tokens",
                           desc, cache_dir, _dir_gb(cache_dir), max_cache_gb, tokens)
            break
        rows, n = [], 0
        for r in stream:
            rows.append(r)
            n += len(r["input_ids"])
            if n >= shard_tokens or (max_sequences is not None and seqs + len(rows) >= max_sequences):
                break
        if not rows:
            logger.info("%s: the stream ended at %d tokens (%d sequences)", desc, tokens, seqs)
            break
        rows.sort(key=lambda r: len(r["input_ids"]))  # length-sorted passes waste little on padding
        tensors = shard_tensors(target, rows, meta["aux_layer_ids"], dtype, batch_tokens=batch_tokens)
        path = cache_dir / f"shard-{k:05d}.safetensors"
        tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
        save_file(tensors, str(tmp), metadata={"prompt_ids": json.dumps([r["prompt_id"] for r in rows]),
                                               "sequences_hash": sequences_hash(rows)})
        os.replace(tmp, path)
        tokens, seqs, k = tokens + n, seqs + len(rows), k + 1
        rate = (tokens - start_tokens) / max(time.monotonic() - t0, 1e-9)
        left = f", ETA {duration((max_tokens - tokens) / rate)}" if max_tokens and tokens < max_tokens else ""
        logger.info("%s: shard %d, %d tokens in %d sequences (%.0f tokens/s%s, %.1f GB)", desc, k, tokens, seqs,
                    rate, left, _dir_gb(cache_dir))
    return FeatureCache(cache_dir)


def _streams(target, settings: HeadDataSettings, path=None):
    """(source, split, its sequences, its budget) in build order: per source, val then train."""
    s = settings
    for source in s.sources:
        for split in ("val", "train"):
            if source == "sharegpt":
                seqs = chat_sequences(target.tokenizer, split, s, path)
            else:
                seqs = regenerated_sequences(split, s)
            budget = ({"max_tokens": None, "max_sequences": s.val_sequences} if split == "val" else
                      {"max_tokens": s.max_tokens if source == "sharegpt" else None})
            yield source, split, seqs, budget


def build_head_data(target, settings: HeadDataSettings, aux_layer_ids, path=None) -> dict[str, FeatureCaches]:
    """The train and val feature caches of ``settings`` for ``target`` (built or extended as needed), the sources'
    caches concatenated. ``path``: the ShareGPT file (default: the installed package's)."""
    s = settings
    from sacpolicy.models import cache_root

    common = {"aux_layer_ids": aux_layer_ids, "shard_tokens": s.shard_tokens, "batch_tokens": s.batch_tokens,
              "max_cache_gb": s.max_cache_gb, "dtype": DTYPES[s.dtype]}
    out = {"val": [], "train": []}
    for source, split, seqs, budget in _streams(target, s, path):
        recipe = s.recipe(source)
        root = Path(s.cache_dir) if s.cache_dir else (cache_root() / "head-features" / target.spec.replace(":", "_")
                                                      / recipe_hash(recipe))
        if split == "val":
            logger.info("head data: %s%s, cached under %s", source,
                        f", up to {s.max_tokens} training tokens" if source == "sharegpt" else "", root)
        out[split].append(build_stream_cache(target, seqs, root / split, recipe=recipe,
                                             desc=f"head features ({source}, {split})", **budget, **common))
    return {split: FeatureCaches(caches) for split, caches in out.items()}


def head_sequences(target, settings: HeadDataSettings, path=None) -> dict[str, Sequences]:
    """The train and val sequences of ``settings`` for online features (``head.features=online``): the streams and
    budgets ``build_head_data`` reads (a budget met at a sequence rather than at a shard's end), the sources
    concatenated. The cache's own settings (``shard_tokens``, ``batch_tokens``, ``max_cache_gb``, ``dtype``) do not
    apply: nothing is stored."""
    out = {"val": [], "train": []}
    for source, split, seqs, budget in _streams(target, settings, path):
        most_tokens, most_seqs = budget["max_tokens"], budget.get("max_sequences")
        tokens, rows = 0, []
        for r in seqs:
            rows.append(r)
            tokens += len(r["input_ids"])
            if (most_tokens is not None and tokens >= most_tokens) or (most_seqs is not None
                                                                       and len(rows) >= most_seqs):
                break
        logger.info("head data (online): %s %s, %d sequences, %d tokens", source, split, len(rows), tokens)
        out[split].append(Sequences(rows))
    return {split: Sequences(r for part in parts for r in part) for split, parts in out.items()}
