"""`prepare` throughput: worker processes vs the `tokenizers` library's own batch encoding.

Run (about a minute on 2 CPU cores with the defaults):

    python benchmarks/prepare.py [--max_bytes 4000000] [--vocab 4096] [--repeats 3]

The corpus is the demo corpus (`.py` files of the standard library, `demo_corpus_files`), one
JSON line per file; a byte-level BPE tokenizer is trained on it first (`train_bpe`). Then, in
one run and interleaved (so that load from other processes falls on every row alike), the
median of ``--repeats``:

- ``tokenizers encode_batch, N threads``: `tokenizers.Tokenizer.encode_batch` over the
  documents, already in memory (N=1: TOKENIZERS_PARALLELISM=false; N=2: its thread pool,
  RAYON_NUM_THREADS=2);
- ``prepare, N workers``: `nanotrain.data.prepare` of the JSONL file, reading, tokenizing,
  splitting and writing the shards, for N = 1 .. the CPU count.

tokens/s counts the text's tokens (EOS excluded) per wall-clock second. CPU s is the CPU time
the row used (every thread of this process, plus the worker processes for prepare): tokens
per CPU-second compares the work each way does, which other load on a shared machine does not
change. Ratios are against the 2-thread `encode_batch` row of the same run.
"""

from __future__ import annotations

import os

# The `tokenizers` thread pool is sized once, at its first use: 2 threads, as the goal states.
os.environ.setdefault("RAYON_NUM_THREADS", "2")

import argparse  # noqa: E402
import json  # noqa: E402
import resource  # noqa: E402
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


def cpu_seconds() -> float:
    """CPU time of this process (all threads) and of its finished child processes."""
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + children.ru_utime + children.ru_stime


def time_encode_batch(
    tokenizer_path: Path, texts: list[str], threads: int
) -> tuple[float, float, int]:
    """Wall seconds, CPU seconds and tokens of one `encode_batch` over ``texts``."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_path))
    tok.encode_special_tokens = True  # as nanotrain encodes: text is text
    os.environ["TOKENIZERS_PARALLELISM"] = "true" if threads > 1 else "false"
    start, cpu = time.perf_counter(), cpu_seconds()
    encodings = tok.encode_batch(texts, add_special_tokens=False)
    seconds, cpu = time.perf_counter() - start, cpu_seconds() - cpu
    return seconds, cpu, sum(len(e.ids) for e in encodings)


def time_prepare(
    corpus: Path, tokenizer: Path, out: Path, workers: int
) -> tuple[float, float, int]:
    """Wall seconds, CPU seconds (workers included) and text tokens of one `prepare`."""
    start, cpu = time.perf_counter(), cpu_seconds()
    prepare([str(corpus)], out, tokenizer=str(tokenizer), num_workers=workers, progress=False)
    seconds, cpu = time.perf_counter() - start, cpu_seconds() - cpu
    meta = read_metadata(out)
    tokens = meta["total_tokens"] - meta["num_documents"]  # EOS are not text
    shutil.rmtree(out)
    return seconds, cpu, tokens


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
        runs: dict[str, list[tuple[float, float, int]]] = {name: [] for name in rows}
        for _ in range(args.repeats):
            for name, (kind, count) in rows.items():
                if kind == "lib":
                    result = time_encode_batch(tokenizer, texts, count)
                else:
                    result = time_prepare(corpus, tokenizer, folder / "out", count)
                runs[name].append(result)
    # each row's median run by wall time
    best = {name: sorted(results)[len(results) // 2] for name, results in runs.items()}
    size = corpus.stat().st_size if corpus.exists() else sum(len(t.encode()) for t in texts)
    reference = best["tokenizers encode_batch, 2 threads"]
    print(f"corpus: {len(texts)} documents, {size / 1e6:.1f} MB; vocab {args.vocab}; {cores} CPUs")
    print(
        "| row | seconds | CPU s | tokens | tokens/s | tokens/s vs encode_batch 2 threads "
        "| tokens per CPU-s vs encode_batch 2 threads |"
    )
    print("|---|---|---|---|---|---|---|")
    ref_rate, ref_cpu_rate = reference[2] / reference[0], reference[2] / reference[1]
    for name, (seconds, cpu, tokens) in best.items():
        rate, cpu_rate = tokens / seconds, tokens / cpu
        print(
            f"| {name} | {seconds:.2f} | {cpu:.2f} | {tokens:,} | {rate:,.0f} | "
            f"{rate / ref_rate:.2f}x | {cpu_rate / ref_cpu_rate:.2f}x |"
        )


if __name__ == "__main__":
    main()
