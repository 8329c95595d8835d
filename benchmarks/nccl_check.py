"""The NCCL path of every strategy that fits on one GPU, checked against one process.

    python benchmarks/nccl_check.py            # needs CUDA; about a minute
    python benchmarks/nccl_check.py --cpu      # the same checks on gloo (a dry run)

One GPU holds one NCCL rank (NCCL refuses two ranks on one device), so each strategy runs at
world size 1 on the NCCL backend: `DDPStrategy()` and `MegatronStrategy()` with ZeRO 0, 1 and 2
join a real NCCL process group (and `MegatronStrategy()` runs once more in one process with no
group, where it must still pick the GPU), wrap the model, reduce gradients and metrics, and
save and load sharded checkpoints through NCCL collectives. Each fits the tiny DeepSeek model
4 steps in fp32 (TF32 off), which must give the losses and grad norms of
`SingleDeviceStrategy("cuda")` (rtol 1e-5: one rank sums the same microbatches in the same
order), then fits 2 steps, saves, and resumes to step 4, which must repeat the straight run's
last two losses exactly. A bf16-mixed fit under Megatron with ZeRO-2 must stay within 2% of
the fp32 losses, and `DDPStrategy()` in bf16-true (fp32 main grads in buckets; one rank sends
nothing, so this runs the bucket hooks on CUDA, not the NCCL reduction) must give
`SingleDeviceStrategy`'s bf16-true losses. Prints one table row per run (with the device it
trained on) and exits 1 on any mismatch or a run off the GPU. Without CUDA it prints that it
skipped and exits 0.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import sys
import tempfile
from collections.abc import Iterator

import torch

import nanotrain as nt
from nanotrain.callbacks.checkpoint import ModelCheckpoint

STEPS = 4
VOCAB = 256


class Tokens(torch.utils.data.Dataset):
    """64 fixed random sequences of 64 tokens (+1 for the labels)."""

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> dict:
        ids = torch.randint(0, VOCAB, (65,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids[:-1], "labels": ids[1:]}


class StepNumbers(nt.Callback):
    """Each step's global loss and grad norm, by step; the device and process-group backend."""

    def __init__(self) -> None:
        self.losses: dict[int, float] = {}
        self.grad_norms: dict[int, float] = {}
        self.backend, self.device = "no process group", "?"

    def on_train_start(self, trainer, module) -> None:
        self.device = str(trainer.strategy.root_device)
        if torch.distributed.is_initialized():
            self.backend = torch.distributed.get_backend()

    def on_train_step_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        self.losses[trainer.global_step] = float(outputs.loss)
        self.grad_norms[trainer.global_step] = float(outputs.grad_norm)


