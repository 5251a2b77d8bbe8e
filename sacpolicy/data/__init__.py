"""Prompt sets as `datasets.Dataset`, split by prompt id (``load_prompts``, ``load_prompt_mix``, ``split_prompts``).

One module per concern, no circle: ``rows`` (a row, its constructors, ``PromptSetError``), ``sources`` (the rows of
each named set and of local files), ``hf`` (any Hugging Face dataset), ``sharegpt`` (ShareGPT conversations),
``assets`` (files shipped in pip packages), ``splits`` (the train/val/test split by a hash of the id) and ``prompts``
(tokenizing, filtering and mixing the sources).
"""

from sacpolicy.data.prompts import (
    OVERFLOW,
    TURNS,
    apply_template,
    load_prompt_mix,
    load_prompts,
    needs_answers,
    prompt_features,
)
from sacpolicy.data.rows import PromptSetError, Row
from sacpolicy.data.sources import NEEDS_ANSWERS, PROMPT_SETS
from sacpolicy.data.splits import (
    DEFAULT_FRACTIONS,
    DEFAULT_SALT,
    SplitError,
    assign_split,
    split_fraction,
    split_prompts,
)

__all__ = [
    "DEFAULT_FRACTIONS", "DEFAULT_SALT", "NEEDS_ANSWERS", "OVERFLOW", "PROMPT_SETS", "TURNS", "PromptSetError", "Row",
    "SplitError", "apply_template", "assign_split", "load_prompt_mix", "load_prompts", "needs_answers",
    "prompt_features", "split_fraction", "split_prompts",
]
