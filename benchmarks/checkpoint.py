"""Checkpoint save and load: time and bytes per rank under a few layouts, and resharding.

Run (a few minutes on 2 CPU cores with the defaults; `--preset tiny` for a smoke run):

    python benchmarks/checkpoint.py [--preset deepseek-100m]

For each layout a forked gloo world (CPU, one thread per rank) trains the preset for one step
(so that Adam's moments exist), then times `trainer.save_checkpoint` (the slowest rank's wall
time, the collective commit included) and a resume of that checkpoint under the same layout,
and under one process (resharding: the whole tensors are rebuilt from the shards). Bytes per
rank are the sizes of the files each rank wrote (meta.json's sizes): the model and optimizer
shards plus the per-rank state; rank 0 also writes trainer_state.pt.

Then (one process) the time the training loop is blocked by one save, synchronous vs
`ModelCheckpoint(async_save=True)` (blocked only while the state is copied to host memory),
measured side by side in the same run.

Timings on a shared 2-core machine are noisy: compare the rows of one run, not runs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import pickle
import shutil
import socket
import tempfile
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import Dataset

import nanotrain as nt
import nanotrain.checkpoint as ckpt_pkg
from nanotrain.callbacks.checkpoint import ModelCheckpoint

SEQ = 32
LAYOUTS = {
    "1 process": None,
    "tp=2": dict(tp=2),
    "dp=2 ZeRO-1": dict(zero_stage=1),
    "ep=2 x dp=2 ZeRO-2 (4 ranks)": dict(ep=2, zero_stage=2),
}


class Tokens(Dataset):
    def __init__(self, n: int, vocab: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.tokens = torch.randint(0, vocab, (n, SEQ + 1), generator=g)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.tokens[i, :-1], "labels": self.tokens[i, 1:]}


def _trainer(root: str, layout: dict | None, world: int) -> nt.Trainer:
    strategy = nt.SingleDeviceStrategy("cpu") if layout is None else nt.MegatronStrategy(**layout)
    return nt.Trainer(
        strategy=strategy,
        max_steps=1,
        micro_batch_size=1,
        global_batch_size=4,  # the same in every layout, so that any can resume any
        default_root_dir=root,
        loggers=[],
        callbacks=[],
        preemption_signals=[],
    )


def _measure(rank: int, world: int, preset: str, root: str, layout: dict | None) -> dict:
    """Train one step, save, resume under the same layout; return times and bytes."""
    module = nt.LanguageModelModule(model=preset, vocab_size=257, warmup_steps=1)
    trainer = _trainer(root, layout, world)
    saver = _SaveAtEnd(Path(root) / "ckpt")
    trainer.callbacks.append(saver)
    trainer.fit(module, train_dataloaders=Tokens(64, 257))
    path, save_s = saver.path, saver.seconds
    with _timed_loads() as times:
        resumed = _trainer(root + "-resumed", layout, world)  # max_steps=1: loads, then stops
        module = nt.LanguageModelModule(model=preset, vocab_size=257)
        resumed.fit(module, train_dataloaders=Tokens(64, 257), ckpt_path=str(path))
    meta = json.loads((path / "meta.json").read_text())
    mine = [n for n in meta["files"] if f"{rank:05d}" in n]
    if rank == 0:
        mine += [
            n
            for n in meta["files"]
            if n in ("trainer_state.pt", "model.safetensors", "optimizer.pt")
        ]
    written = sum(meta["files"][n] for n in mine)
    return {"save_s": save_s, "load_s": times[0] if times else float("nan"), "bytes": written}


class _SaveAtEnd(nt.Callback):
    """Times one `trainer.save_checkpoint` when training ends (inside fit: the strategy's
    sharded optimizer still exists)."""

    def __init__(self, path: Path) -> None:
        self.path, self.seconds = path, float("nan")

    def on_train_end(self, trainer: nt.Trainer, module: Any) -> None:
        _barrier()
        start = time.perf_counter()
        trainer.save_checkpoint(self.path)
        self.seconds = time.perf_counter() - start


class _BlockedTimer(ModelCheckpoint):
    """Records how long each save kept the training loop waiting."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.blocked: list[float] = []

    def save_now(self, trainer: nt.Trainer, tag: str | None = None) -> Path:
        start = time.perf_counter()
        try:
            return super().save_now(trainer, tag)
        finally:
            self.blocked.append(time.perf_counter() - start)


