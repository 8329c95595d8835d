"""Parquet files read one record batch at a time, only the text column."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

# Rows per batch: bounded memory even for row groups of millions of rows.
BATCH_ROWS = 1024


def read_parquet(path: Path, text_field: str) -> Iterator[tuple[str, bool]]:
    """Yield the ``text_field`` column of ``path``, one document per row; null rows are skipped.

    Raises:
        ValueError: the file is not readable Parquet or breaks while reading (names the file
            and the row where it broke), the column is missing (names the columns present) or
            is not a string column.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as err:
        raise ValueError(
            f"'{path}' is not a readable Parquet file (broke before row 0: {str(err).strip()}); "
            "download or copy the file again"
        ) from err
    names = parquet.schema_arrow.names
    if text_field not in names:
        raise ValueError(
            f"'{path}' has no column '{text_field}'; its columns are {names}; pass "
            "text_field=<the column that holds the text>"
        )
    column_type = parquet.schema_arrow.field(text_field).type
    if not (pa.types.is_string(column_type) or pa.types.is_large_string(column_type)):
        raise ValueError(
            f"'{path}' column '{text_field}' holds {column_type}, not text; pass "
            f"text_field=<a string column of {names}>"
        )
    row = 0
    # Row group by row group, so an error names the row group and row where it broke.
    for group in range(parquet.num_row_groups):
        batches = parquet.iter_batches(
            batch_size=BATCH_ROWS, row_groups=[group], columns=[text_field]
        )
        while True:
            try:
                batch = next(batches)
            except StopIteration:
                break
            except (pa.ArrowException, OSError) as err:
                raise ValueError(
                    f"'{path}' is corrupt: reading broke at row {row} (row group {group}: "
                    f"{str(err).strip()}); download or copy the file again"
                ) from err
            for text in batch.column(0).to_pylist():
                row += 1
                if text is not None:
                    yield text, True
