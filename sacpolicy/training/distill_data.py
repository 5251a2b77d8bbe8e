"""Distillation data: target continuations of training prompts and the target's top-k next-token log-probs.

Sequence-level KD (DistillSpec, GKD): the draft learns the target's distribution on the target's own outputs. Both
the continuations and the teacher's top-k are computed once and cached as ``datasets`` on disk (keyed by everything
that determines them), so reruns, resumed runs and other losses reuse them. Fixed text (any prompt source whose rows
are used verbatim) needs no generation: only one teacher-forced target pass.

A few hundred benchmark prompts are too few: a draft trained on them agrees with the target twice as often on those
prompts as on new ones. ``synthetic_prompts`` writes more with the target itself (Magpie): given only its chat
template up to the user's turn, an instruction-tuned model samples a plausible user request.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil

import datasets
import lightning as L
import torch
from torch.utils.data import DataLoader

from sacpolicy.models import LoadedModel, cache_root
from sacpolicy.progress import progress_iter

logger = logging.getLogger(__name__)

DATA_FORMAT = 1
LOGITS_BUDGET = 4 * 2**30  # bytes of raw logits a batch of target continuations may hold (``generate_continuations``)
# Rows: input_ids = prompt + continuation; topk_* hold the teacher's top-k at positions prompt_len - 1 .. len - 2,
# i.e. the distributions of the continuation tokens (for fixed text, prompt_len = 1: every position).
FEATURES = datasets.Features({
    "prompt_id": datasets.Value("string"),
    "sample": datasets.Value("int32"),
    "input_ids": datasets.Sequence(datasets.Value("int64")),
    "prompt_len": datasets.Value("int32"),
    "topk_ids": datasets.Sequence(datasets.Sequence(datasets.Value("int32"))),
    "topk_logp": datasets.Sequence(datasets.Sequence(datasets.Value("float16"))),
})


def cache_key(**parts) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def cached_dataset(name: str, key: str, build) -> datasets.Dataset:
    """Load ``cache_root()/distill/<name>-<key>`` or build it with ``build()`` and save it atomically."""
    path = cache_root() / "distill" / f"{name}-{key}"
    if path.is_dir():
        return datasets.load_from_disk(str(path))
    ds = build()
    if not len(ds):  # datasets cannot load an empty dataset back from disk; an empty result is cheap to rebuild
        return ds
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    ds.save_to_disk(str(tmp))
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.replace(tmp, path)
    except OSError:  # another process won the race: use its copy
        shutil.rmtree(tmp, ignore_errors=True)
    return datasets.load_from_disk(str(path))


def _pad_id(target: LoadedModel) -> int:
    """Padding for batched generation: the tokenizer's pad token, else the first stop token."""
    return target.tokenizer.pad_token_id if target.tokenizer.pad_token_id is not None else target.eos_token_ids[0]


