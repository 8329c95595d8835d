"""`prepare` throughput: worker processes vs the `tokenizers` library's own batch encoding.

Run (about a minute on 2 CPU cores with the defaults):

    python benchmarks/prepare.py [--max_bytes 4000000] [--vocab 4096] [--repeats 3]

The corpus is the demo corpus (`.py` files of the standard library, `demo_corpus_files`), one
JSON line per file; a byte-level BPE tokenizer is trained on it first (`train_bpe`). Then, in
one run and interleaved (so that load from other processes falls on every row alike), best of
``--repeats``:

- ``tokenizers encode_batch, N threads``: `tokenizers.Tokenizer.encode_batch` over the
  documents, already in memory (N=1: TOKENIZERS_PARALLELISM=false; N=2: its thread pool,
  RAYON_NUM_THREADS=2);
- ``prepare, N workers``: `nanotrain.data.prepare` of the JSONL file, reading, tokenizing,
  splitting and writing the shards, for N = 1 .. the CPU count.

tokens/s counts the text's tokens (EOS excluded). Ratios are against the 2-thread
`encode_batch` row of the same run.
"""

from __future__ import annotations

import os

# The `tokenizers` thread pool is sized once, at its first use: 2 threads, as the goal states.
os.environ.setdefault("RAYON_NUM_THREADS", "2")

import argparse  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

from nanotrain.data import demo_corpus_files, prepare, read_metadata, train_bpe  # noqa: E402
from nanotrain.data.prepare import default_num_workers  # noqa: E402


def write_corpus(folder: Path, max_bytes: int) -> tuple[Path, list[str]]:
    """The demo corpus as one JSONL file (one document per source file) and as texts."""
    texts = [path.read_text(encoding="utf-8") for path in demo_corpus_files(max_bytes)]
    path = folder / "corpus.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")
    return path, texts


def time_encode_batch(tokenizer_path: Path, texts: list[str], threads: int) -> tuple[float, int]:
    """Seconds and tokens of one `encode_batch` over ``texts`` (1 thread or the pool)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_path))
    tok.encode_special_tokens = True  # as nanotrain encodes: text is text
    os.environ["TOKENIZERS_PARALLELISM"] = "true" if threads > 1 else "false"
    start = time.perf_counter()
    encodings = tok.encode_batch(texts, add_special_tokens=False)
    seconds = time.perf_counter() - start
    return seconds, sum(len(e.ids) for e in encodings)


def time_prepare(corpus: Path, tokenizer: Path, out: Path, workers: int) -> tuple[float, int]:
    """Seconds and text tokens of one `prepare` with ``workers`` processes."""
    start = time.perf_counter()
    prepare([str(corpus)], out, tokenizer=str(tokenizer), num_workers=workers, progress=False)
    seconds = time.perf_counter() - start
    meta = read_metadata(out)
    tokens = meta["total_tokens"] - meta["num_documents"]  # EOS are not text
    shutil.rmtree(out)
    return seconds, tokens


def main() -> None:
    """Parse the flags, run every row ``--repeats`` times interleaved, print the table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--max_bytes", type=int, default=4_000_000)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    cores = default_num_workers()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        corpus, texts = write_corpus(folder, args.max_bytes)
        tokenizer = folder / "tokenizer.json"
        train_bpe(texts[: max(1, len(texts) // 4)], args.vocab, tokenizer)
        rows = {"tokenizers encode_batch, 1 thread": ("lib", 1)}
        rows["tokenizers encode_batch, 2 threads"] = ("lib", 2)
        for workers in range(1, cores + 1):
            rows[f"prepare, {workers} worker{'s' if workers > 1 else ''}"] = ("prepare", workers)
        best: dict[str, tuple[float, int]] = {}
        for _ in range(args.repeats):
            for name, (kind, count) in rows.items():
                if kind == "lib":
                    result = time_encode_batch(tokenizer, texts, count)
                else:
                    result = time_prepare(corpus, tokenizer, folder / "out", count)
                if name not in best or result[0] < best[name][0]:
                    best[name] = result
    size = corpus.stat().st_size if corpus.exists() else sum(len(t.encode()) for t in texts)
    reference = best["tokenizers encode_batch, 2 threads"]
    print(f"corpus: {len(texts)} documents, {size / 1e6:.1f} MB; vocab {args.vocab}; {cores} CPUs")
    print("| row | seconds | tokens | tokens/s | vs encode_batch 2 threads |")
    print("|---|---|---|---|---|")
    for name, (seconds, tokens) in best.items():
        ratio = (tokens / seconds) / (reference[1] / reference[0])
        print(f"| {name} | {seconds:.2f} | {tokens:,} | {tokens / seconds:,.0f} | {ratio:.2f}x |")


if __name__ == "__main__":
    main()
