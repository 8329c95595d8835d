"""Memory of loading a pretrained folder under tp=2, and of exporting a sharded checkpoint.

Run (about a minute on 2 CPU cores with the defaults; `--preset tiny` for a smoke run):

    PYTHONPATH=. python benchmarks/pretrained_memory.py [--preset deepseek-100m]

1. The preset's (randomly initialized, fp32) weights are written as a nanotrain weights folder
   and as a transformers folder (one tensor per expert). A forked gloo world of 2 ranks builds
   the model under tp=2 (nanotrain folder) and under ep=2 (transformers folder) and loads the
   folder into it, once eagerly (every tensor read, then sliced: the former behaviour) and once
   lazily (`model_io.open_pretrained`: each rank reads only its slices). Per rank: the elements
   requested from the files, and the peaks of the process's anonymous memory (RssAnon) and of
   its resident set (VmRSS, which adds the touched pages of the memory-mapped files), sampled
   every millisecond, above what it held before the load.
2. The world trains one step under tp=2 and saves a sharded checkpoint; `nanotrain export --to
   nanotrain` then runs in a forked process, once as before (merge everything, then
   `save_file`) and once streaming (`export_checkpoint`), with the same peak measurement.

safetensors hands out tensors backed by its memory map where it can, so a whole-tensor read
shows in VmRSS (page cache, shared between ranks on one host) rather than in RssAnon.
Timings and memory on a shared machine are noisy; compare the rows of one run.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

import nanotrain as nt
from nanotrain.callbacks.checkpoint import ModelCheckpoint
from nanotrain.interop import hf_io
from nanotrain.interop import weights as model_io
from nanotrain.models import build_model, lazy, presets
from nanotrain.models.sharding import load_full_state_dict
from nanotrain.parallel.mesh import ParallelMesh
from tests.distributed.spawn import run_world  # the forked gloo world of the test suite
from tests.unit.test_language_model import RandomTokens

MB = 2**20


def _rss() -> tuple[int, int]:
    """(RssAnon, VmRSS) of this process in bytes; VmRSS adds mapped file pages."""
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("RssAnon", "VmRSS"):
            fields[key] = int(value.split()[0]) * 1024
    return fields["RssAnon"], fields["VmRSS"]


class Peak:
    """Samples RssAnon and VmRSS every millisecond in a thread; `.anon` and `.rss` are the
    peaks above the values at start."""

    def __enter__(self) -> Peak:
        self.start, self.top, self._stop = _rss(), (0, 0), threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.is_set():
            now = _rss()
            self.top = (max(self.top[0], now[0]), max(self.top[1], now[1]))
            time.sleep(0.001)

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        self._sample_once()
        self.anon = self.top[0] - self.start[0]
        self.rss = self.top[1] - self.start[1]

    def _sample_once(self) -> None:
        now = _rss()
        self.top = (max(self.top[0], now[0]), max(self.top[1], now[1]))


def _load(rank: int, world_size: int, folder: str, mode: str, sizes: dict) -> dict[str, float]:
    mesh = ParallelMesh.build(**sizes)
    config, state = model_io.open_pretrained(folder)
    model = build_model(config, mesh=mesh)
    read = {"n": 0}
    real_slice = lazy.FileTensor._read

    def counted(self: Any, box: Any) -> torch.Tensor:
        out = real_slice(self, box)
        read["n"] += out.numel()
        return out

    lazy.FileTensor._read = counted
    start = time.perf_counter()
    with Peak() as peak:
        if mode == "eager":  # everything read first, as before
            state = model_io.load_pretrained(folder)[1]
        load_full_state_dict(model, state)
    seconds = time.perf_counter() - start
    lazy.FileTensor._read = real_slice
    return {"read": read["n"] * 4 / MB, "anon": peak.anon / MB, "rss": peak.rss / MB, "s": seconds}


def _train_and_save(rank: int, world_size: int, preset: str, root: str) -> str:
    saver = ModelCheckpoint()
    trainer = nt.Trainer(
        strategy=nt.MegatronStrategy(tp=2),
        max_steps=1,
        global_batch_size=2,
        micro_batch_size=2,
        default_root_dir=root,
        loggers=[],
        callbacks=[saver],
    )
    vocab = presets.get(preset).vocab_size
    module = nt.LanguageModelModule(model=preset, warmup_steps=1)
    trainer.fit(module, train_dataloaders=RandomTokens(2, vocab))
    return saver.last_model_path


def _export(ckpt: str, out: str, mode: str, conn: Any) -> None:
    torch.set_num_threads(1)
    start = time.perf_counter()
    with Peak() as peak:
        if mode == "eager":  # the former export: merge everything, then save_file
            config, weights = model_io.checkpoint_model(ckpt)
            Path(out).mkdir(parents=True)
            tensors = {k: v.contiguous().clone() for k, v in weights.items()}
            save_file(tensors, f"{out}/model.safetensors", metadata={"format": "pt"})
            del tensors, weights
        else:
            model_io.export_checkpoint(ckpt, out, to="nanotrain")
    conn.send({"anon": peak.anon / MB, "rss": peak.rss / MB, "s": time.perf_counter() - start})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="deepseek-100m")
    args = parser.parse_args()
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        model = build_model(presets.get(args.preset))
        total = sum(t.numel() for t in model.state_dict().values())
        folders = {
            "nanotrain folder, tp=2": (
                model_io.save_weights(model.config, model.state_dict(), f"{tmp}/weights"),
                dict(tp=2),
            ),
            "HF folder, ep=2": (
                hf_io.export_hf(model, model.config, f"{tmp}/hf"),
                dict(ep=2),
            ),
        }
        del model
        print(f"{args.preset}: {total * 4 / MB:.0f} MB of fp32 weights")
        print(
            "load                  rank  read from files  peak above start: RssAnon  VmRSS  seconds"
        )
        for what, (folder, sizes) in folders.items():
            for mode in ("eager", "lazy"):
                world = run_world(_load, 2, str(folder), mode, sizes, timeout=600)
                for rank, r in enumerate(world):
                    print(
                        f"  {what + ' ' + mode:<30}{rank:>1}  {r['read']:>10.0f} MB"
                        f"  {r['anon']:>21.0f} MB  {r['rss']:>5.0f} MB  {r['s']:>7.2f}"
                    )
        ckpt = run_world(_train_and_save, 2, args.preset, f"{tmp}/run", timeout=600)[0]
        print("export of the tp=2 checkpoint  peak above start: RssAnon  VmRSS  seconds")
        ctx = mp.get_context("fork")
        for mode in ("eager", "streaming"):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_export, args=(ckpt, f"{tmp}/out-{mode}", mode, child))
            proc.start()
            r = parent.recv()
            proc.join()
            print(f"  {mode:<28}{r['anon']:>17.0f} MB  {r['rss']:>5.0f} MB  {r['s']:>7.2f}")
        same = (
            Path(f"{tmp}/out-eager/model.safetensors").read_bytes()
            == Path(f"{tmp}/out-streaming/model.safetensors").read_bytes()
        )
        print(f"exported files byte-identical: {same}")


if __name__ == "__main__":
    main()
