"""The tiny DeepSeek-V3-style model under MegatronStrategy: tensor, pipeline, expert and data
parallelism with a ZeRO-sharded optimizer, set up from Python and launched with torchrun.

    torchrun --nproc-per-node 8 examples/megatron_4d.py --tp 2 --pp 2 --ep 2 --zero_stage 1
    torchrun --nproc-per-node 4 examples/megatron_4d.py --tp 1 --pp 2 --ep 2 --zero_stage 1

The data-parallel size is what is left: world / (tp × pp); ep splits the routed experts over
ranks carved out of it, so ep must divide it. Trains on the built-in demo corpus (no download)
and writes runs/megatron_4d/version_N/ with the run report (report.md).
"""

from __future__ import annotations

import argparse
import os

import torch

import nanotrain as nt
from nanotrain.callbacks import LearningRateMonitor, ModelCheckpoint, RunReport, ThroughputMonitor


def main(argv: list[str] | None = None) -> nt.Trainer:
    parser = argparse.ArgumentParser(description="DeepSeek tiny under MegatronStrategy")
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel size")
    parser.add_argument("--pp", type=int, default=2, help="pipeline stages")
    parser.add_argument("--ep", type=int, default=2, help="expert-parallel size")
    parser.add_argument("--zero_stage", type=int, default=1, help="0, 1 or 2")
    parser.add_argument("--max_steps", type=int, default=100)
    parser.add_argument("--global_batch_size", type=int, default=16)
    parser.add_argument("--micro_batch_size", type=int, default=2)
    parser.add_argument("--seq_len", type=int, default=128)
    parser.add_argument("--demo_max_bytes", type=int, default=2_000_000)
    parser.add_argument("--root", default="runs", help="where run directories go")
    args = parser.parse_args(argv)

    if not torch.cuda.is_available():
        # Several CPU ranks on one machine must share its cores, not each take all of them.
        ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // ranks_here))

    strategy = nt.MegatronStrategy(
        tp=args.tp,
        pp=args.pp,
        ep=args.ep,
        zero_stage=args.zero_stage,
        sequence_parallel=args.tp > 1,  # shard norms/residuals along the sequence over tp
    )
    trainer = nt.Trainer(
        strategy=strategy,
        max_steps=args.max_steps,
        global_batch_size=args.global_batch_size,
        micro_batch_size=args.micro_batch_size,
        gradient_clip_val=1.0,
        val_check_interval=max(1, args.max_steps // 2),
        limit_val_batches=4,
        log_every_n_steps=max(1, min(10, args.max_steps)),
        default_root_dir=args.root,
        name="megatron_4d",
        callbacks=[
            ModelCheckpoint(save_last=True),
            LearningRateMonitor(),
            ThroughputMonitor(),
            RunReport(),
        ],
    )
    model = nt.LanguageModelModule(model="tiny", lr=3e-3, warmup_steps=max(1, args.max_steps // 10))
    data = nt.data.TokenDataModule(seq_len=args.seq_len, demo_max_bytes=args.demo_max_bytes)
    trainer.fit(model, data)
    if trainer.is_global_zero:
        print(f"done: {trainer.global_step} steps, report in {trainer.run_dir}/report.md")
    return trainer


if __name__ == "__main__":
    main()
