"""Step time and peak memory per precision (nanotrain.precision), side by side in one run.

Run (CPU, a few minutes on 2 cores with the defaults):

    python benchmarks/precision.py --preset dense-100m --seq 128 --steps 3

Each precision trains in its own forked process (so peak RSS is that run's): one warm-up step,
then ``--steps`` timed optimizer steps of the preset (micro batch 1, AdamW) with
`SingleDeviceStrategy`. Printed per precision: the median step time, its ratio to 32-true,
and peak memory (CPU: max resident set size of the process; CUDA: torch's max allocated).
On CPU this measures emulation overhead (fp8/fp4 quantize-dequantize) and autocast cost, not
low-precision speed: CPUs have no fp8 units. On a GPU add "transformer-engine" to
``--precisions`` (and MFU is printed from the peak of the precision in use). Timings on a busy
machine are noisy: compare ratios within one run.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import resource
import statistics
import time
from typing import Any

import torch

import nanotrain as nt
from nanotrain.callbacks.flops import device_peak_flops
from nanotrain.precision import resolve_precision

DEFAULT = ("32-true", "bf16-mixed", "bf16-true", "16-mixed", "fp8-emulated", "fp4-emulated")


class Timer(nt.Callback):
    def __init__(self) -> None:
        self.times: list[float] = []
        self._t = 0.0

    def on_train_step_start(self, trainer, module, batch, batch_idx) -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self._t = time.perf_counter()

    def on_train_step_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.times.append(time.perf_counter() - self._t)


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int, seq: int, vocab: int) -> None:
        self.ids = torch.randint(0, vocab, (n, seq + 1), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i, :-1], "labels": self.ids[i, 1:]}


def run_one(name: str, args: Any, conn: Any) -> None:
    torch.set_num_threads(args.threads)
    timer = Timer()
    module = nt.LanguageModelModule(args.preset, vocab_size=args.vocab)
    trainer = nt.Trainer(
        precision=resolve_precision(name),
        max_steps=args.steps + 1,
        micro_batch_size=1,
        callbacks=[timer],
        default_root_dir="/tmp/nanotrain-bench-precision",
        loggers=[],
    )
    trainer.fit(module, train_dataloaders=Tokens(args.steps + 1, args.seq, args.vocab))
    step = statistics.median(timer.times[1:])
    if torch.cuda.is_available():
        peak = torch.cuda.max_memory_allocated() / 2**20
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB -> MiB
    mfu = None
    device = trainer.strategy.root_device
    peak_flops = device_peak_flops(device, trainer.strategy.precision.peak_precision())
    if peak_flops:
        mfu = module.flops_per_token() * args.seq / step / peak_flops
    conn.send((step, peak, mfu))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--preset", default="dense-100m")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--precisions", nargs="+", default=list(DEFAULT))
    args = p.parse_args()
    ctx = mp.get_context("fork")
    print(f"preset {args.preset}, seq {args.seq}, micro batch 1, {args.steps} timed steps")
    print("| precision | step time (s) | vs first | peak memory (MiB) | MFU |")
    print("|---|---|---|---|---|", flush=True)
    base = None
    for name in args.precisions:
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=run_one, args=(name, args, child))
        proc.start()
        step, peak, mfu = parent.recv()
        proc.join()
        base = base or step
        mfu_s = "-" if mfu is None else f"{100 * mfu:.1f}%"
        print(f"| {name} | {step:.3f} | {step / base:.2f}x | {peak:.0f} | {mfu_s} |", flush=True)


if __name__ == "__main__":
    main()
