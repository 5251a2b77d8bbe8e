"""Prompt sources from any Hugging Face ``datasets`` source (``hf:<name or path>``), with a column mapping."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import datasets

from sacpolicy.data.rows import PromptSetError, Row, make_row, user_message


def hf_rows(name: str, columns: Mapping[str, str] | None, split: str, config: str | None, data_files) -> list[Row]:
    if not columns or "prompt" not in columns:
        raise PromptSetError(
            f"hf:{name} needs columns={{'prompt': <column>}} (optional 'id', 'category') mapping our fields to the "
            f"dataset's columns; got columns={columns!r}"
        )
    unknown = set(columns) - {"prompt", "id", "category"}
    if unknown:
        raise PromptSetError(f"columns has unknown keys {sorted(unknown)}; allowed keys are 'prompt', 'id', 'category'")
    try:
        ds = datasets.load_dataset(name, config, split=split, data_files=data_files)
    except Exception as e:  # datasets raises many types (FileNotFound, DatasetNotFound, connection, bad split)
        raise PromptSetError(
            f"hf:{name} could not be loaded (config={config!r}, split={split!r}, data_files={data_files!r}): {e}; "
            f"check the name, split and config, or for local files use source='hf:json' with hf_data_files=<path>"
        ) from e
    for field, column in columns.items():
        if column not in ds.column_names:
            raise PromptSetError(
                f"hf:{name}: column {column!r} (mapped from {field!r}) is missing; the dataset's columns are "
                f"{ds.column_names}; fix the `columns` mapping"
            )
    prefix = hf_prefix(name, data_files)
    rows = []
    for i, ex in enumerate(ds.select_columns(sorted(set(columns.values())))):
        text = ex[columns["prompt"]]
        if not isinstance(text, str):
            raise PromptSetError(
                f"hf:{name} row {i}: column {columns['prompt']!r} holds {type(text).__name__}; it must hold strings"
            )
        rid = ex[columns["id"]] if "id" in columns else i
        category = str(ex[columns["category"]]) if "category" in columns else prefix.rsplit("/", 1)[-1]
        rows.append(make_row(f"{prefix}/{rid}", category, [user_message(text)]))
    return rows


def hf_prefix(name: str, data_files) -> str:
    # Builder names like "json" say nothing about the prompts; the data file does.
    if isinstance(data_files, (str, Path)):
        return Path(data_files).stem
    if Path(name).expanduser().exists():
        return Path(name).expanduser().resolve().stem
    return name