@torch.inference_mode()
def generate_continuations(target: LoadedModel, prompts: datasets.Dataset, *, max_new_tokens: int = 192,
                           samples: int = 1, temperature: float = 0.0, batch_size: int = 16, seed: int = 0,
                           topk: int = 64, progress: bool = True) -> datasets.Dataset:
    """Target continuations of each prompt (``samples`` per prompt; greedy when temperature == 0) with the target's
    top-k next-token log-probs at every continuation position.

    Bulk generation runs batched (left padding) with transformers' ``generate``: on a CPU, batching is what makes
    thousands of target tokens affordable, which batch-1 speculative decoding cannot match before a good draft exists.
    """
    pad = _pad_id(target)
    model = target.model.eval()
    # generate keeps every step's raw logits (output_logits): [batch, steps, vocab] floats, 8 GB at a 262k vocabulary,
    # 48 rows and 160 tokens; a batch is cut to fit LOGITS_BUDGET (a 49k vocabulary keeps its 48 rows)
    vocab = int(model.get_output_embeddings().out_features)
    fits = max(1, LOGITS_BUDGET // (max(max_new_tokens, 1) * vocab * 4))
    if batch_size > fits:
        logger.info("target continuations: batches of %d rows, not %d (a %d-token vocabulary's logits for %d tokens "
                    "within %.0f GiB)", fits, batch_size, vocab, max_new_tokens, LOGITS_BUDGET / 2**30)
        batch_size = fits
    jobs = [(row["prompt_id"], s, row["input_ids"]) for row in prompts for s in range(samples)]
    jobs.sort(key=lambda j: len(j[2]))  # similar lengths per batch: less padding
    rows = {key: [] for key in FEATURES}
    gen = torch.Generator(device="cpu").manual_seed(seed)
    starts = range(0, len(jobs), batch_size)
    for start in progress_iter(starts, "target continuations", unit="batch", enabled=progress):
        batch = jobs[start : start + batch_size]
        width = max(len(j[2]) for j in batch)
        ids = torch.full((len(batch), width), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, (_, _, p) in enumerate(batch):
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=gen)))
        out = model.generate(ids.to(target.device), attention_mask=mask.to(target.device),
                             max_new_tokens=max_new_tokens, do_sample=temperature > 0,
                             temperature=temperature if temperature > 0 else None, top_k=0, top_p=1.0,
                             pad_token_id=pad, eos_token_id=target.eos_token_ids,
                             output_logits=True, return_dict_in_generate=True)
        # the raw logits of each generation step are the teacher's next-token distributions: no second pass; each
        # step's top-k taken alone (one step's logits at a time, not all of them stacked and normalised at once)
        steps = [torch.log_softmax(step.float(), -1).topk(topk, dim=-1) for step in out.logits]
        top_ids, top_logp = torch.stack([t.indices for t in steps], 1), torch.stack([t.values for t in steps], 1)
        del steps
        for i, (pid, s, p) in enumerate(batch):
            cont = out.sequences[i, width:].tolist()
            for j, t in enumerate(cont):  # cut after the first EOS; what follows is padding
                if t in target.eos_token_ids:
                    cont = cont[: j + 1]
                    break
            rows["prompt_id"].append(pid)
            rows["sample"].append(s)
            rows["input_ids"].append(list(p) + cont)
            rows["prompt_len"].append(len(p))
            rows["topk_ids"].append(top_ids[i, : len(cont)].int().tolist())
            rows["topk_logp"].append(top_logp[i, : len(cont)].half().tolist())
    return datasets.Dataset.from_dict(rows, features=FEATURES)


def first_answers(target: LoadedModel, *, max_new_tokens: int, topk: int, batch_size: int = 48,
                  chat: bool = True) -> datasets.Dataset:
    """The target's greedy answers to every MT-Bench first turn, with their teacher top-k, generated once per target
    and settings (cached). The ``mt_bench_turn2`` prompts quote them (``answer_texts``), and distillation trains on
    them where its prompts are those first turns (``DistillDataModule(reuse=...)``): one generation for both.
    ``chat``: the prompts in the target's chat template, or (False) a base model's plain format (``load_prompts``)."""
    from sacpolicy.data import load_prompts

    prompts = load_prompts("mt_bench", tokenizer=target.tokenizer, chat=chat)
    plain = {} if chat else {"chat": False}  # the key of a chat run's answers stays what it was
    key = cache_key(format=DATA_FORMAT, target=target.spec, dtype=str(target.dtype), ids=prompts["prompt_id"],
                    lens=[len(x) for x in prompts["input_ids"]], max_new_tokens=max_new_tokens, topk=topk, **plain)
    return cached_dataset("answers", key, lambda: generate_continuations(
        target, prompts, max_new_tokens=max_new_tokens, topk=topk, batch_size=batch_size))


def answer_texts(answers: datasets.Dataset, tokenizer) -> dict[str, str]:
    """{prompt_id: the answer's text} of ``first_answers`` (what ``load_prompts(..., answers=)`` takes)."""
    return {r["prompt_id"]: tokenizer.decode(r["input_ids"][r["prompt_len"]:], skip_special_tokens=True).strip()
            for r in answers}


SENTINEL = "\x00sacpolicy-user-turn\x00"


def user_turn_prefix(tokenizer) -> list[int]:
    """Token ids of the chat template up to where a user's message begins (system prompt included)."""
    from sacpolicy.data import PromptSetError

    if not getattr(tokenizer, "chat_template", None):
        raise PromptSetError("synthetic prompts need a chat model: the target's tokenizer has no chat template; "
                             "set distill.data.synthetic.count=0")
    text = tokenizer.apply_chat_template([{"role": "user", "content": SENTINEL}], tokenize=False,
                                         add_generation_prompt=False)
    if SENTINEL not in text:
        raise PromptSetError("the chat template does not place the user's message verbatim; "
                             "set distill.data.synthetic.count=0")
    return tokenizer(text.split(SENTINEL)[0], add_special_tokens=False)["input_ids"]


