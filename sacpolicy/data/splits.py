"""A deterministic train/val/test split by prompt id: each id hashes on its own, so the split is the same on every
machine and adding or removing prompts never moves another prompt to a different split."""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Mapping

import datasets

DEFAULT_FRACTIONS: dict[str, float] = {"train": 0.6, "val": 0.2, "test": 0.2}
DEFAULT_SALT = "sacpolicy-split-v1"


class SplitError(ValueError):
    pass


_TURN_SUFFIX = re.compile(r"(/part\d+)?(/(turn\d+|edit|revision))?$")


def split_fraction(prompt_id: str, salt: str = DEFAULT_SALT) -> float:
    """A uniform number in [0, 1) fixed by the prompt id alone. sha256, not hash(): Python salts hash() per process.

    The parts of one ShareGPT conversation (``.../part<n>``, as the V3 file cut it) hash as the conversation.
    The turns of one multi-turn question (``.../turn<j>``) hash as the question, so they always share a split: a later
    turn's messages contain the earlier ones, and they must not leak between train and test. A code edit of a task
    (``.../edit``, its prompt holds the task's solution) and a revision (``.../revision``, its prompt holds an answer to
    the task or question) hash as the task or question, for the same reason.
    """
    digest = hashlib.sha256(f"{salt}:{_TURN_SUFFIX.sub('', prompt_id)}".encode("utf-8")).hexdigest()
    return int(digest[:16], 16) / 2**64


def _check_fractions(fractions: Mapping[str, float]) -> None:
    if not fractions or any(not f > 0 for f in fractions.values()):
        raise SplitError(f"split fractions {dict(fractions)} must be non-empty and all positive")
    total = sum(fractions.values())
    if not math.isclose(total, 1.0, abs_tol=1e-6):
        raise SplitError(f"split fractions {dict(fractions)} sum to {total:g}; they must sum to 1")


def assign_split(prompt_id: str, fractions: Mapping[str, float] = DEFAULT_FRACTIONS, salt: str = DEFAULT_SALT) -> str:
    """The split a prompt id belongs to: cumulative buckets of [0, 1) in `fractions` order."""
    _check_fractions(fractions)
    u, edge = split_fraction(prompt_id, salt), 0.0
    for name, fraction in fractions.items():
        edge += fraction
        if u < edge:
            return name
    return name  # u landed above a sum that rounded to just under 1


def split_prompts(
    ds: datasets.Dataset, fractions: Mapping[str, float] = DEFAULT_FRACTIONS, salt: str = DEFAULT_SALT
) -> datasets.DatasetDict:
    """Split by prompt id (see assign_split) into a DatasetDict keyed in `fractions` order; a split may be empty."""
    _check_fractions(fractions)
    if "prompt_id" not in ds.column_names:
        raise SplitError(f"cannot split: no 'prompt_id' column (columns are {ds.column_names}); use load_prompts")
    indices: dict[str, list[int]] = {name: [] for name in fractions}
    for i, pid in enumerate(ds["prompt_id"]):
        indices[assign_split(pid, fractions, salt)].append(i)
    return datasets.DatasetDict({name: ds.select(idx) for name, idx in indices.items()})
