"""Hugging Face `datasets`: a ``save_to_disk`` folder, a `Dataset` or an `IterableDataset`.

`datasets` is imported only here, only when such an input is given."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

# Rows fetched per step from a map-style Dataset (memory-mapped Arrow underneath).
BATCH_ROWS = 1024


def is_datasets_folder(folder: Path) -> bool:
    """Whether ``folder`` was written by ``Dataset.save_to_disk`` or ``DatasetDict.save_to_disk``."""
    return (folder / "dataset_dict.json").is_file() or (
        (folder / "state.json").is_file() and (folder / "dataset_info.json").is_file()
    )


def is_datasets_object(obj: Any) -> bool:
    """Whether ``obj`` is a `datasets.Dataset` or `datasets.IterableDataset` (no import)."""
    cls = type(obj)
    return cls.__module__.split(".")[0] == "datasets" and cls.__name__ in (
        "Dataset",
        "IterableDataset",
    )


def load_folder(folder: Path) -> Any:
    """The `datasets.Dataset` saved in ``folder`` (memory-mapped, not read into RAM).

    Raises:
        ValueError: `datasets` is not installed, or the folder holds a DatasetDict (names
            its splits).
    """
    dict_file = folder / "dataset_dict.json"
    if dict_file.is_file():
        splits = json.loads(dict_file.read_text(encoding="utf-8")).get("splits", [])
        raise ValueError(
            f"'{folder}' holds a datasets DatasetDict with splits {splits}; pass one split's "
            f"folder, e.g. '{folder / (splits[0] if splits else 'train')}'"
        )
    try:
        import datasets
    except ImportError as err:
        raise ValueError(
            f"'{folder}' is a Hugging Face datasets folder (save_to_disk); reading it needs the "
            "`datasets` library: pip install datasets"
        ) from err
    return datasets.load_from_disk(str(folder))


def read_dataset(dataset: Any, text_field: str, name: str) -> Iterator[tuple[str, bool]]:
    """Yield ``dataset[text_field]`` row by row, one document each; None rows are skipped.

    Raises:
        ValueError: the column is missing (names the columns present) or a value is not text.
    """
    columns = dataset.column_names
    if columns is not None and text_field not in columns:
        raise ValueError(
            f"{name} has no column '{text_field}'; its columns are {columns}; pass "
            "text_field=<the column that holds the text>"
        )
    if type(dataset).__name__ == "Dataset":
        rows = (
            text
            for batch in dataset.select_columns([text_field]).iter(batch_size=BATCH_ROWS)
            for text in batch[text_field]
        )
    else:
        rows = (_field(row, text_field, name) for row in dataset)
    for index, text in enumerate(rows):
        if text is None:
            continue
        if not isinstance(text, str):
            raise ValueError(
                f"{name} row {index}: column '{text_field}' holds {type(text).__name__}, not "
                "text; pass text_field=<a string column>"
            )
        yield text, True


def _field(row: dict[str, Any], text_field: str, name: str) -> Any:
    if text_field not in row:
        raise ValueError(
            f"{name} has no column '{text_field}'; its columns are {sorted(row)}; pass "
            "text_field=<the column that holds the text>"
        )
    return row[text_field]
