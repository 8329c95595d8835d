"""Tokenizing `prepare`'s chunks in worker processes, results in input order.

The main process reads and cuts the text into batches of chunks; ``num_workers`` processes
tokenize them (the pattern of nanoGPT's fineweb.py: a process pool over documents); results
come back in submission order, so the output does not depend on the number of workers. At
most ``2 * num_workers`` batches are in flight, so memory stays bounded however fast the
reader is (`Pool.imap` would read the whole input ahead).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

import numpy as np

from .tokenizers import ByteTokenizer, Tokenizer

# Characters of text per batch sent to a worker: large enough to amortize the transfer,
# small enough that 2 * num_workers of them are little memory.
BATCH_CHARS = 1 << 16


@dataclass
class TokenizedBatch:
    """One batch's tokens.

    Attributes:
        ids: every chunk's ids concatenated, EOS appended after chunks that end a document;
            1-D, the shard dtype.
        token_counts: tokens per chunk (EOS included), shape (num_chunks,).
        byte_counts: UTF-8 bytes of text per chunk, shape (num_chunks,).
        max_id: the largest id (-1 for an empty batch).
        documents: how many chunks end a document.
    """

    ids: np.ndarray
    token_counts: np.ndarray
    byte_counts: np.ndarray
    max_id: int
    documents: int


def batch_chunks(chunks: Iterable[tuple[str, bool]]) -> Iterator[list[tuple[str, bool]]]:
    """Group ``(chunk, ends_document)`` pairs into lists of about `BATCH_CHARS` characters."""
    batch: list[tuple[str, bool]] = []
    size = 0
    for chunk in chunks:
        batch.append(chunk)
        size += len(chunk[0])
        if size >= BATCH_CHARS:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def tokenize_batch(
    tok: Tokenizer, batch: list[tuple[str, bool]], dtype: np.dtype
) -> TokenizedBatch:
    """Tokenize one batch of chunks (see `TokenizedBatch`).

    Raises:
        ValueError: the tokenizer produced an id outside its vocabulary.
    """
    texts = [text for text, _ in batch]
    if isinstance(tok, ByteTokenizer):
        encoded = [text.encode("utf-8") for text in texts]
        byte_counts = np.fromiter(map(len, encoded), np.int64, len(encoded))
        pieces = [np.frombuffer(raw, np.uint8) for raw in encoded]
    else:
        encode_batch = getattr(tok, "encode_batch", None)
        lists = encode_batch(texts) if encode_batch else [tok.encode(text) for text in texts]
        byte_counts = np.fromiter((len(t.encode("utf-8")) for t in texts), np.int64, len(texts))
        pieces = [np.asarray(ids, dtype=np.int64) for ids in lists]
    eos = np.asarray([tok.eos_id], dtype=np.int64)
    parts: list[np.ndarray] = []
    for (_, ends_document), ids in zip(batch, pieces, strict=True):
        parts.append(ids)
        if ends_document:
            parts.append(eos)
    token_counts = np.fromiter(
        (len(ids) + ends for ids, (_, ends) in zip(pieces, batch, strict=True)),
        np.int64,
        len(batch),
    )
    ids = np.concatenate(parts).astype(np.int64) if parts else np.empty(0, np.int64)
    max_id = int(ids.max()) if len(ids) else -1
    if max_id >= tok.vocab_size or (len(ids) and int(ids.min()) < 0):
        raise ValueError(
            f"tokenizer produced id {max_id} outside its vocabulary [0, {tok.vocab_size})"
        )
    documents = sum(ends for _, ends in batch)
    return TokenizedBatch(ids.astype(dtype), token_counts, byte_counts, max_id, documents)


@contextlib.contextmanager
def one_thread_per_tokenizer() -> Iterator[None]:
    """`tokenizers` runs batches on a thread pool unless TOKENIZERS_PARALLELISM is false; a
    worker process must use one thread (the workers are the parallelism), and a process
    forked after the pool was used would otherwise print a warning. Set for the whole
    `prepare`, since the workers are forked at the first batch."""
    before = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = before


_WORKER: tuple[Tokenizer, np.dtype] | None = None


def _init_worker(tok: Tokenizer, dtype: np.dtype) -> None:
    global _WORKER
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _WORKER = (tok, dtype)


def _work(batch: list[tuple[str, bool]]) -> TokenizedBatch:
    assert _WORKER is not None, "worker used before _init_worker"
    return tokenize_batch(_WORKER[0], batch, _WORKER[1])


def tokenize_in_order(
    batches: Iterable[list[tuple[str, bool]]],
    tok: Tokenizer,
    dtype: np.dtype,
    num_workers: int,
) -> Iterator[TokenizedBatch]:
    """Tokenize ``batches`` with ``num_workers`` processes (1: in this process), in order.

    Reading ``batches`` (the input files) happens in this process while the workers
    tokenize. Errors from a worker are raised here; the workers are stopped on any error.
    """
    with one_thread_per_tokenizer():
        if num_workers <= 1:
            for batch in batches:
                yield tokenize_batch(tok, batch, dtype)
        else:
            yield from _in_worker_processes(batches, tok, dtype, num_workers)


def _in_worker_processes(
    batches: Iterable[list[tuple[str, bool]]], tok: Tokenizer, dtype: np.dtype, num_workers: int
) -> Iterator[TokenizedBatch]:
    # fork: workers inherit the tokenizer without pickling and start in milliseconds.
    # ProcessPoolExecutor, not Pool: a worker that dies (killed for memory) raises
    # BrokenProcessPool here instead of hanging.
    methods = multiprocessing.get_all_start_methods()
    context = multiprocessing.get_context("fork" if "fork" in methods else "spawn")
    pool = ProcessPoolExecutor(
        num_workers, mp_context=context, initializer=_init_worker, initargs=(tok, dtype)
    )
    try:
        pending: deque = deque()
        for batch in batches:
            pending.append(pool.submit(_work, batch))
            if len(pending) >= 2 * num_workers:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