@contextlib.contextmanager
def one_rank_world(backend: str | None = None) -> Iterator[None]:
    """The environment of a one-rank world on a fresh port (each fit owns its world) and,
    with `backend`, a one-rank process group of it for the duration: a MegatronStrategy joins
    an existing group, but makes none in one process (a DDPStrategy makes its own)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    world = dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
    world["MASTER_PORT"] = str(port)
    saved = {name: os.environ.get(name) for name in world}
    os.environ.update(world)
    try:
        if backend is not None:
            torch.distributed.init_process_group(backend, rank=0, world_size=1)
        try:
            yield
        finally:
            if backend is not None:
                torch.distributed.destroy_process_group()
    finally:  # the caller's environment back
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def fit(strategy, root: str, max_steps: int, precision: str = "32", ckpt_path=None, group=None):
    """Fit the tiny DeepSeek model under `strategy` in a one-rank world (with a process group
    of backend `group` when given); returns its StepNumbers."""
    with one_rank_world(group):
        return _fit(strategy, root, max_steps, precision, ckpt_path)


def _fit(strategy, root: str, max_steps: int, precision: str, ckpt_path) -> StepNumbers:
    numbers = StepNumbers()
    trainer = nt.Trainer(
        strategy=strategy,
        precision=precision,
        max_steps=max_steps,
        global_batch_size=8,
        micro_batch_size=4,
        gradient_clip_val=1.0,
        default_root_dir=root,
        loggers=[],
        seed=5,
        callbacks=[numbers, ModelCheckpoint(every_n_steps=2)],
    )
    # decay_steps fixed: the schedule must not depend on max_steps (the resumed run's is 4)
    module = nt.LanguageModelModule(model="tiny", vocab_size=VOCAB, warmup_steps=1, decay_steps=8)
    trainer.fit(module, train_dataloaders=Tokens(), ckpt_path=ckpt_path)
    return numbers


def _close(a: list[float], b: list[float], rtol: float) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= rtol * abs(y) for x, y in zip(a, b, strict=True))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu", action="store_true", help="the same checks on gloo (a dry run)")
    device = "cpu" if parser.parse_args(argv).cpu else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: nothing checked (skipped)")
        return 0
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    backend = "nccl" if device == "cuda" else "gloo"
    layouts = {  # name -> (strategy factory, the group to make for it)
        "DDPStrategy()": (nt.DDPStrategy, None),  # makes its own group
        "MegatronStrategy(), no group": (nt.MegatronStrategy, None),  # one process, no group
        "MegatronStrategy()": (nt.MegatronStrategy, backend),
        "MegatronStrategy(zero_stage=1)": (lambda: nt.MegatronStrategy(zero_stage=1), backend),
        "MegatronStrategy(zero_stage=2)": (lambda: nt.MegatronStrategy(zero_stage=2), backend),
    }
    ok = True
    with tempfile.TemporaryDirectory() as root:
        ref = fit(nt.SingleDeviceStrategy(device), f"{root}/single", STEPS)
        ref_losses = [ref.losses[s] for s in sorted(ref.losses)]
        ref_norms = [ref.grad_norms[s] for s in sorted(ref.grad_norms)]
        print(
            f"{'SingleDeviceStrategy(' + device + ')':34s} losses {[f'{x:.6f}' for x in ref_losses]}"
        )
        for i, (name, (make, group)) in enumerate(layouts.items()):
            straight = fit(make(), f"{root}/{i}/straight", STEPS, group=group)
            fit(make(), f"{root}/{i}/split", 2, group=group)
            resumed = fit(make(), f"{root}/{i}/split", STEPS, ckpt_path="last", group=group)
            losses = [straight.losses[s] for s in sorted(straight.losses)]
            norms = [straight.grad_norms[s] for s in sorted(straight.grad_norms)]
            same = _close(losses, ref_losses, 1e-5) and _close(norms, ref_norms, 1e-5)
            tail = [resumed.losses[s] for s in sorted(resumed.losses)]
            exact = tail == losses[2:]
            placed = straight.device.startswith(device)  # the GPU on a GPU machine
            ok = ok and same and exact and placed
            worst = max(
                abs(x - y) / abs(y)
                for x, y in zip(losses + norms, ref_losses + ref_norms, strict=True)
            )
            print(
                f"{name:34s} {straight.device}, backend={straight.backend} "
                f"matches single: {same} (max rel diff {worst:.1e}); resume exact: {exact}"
            )
        mixed = fit(
            nt.MegatronStrategy(zero_stage=2), f"{root}/bf16", STEPS, "bf16-mixed", group=backend
        )
        losses = [mixed.losses[s] for s in sorted(mixed.losses)]
        good = _close(losses, ref_losses, 2e-2)  # bf16 matmuls: within 2% of fp32
        ok = ok and good
        print(f"{'Megatron zero2 bf16-mixed':34s} losses {[f'{x:.4f}' for x in losses]}: {good}")
        # bf16-true: DDP's fp32 main grads in buckets reduced from backward's hooks (one rank:
        # nothing to sum) must give what one process's fp32 main grads give
        single = fit(nt.SingleDeviceStrategy(device), f"{root}/bf16t1", STEPS, "bf16-true")
        ddp = fit(nt.DDPStrategy(), f"{root}/bf16t2", STEPS, "bf16-true")
        expected, losses = ([r.losses[s] for s in sorted(r.losses)] for r in (single, ddp))
        good = _close(losses, expected, 1e-5) and ddp.device.startswith(device)
        ok = ok and good
        print(f"{'DDPStrategy() bf16-true':34s} {ddp.device}, matches single bf16-true: {good}")
    print("NCCL check " + ("passed" if ok else "FAILED"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