def blocked_seconds(preset: str, root: str, async_save: bool) -> float:
    """Seconds the loop waited for the first of two saves (one process)."""
    torch.set_num_threads(1)
    timer = _BlockedTimer(every_n_steps=1, async_save=async_save, save_last=False)
    trainer = _trainer(root, None, 1)
    trainer.settings.max_steps = 2
    trainer.callbacks.append(timer)
    module = nt.LanguageModelModule(model=preset, vocab_size=257)
    trainer.fit(module, train_dataloaders=Tokens(64, 257))
    return timer.blocked[0]


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(fn: Any, rank: int, world: int, port: int, conn: Any, args: tuple) -> None:
    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
            timeout=timedelta(seconds=600),
        )  # fmt: skip
        conn.send_bytes(pickle.dumps(("ok", fn(rank, world, *args))))
    except BaseException as exc:  # noqa: BLE001 - reported by the parent
        conn.send_bytes(pickle.dumps(("error", repr(exc))))


def run_world(fn: Any, world: int, *args: Any) -> list[Any]:
    """`fn(rank, world, *args)` on a forked gloo world; the results by rank."""
    if world == 1:
        torch.set_num_threads(1)
        return [fn(0, 1, *args)]
    ctx, port = mp.get_context("fork"), _free_port()
    pipes = [ctx.Pipe(duplex=False) for _ in range(world)]
    procs = [
        ctx.Process(target=_rank_main, args=(fn, r, world, port, pipes[r][1], args))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    results = [pickle.loads(reader.recv_bytes()) for reader, _ in pipes]
    for p in procs:
        p.join()
    for status, value in results:
        if status != "ok":
            raise RuntimeError(value)
    return [value for _, value in results]


def _reshard_to_one(preset: str, ckpt: Path) -> float:
    """Seconds to resume `ckpt` on one process (resharded when it was saved sharded)."""
    torch.set_num_threads(1)
    with _timed_loads() as times:
        trainer = _trainer(str(ckpt) + "-one", None, 1)
        module = nt.LanguageModelModule(model=preset, vocab_size=257)
        trainer.fit(module, train_dataloaders=Tokens(64, 257), ckpt_path=str(ckpt))
    return times[0]


@contextlib.contextmanager
def _timed_loads() -> Iterator[list[float]]:
    """Record the seconds of every `load_checkpoint` call made inside the block."""
    times: list[float] = []
    original = ckpt_pkg.load_checkpoint

    def timed(trainer: Any, path: Path) -> Any:
        start = time.perf_counter()
        out = original(trainer, path)
        times.append(time.perf_counter() - start)
        return out

    ckpt_pkg.load_checkpoint = timed  # what Trainer._resume imports when it runs
    try:
        yield times
    finally:
        ckpt_pkg.load_checkpoint = original


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="deepseek-100m")
    parser.add_argument("--layouts", nargs="*", default=list(LAYOUTS))
    args = parser.parse_args()
    print(f"preset {args.preset}; CPU, gloo, 1 thread per rank; times are wall seconds")
    print(f"{'layout':32s} {'ranks':>5s} {'MB/rank (max)':>13s} {'save s':>7s} {'load s':>7s} "
          f"{'load on 1 process s':>20s}")  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.layouts:
            layout = LAYOUTS[name]
            world = 1 if layout is None else (4 if layout.get("ep", 1) > 1 else 2)
            root = f"{tmp}/{len(name)}"
            results = run_world(_measure, world, args.preset, root, layout)
            one = _reshard_to_one(args.preset, Path(root) / "ckpt")
            mb = max(r["bytes"] for r in results) / 2**20
            save = max(r["save_s"] for r in results)
            load = max(r["load_s"] for r in results)
            print(f"{name:32s} {world:5d} {mb:13.1f} {save:7.2f} {load:7.2f} {one:20.2f}")
            shutil.rmtree(root, ignore_errors=True)
        sync = blocked_seconds(args.preset, f"{tmp}/sync", async_save=False)
        asyn = blocked_seconds(args.preset, f"{tmp}/async", async_save=True)
        print(f"\nloop blocked by one save (1 process): synchronous {sync:.2f} s, "
              f"asynchronous {asyn:.2f} s ({sync / asyn:.1f}x less)")  # fmt: skip


if __name__ == "__main__":
    main()
