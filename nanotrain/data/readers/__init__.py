"""Readers for the formats corpora ship in, each streaming its documents.

`open_sources(inputs, text_field)` turns what `prepare` was given (paths, folders, globs, an
iterable of strings, a `datasets.Dataset`/`IterableDataset`) into `Source` objects; iterating a
source yields ``(text, ends_document)`` pieces in a fixed order, never holding more than one
document (or, for a plain text file, one block of it) in memory.

| format | chosen by | reader |
|---|---|---|
| Parquet | ``.parquet`` file (folders and globs of shards expand to files) | `parquet.py` |
| JSON lines | ``.jsonl``, ``.json`` (plain, ``.gz`` or ``.zst``) | `jsonl.py` |
| text | any other UTF-8 file (``.txt``, ``.md``, ``.py`` ...): one document | `text.py` |
| `datasets` folder | a folder holding ``state.json`` + ``dataset_info.json`` | `hf_datasets.py` |
"""

from .sources import FORMATS, Source, open_sources

__all__ = ["FORMATS", "Source", "open_sources"]