@torch.inference_mode()
def synthetic_prompts(target: LoadedModel, count: int, *, max_tokens: int = 64, temperature: float = 1.0,
                      batch_size: int = 48, seed: int = 0, progress: bool = True) -> datasets.Dataset:
    """``count`` user requests sampled from the target given its template up to the user's turn (Magpie, Xu et al.
    2024), as a prompt set (prompt_id ``synthetic/<i>``, category ``synthetic``, messages, input_ids). Requests that
    do not end within ``max_tokens``, near-empty ones and duplicates are dropped, so fewer than ``count`` may come back.
    """
    from sacpolicy.data import apply_template, prompt_features

    if count < 1 or max_tokens < 1 or temperature <= 0:
        raise ValueError("synthetic prompts need count >= 1, max_tokens >= 1 and temperature > 0")
    tok, model, pad = target.tokenizer, target.model.eval(), _pad_id(target)
    prefix = torch.tensor([user_turn_prefix(tok)], device=target.device)
    stops = set(target.eos_token_ids)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    seen, rows = set(), {"prompt_id": [], "category": [], "messages": [], "input_ids": []}
    for start in progress_iter(range(0, count, batch_size), "synthetic prompts", unit="batch", enabled=progress):
        n = min(batch_size, count - start)
        torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=gen)))
        ids = prefix.expand(n, -1)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, do_sample=True,
                             temperature=temperature, top_k=0, top_p=1.0, pad_token_id=pad,
                             eos_token_id=target.eos_token_ids)
        for row in out[:, prefix.shape[1]:].tolist():
            end = next((j for j, t in enumerate(row) if t in stops), None)
            if end is None:
                continue  # unfinished: not a whole request
            text = tok.decode(row[:end], skip_special_tokens=True).strip()
            if len(text) < 8 or text in seen:
                continue
            seen.add(text)
            messages = [{"role": "user", "content": text}]
            rows["prompt_id"].append(f"synthetic/{len(rows['prompt_id'])}")
            rows["category"].append("synthetic")
            rows["messages"].append(messages)
            rows["input_ids"].append(apply_template(messages, tok))
    logger.info("synthetic prompts: kept %d of %d sampled requests", len(rows["prompt_id"]), count)
    return datasets.Dataset.from_dict(rows, features=prompt_features(with_input_ids=True))


