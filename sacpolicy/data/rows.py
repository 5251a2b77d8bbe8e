"""What every prompt source yields: a row (``prompt_id``, ``category``, ``messages``), built by ``make_row`` and
``user_message``, and the error a source raises when it cannot be loaded as asked. Sources (``data.sources``,
``data.hf``) import this module, not each other."""

from __future__ import annotations


class PromptSetError(ValueError):
    """A prompt source could not be loaded as asked: unknown set, bad file, missing column, nothing left, ..."""


Row = dict  # {"prompt_id": str, "category": str, "messages": list[{"role", "content"}]}


def user_message(content: str) -> dict:
    return {"role": "user", "content": content}


def make_row(prompt_id: str, category: str, messages: list[dict]) -> Row:
    return {"prompt_id": prompt_id, "category": category, "messages": messages}