@torch.inference_mode()
def teacher_topk(target: LoadedModel, seqs: list[dict], *, k: int = 64, batch_size: int = 8,
                 progress: bool = True) -> datasets.Dataset:
    """Teacher-forced target pass over given sequences (rows with prompt_id, input_ids, prompt_len): the target's
    top-k at positions prompt_len - 1 .. len - 2. Used for fixed text and for on-policy draft samples."""
    model = target.model.eval()
    rows = {key: [] for key in FEATURES}
    for start in progress_iter(range(0, len(seqs), batch_size), "teacher top-k", unit="batch", enabled=progress):
        chunk = seqs[start : start + batch_size]
        width = max(len(r["input_ids"]) for r in chunk)
        ids = torch.zeros((len(chunk), width), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, r in enumerate(chunk):  # right padding: positions of real tokens are unchanged
            ids[i, : len(r["input_ids"])] = torch.tensor(r["input_ids"])
            mask[i, : len(r["input_ids"])] = 1
        logits = model(input_ids=ids.to(target.device), attention_mask=mask.to(target.device)).logits
        top = torch.log_softmax(logits.float(), -1).topk(k, dim=-1)
        for i, r in enumerate(chunk):
            first, last = r["prompt_len"] - 1, len(r["input_ids"]) - 1
            rows["prompt_id"].append(r["prompt_id"])
            rows["sample"].append(r.get("sample", 0))
            rows["input_ids"].append(list(r["input_ids"]))
            rows["prompt_len"].append(r["prompt_len"])
            rows["topk_ids"].append(top.indices[i, first:last].int().cpu().tolist())
            rows["topk_logp"].append(top.values[i, first:last].half().cpu().tolist())
    return datasets.Dataset.from_dict(rows, features=FEATURES)


def token_counts(seqs: datasets.Dataset, vocab_size: int) -> torch.Tensor:
    """How often each target token appears in the continuations (the trimmed vocabulary's ranking)."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for row in seqs:
        cont = torch.tensor(row["input_ids"][row["prompt_len"]:], dtype=torch.long)
        counts += torch.bincount(cont, minlength=vocab_size)[:vocab_size]
    return counts


def collate(rows: list[dict]) -> dict:
    """Right-padded batch. ``loss_mask[b, t]`` marks positions t (predicting token t + 1) that carry teacher top-k."""
    T = max(len(r["input_ids"]) for r in rows)
    k = len(rows[0]["topk_ids"][0])
    ids = torch.zeros(len(rows), T, dtype=torch.long)
    attn = torch.zeros(len(rows), T, dtype=torch.long)
    loss_mask = torch.zeros(len(rows), T - 1, dtype=torch.bool)
    top_ids = torch.zeros(len(rows), T - 1, k, dtype=torch.long)
    top_logp = torch.full((len(rows), T - 1, k), -1e4)
    for b, r in enumerate(rows):
        n, first = len(r["input_ids"]), r["prompt_len"] - 1
        ids[b, :n] = torch.tensor(r["input_ids"])
        attn[b, :n] = 1
        loss_mask[b, first : n - 1] = True
        top_ids[b, first : n - 1] = torch.tensor(r["topk_ids"], dtype=torch.long).view(-1, k)
        top_logp[b, first : n - 1] = torch.tensor(r["topk_logp"], dtype=torch.float32).view(-1, k)
    return {"input_ids": ids, "attention_mask": attn, "loss_mask": loss_mask, "topk_ids": top_ids,
            "topk_logp": top_logp, "prompt_len": torch.tensor([r["prompt_len"] for r in rows])}


SYNTHETIC_DEFAULTS = {"count": 1024, "max_tokens": 64, "temperature": 1.0}


def data_defaults() -> dict:
    """DistillDataModule's settings with their defaults (its signature is their one home), as the pipeline's config
    node ``distill.data`` holds them: what ``distill.data.<key>=...`` overrides."""
    import inspect

    params = inspect.signature(DistillDataModule.__init__).parameters.values()
    out = {p.name: p.default for p in params if p.default is not inspect.Parameter.empty
           and p.name not in ("fixed_text", "seed", "synthetic", "reuse")}  # these come from the run
    return {**out, "synthetic": dict(SYNTHETIC_DEFAULTS)}


class DistillDataModule(L.LightningDataModule):
    """Train/val sequences with cached teacher top-k. Built once in ``prepare_data`` (rank 0), read in ``setup``.

    Train: greedy and/or ``samples`` sampled target continuations of the training prompts; the target's greedy
    continuations of ``synthetic["count"]`` requests it wrote itself (``synthetic_prompts``); optional fixed text.
    Val: the target's greedy continuations of held-out prompts, on which greedy match rate is measured.
    """

    # the one home of the data defaults (conf/distill/*.yaml `data:` holds overrides only)
    def __init__(self, target: LoadedModel, train_prompts: datasets.Dataset, val_prompts: datasets.Dataset, *,
                 max_new_tokens: int = 160, samples: int = 1, temperature: float = 0.8, greedy_too: bool = True,
                 fixed_text: datasets.Dataset | None = None, synthetic: dict | None = None, topk: int = 64,
                 batch_size: int = 8, gen_batch_size: int = 48, seed: int = 0,
                 reuse: datasets.Dataset | None = None):
        super().__init__()
        if samples < 0 or (samples == 0 and not greedy_too):
            raise ValueError("distillation data needs greedy continuations (greedy_too) or samples >= 1")
        self.target, self.train_prompts, self.val_prompts, self.fixed_text = target, train_prompts, val_prompts, fixed_text
        self.settings = dict(max_new_tokens=max_new_tokens, samples=samples, temperature=temperature,
                             greedy_too=greedy_too, topk=topk, seed=seed)
        # Magpie requests the target writes itself, answered greedily: what lets a draft generalize to new prompts
        # (generated in batches of gen_batch_size: larger batches generate more tokens/s on a CPU)
        self.synthetic = {**SYNTHETIC_DEFAULTS, **(synthetic or {})}
        unknown = set(self.synthetic) - {"count", "max_tokens", "temperature"}
        if unknown:
            raise ValueError(f"unknown distill.data.synthetic keys {sorted(unknown)}; use count, max_tokens, temperature")
        self.batch_size, self.gen_batch_size = batch_size, gen_batch_size
        # greedy continuations already generated with these max_new_tokens and topk (``first_answers``): prompts found
        # there (same id, same tokens) are not generated again
        self.reuse = {r["prompt_id"]: r for r in reuse} if reuse is not None else {}
        self.train = self.val = None

    def _model_key(self, **parts) -> str:
        return cache_key(format=DATA_FORMAT, target=self.target.spec, dtype=str(self.target.dtype), **parts)

    def _key(self, prompts: datasets.Dataset, **extra) -> str:
        """A set generated from ``prompts``: depends on them and on every generation setting."""
        return self._model_key(ids=prompts["prompt_id"], lens=[len(x) for x in prompts["input_ids"]], **self.settings,
                               **extra)

    def _generate(self, prompts: datasets.Dataset, sampled: bool) -> datasets.Dataset:
        s = self.settings
        common = dict(max_new_tokens=s["max_new_tokens"], batch_size=self.gen_batch_size, topk=s["topk"])
        parts = []
        if s["greedy_too"] or not sampled:
            known = [i for i, r in enumerate(prompts) if r["prompt_id"] in self.reuse
                     and self.reuse[r["prompt_id"]]["input_ids"][: len(r["input_ids"])] == list(r["input_ids"])]
            if known:
                parts.append(datasets.Dataset.from_list([self.reuse[prompts[i]["prompt_id"]] for i in known],
                                                        features=FEATURES))
            rest = prompts.select(sorted(set(range(len(prompts))) - set(known)))
            if len(rest):
                parts.append(generate_continuations(self.target, rest, **common))
        if sampled and s["samples"] > 0:
            parts.append(generate_continuations(self.target, prompts, samples=s["samples"], seed=s["seed"],
                                                temperature=s["temperature"] or 1.0, **common))
        return datasets.concatenate_datasets(parts)

    def prepare_data(self) -> None:
        self.setup()

    def setup(self, stage: str | None = None) -> None:
        if self.train is not None:
            return
        self.train = cached_dataset("train", self._key(self.train_prompts),
                                    lambda: self._generate(self.train_prompts, sampled=True))
        if self.synthetic["count"]:
            syn, seed = self.synthetic, self.settings["seed"]
            key = self._model_key(seed=seed, batch=self.gen_batch_size, **syn)  # not the answers' settings
            prompts = cached_dataset("synthetic-prompts", key, lambda: synthetic_prompts(
                self.target, syn["count"], max_tokens=syn["max_tokens"], temperature=syn["temperature"],
                batch_size=self.gen_batch_size, seed=seed))
            if len(prompts):
                continuations = cached_dataset("synthetic", self._key(prompts, kind="synthetic-greedy"),
                                               lambda: self._generate(prompts, sampled=False))
                self.train = datasets.concatenate_datasets([self.train, continuations])
            else:
                logger.warning("the target finished none of its %d synthetic requests within %d tokens (not a chat "
                               "model?); training on the other data only", syn["count"], syn["max_tokens"])
        if self.fixed_text is not None:
            rows = [{"prompt_id": r["prompt_id"], "input_ids": r["input_ids"], "prompt_len": 1} for r in self.fixed_text]
            fixed = cached_dataset("text", self._key(self.fixed_text, kind="text"),
                                   lambda: teacher_topk(self.target, rows, k=self.settings["topk"]))
            self.train = datasets.concatenate_datasets([self.train, fixed])
        self.val = cached_dataset("val", self._key(self.val_prompts, kind="val-greedy"),
                                  lambda: self._generate(self.val_prompts, sampled=False))

    def train_dataloader(self):
        return DataLoader(self.train, batch_size=self.batch_size, shuffle=True, collate_fn=collate)

    def val_dataloader(self):
        return DataLoader(self.val, batch_size=self.batch_size, shuffle=False, collate_fn=collate)
