"""Per-step overhead of the nanotrain Trainer vs a plain PyTorch loop vs lightning.Trainer.

The same NanoModule (an MLP regressor on synthetic data), the same batch size, optimizer and
number of steps run three ways in one process, interleaved over several rounds; the median
time per step after a warm-up is compared (every other round runs the runners in reverse
order). Run:

    python benchmarks/overhead.py --steps 500 --rounds 5
    python benchmarks/overhead.py --device cuda --width 256      # the same on one GPU
    python benchmarks/overhead.py --device cuda --sync-check     # host syncs while logging
    python benchmarks/overhead.py --count-host-work              # ops and Python calls per step
    python benchmarks/overhead.py --device cuda --host-profile   # where the host time goes

Each run's figure is its median step-to-step time after the warm-up. Prints a table with
each runner's median over rounds, its ratio to the plain loop's, and the median of the
per-round ratios ("paired": each round's runners run back to back) and the ratio of the
fastest rounds ("best": on a shared box, the cost without interference). The "+log" runners
(the module logs a tensor, a dict and a MeanMetric every step, the default loggers write
every 50 steps) are set against "plain loop+log", which does the same work by hand.

`--count-host-work` counts, for each runner, the ATen ops it dispatches and the Python
functions it calls per step (steps 20-59, leaving out the steps that write the loggers): what
each step asks of the host, the same on every run, where a shared box's timings are not.

`--host-profile` profiles "plain loop+log" and "nanotrain+log" over the same steps and prints
where each spends host time per step, and where nanotrain+log spends more: its Python
functions by own time (cProfile) and its ops and CUDA runtime calls by self CPU time
(torch.profiler: kernel launches, waits in synchronizing calls).

`--device cuda` runs every runner on one GPU (batches copied per step; each run's last step
waits for the GPU). `--sync-check` fits the logging module with the default callbacks on the
GPU and counts the host-device syncs (`torch.cuda.set_sync_debug_mode("warn")`) in every step
from the 6th on, apart for the steps that write the loggers and the others.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import pstats
import statistics
import tempfile
import time

import lightning.pytorch as pl
import torch
import torchmetrics
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.tensorboard import SummaryWriter

import nanotrain as nt


class Regressor(nt.NanoModule):
    """A 4-layer MLP with MSE loss: enough compute per step to be a realistic small model.
    With `log_every_step` its training_step logs as tutorials do, every step: a tensor
    (`self.log`, also to the progress bar), a dict (`self.log_dict`) and a torchmetrics
    `MeanMetric` (reduced at the epoch's end)."""

    def __init__(self, width: int = 512, depth: int = 4, lr: float = 1e-3,
                 log_every_step: bool = False) -> None:  # fmt: skip
        super().__init__()
        self.save_hyperparameters()
        layers: list[nn.Module] = []
        for _ in range(depth):
            layers += [nn.Linear(width, width), nn.GELU()]
        self.net = nn.Sequential(*layers, nn.Linear(width, 1))
        self.mean_loss = torchmetrics.MeanMetric()

    def training_step(self, batch, batch_idx):
        x, y = batch
        pred = self.net(x).squeeze(-1)
        loss = nn.functional.mse_loss(pred, y)
        if self.hparams.log_every_step:
            self.log("train_loss", loss, prog_bar=True)
            self.log_dict({"pred_mean": pred.mean(), "target_mean": y.mean()})
            self.mean_loss(loss)
            self.log("mean_loss", self.mean_loss, on_step=False, on_epoch=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)


def make_data(num_samples: int, width: int) -> TensorDataset:
    """Random inputs [N, width] and targets [N] from a fixed seed."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(num_samples, width, generator=g)
    return TensorDataset(x, x[:, :8].sum(-1))


class _StepClock:
    """Timestamps the start of every step from `warmup` on and the end of training (shared by
    all runners); a run's figure is the median step-to-step time, so a moment when another
    process takes the core costs the steps it hit, not the run."""

    def __init__(self, warmup: int) -> None:
        self.warmup, self.stamps = warmup, []

    def at_batch_start(self, batch_idx: int) -> None:
        if batch_idx >= self.warmup:
            self.stamps.append(time.perf_counter())

    def at_train_end(self) -> None:
        self.stamps.append(time.perf_counter())

    def ms_per_step(self, steps: int) -> float:
        assert len(self.stamps) == steps - self.warmup + 1, "one stamp per timed step + end"
        return 1e3 * statistics.median(
            b - a for a, b in zip(self.stamps, self.stamps[1:], strict=False)
        )


def run_plain(
    data: TensorDataset, batch: int, steps: int, warmup: int, width: int, log: bool = False,
    device: str = "cpu",
) -> float:  # fmt: skip
    """A hand-written loop: next batch, forward, backward, clip, step, zero_grad. `log`: it
    also does by hand what the logging module asks of a Trainer: the same values kept as
    tensors every step, the MeanMetric updated, and all written to TensorBoard (read on the
    host) every 50 steps."""
    torch.manual_seed(0)
    module = Regressor(width).to(device)
    opt = module.configure_optimizers()
    loader = DataLoader(data, batch_size=batch, shuffle=True, drop_last=True)
    clock, step = _StepClock(warmup), 0
    with tempfile.TemporaryDirectory() as root:
        writer = SummaryWriter(root) if log else None
        while step < steps:
            for x, y in loader:
                clock.at_batch_start(step)
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                if writer is None:
                    loss = module.training_step((x, y), step)
                else:
                    pred = module.net(x).squeeze(-1)
                    loss = nn.functional.mse_loss(pred, y)
                    values = {"train_loss": loss.detach(), "pred_mean": pred.detach().mean(),
                              "target_mean": y.mean()}  # fmt: skip
                    module.mean_loss(loss.detach())  # forward, as the module calls it
                    if (step + 1) % 50 == 0:
                        for name, value in values.items():
                            writer.add_scalar(name, value.item(), step)
                _plain_update(module, opt, loss)
                step += 1
                if step == steps:
                    break
        if writer is not None:
            writer.add_scalar("mean_loss", module.mean_loss.compute().item(), step)
            writer.close()
    _wait_for(device)
    clock.at_train_end()
    return clock.ms_per_step(steps)


def _wait_for(device: str) -> None:
    """On a GPU, the last step ends when the GPU has done its work."""
    if device != "cpu":
        torch.cuda.synchronize()


def _plain_update(module: nn.Module, opt: torch.optim.Optimizer, loss: torch.Tensor) -> None:
    """backward, clip, step, zero_grad."""
    loss.backward()
    torch.nn.utils.clip_grad_norm_(module.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)


def run_nanotrain(
    data: TensorDataset, batch: int, steps: int, warmup: int, width: int, defaults: bool = False,
    log: bool = False, device: str = "cpu",
) -> float:  # fmt: skip
    """The nanotrain Trainer, single device, no loggers; like the Lightning runner, without
    checkpointing, progress bar and monitors unless `defaults` (then the Trainer's default
    callbacks run: checkpoint every 100 steps, progress, NaN guard, LR/throughput/grad-norm
    monitors, run report). `log`: the module logs every step, and the Trainer's default
    loggers (TensorBoard, metrics.jsonl) write every 50 steps."""
    clock = _StepClock(warmup)

    class Clock(nt.Callback):
        def on_train_step_start(self, trainer, module, b, batch_idx):
            clock.at_batch_start(trainer.global_step)

        def on_train_end(self, trainer, module):
            _wait_for(device)
            clock.at_train_end()

    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as root:
        trainer = nt.Trainer(
            strategy=nt.SingleDeviceStrategy(device),
            max_steps=steps,
            global_batch_size=batch,
            micro_batch_size=batch,
            gradient_clip_val=1.0,
            callbacks=[Clock()],
            **({} if log else {"loggers": []}),
            default_root_dir=root,
            log_every_n_steps=50,
            enable_checkpointing=defaults,
            enable_progress_bar=defaults,
            enable_monitors=defaults,
        )
        trainer.fit(Regressor(width, log_every_step=log), train_dataloaders=data)
    return clock.ms_per_step(steps)


def run_lightning(
    data: TensorDataset, batch: int, steps: int, warmup: int, width: int, log: bool = False,
    device: str = "cpu",
) -> float:  # fmt: skip
    """lightning.Trainer on the same module, with its extras (logger, progress, ckpt) off;
    `log`: the module logs every step, to Lightning's default logger, every 50 steps."""
    clock = _StepClock(warmup)

    class Clock(pl.Callback):
        def on_train_batch_start(self, trainer, module, b, batch_idx):
            clock.at_batch_start(trainer.global_step)

        def on_train_end(self, trainer, module):
            _wait_for(device)
            clock.at_train_end()

    torch.manual_seed(0)
    loader = DataLoader(data, batch_size=batch, shuffle=True, drop_last=True)
    with tempfile.TemporaryDirectory() as root:
        trainer = pl.Trainer(
            max_steps=steps,
            accelerator="cpu" if device == "cpu" else "gpu",
            devices=1,
            logger=log,
            callbacks=[Clock()],
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            gradient_clip_val=1.0,
            default_root_dir=root,
            log_every_n_steps=50,
        )
        trainer.fit(Regressor(width, log_every_step=log), loader)
    return clock.ms_per_step(steps)


def run_nanotrain_defaults(*args, device: str = "cpu") -> float:
    """The nanotrain Trainer with its default callbacks (what a user gets unasked)."""
    return run_nanotrain(*args, defaults=True, device=device)


def run_nanotrain_logging(*args, device: str = "cpu") -> float:
    """The default callbacks and loggers, the module logging every step."""
    return run_nanotrain(*args, defaults=True, log=True, device=device)


def run_lightning_logging(*args, device: str = "cpu") -> float:
    """lightning.Trainer with its default logger, the module logging every step."""
    return run_lightning(*args, log=True, device=device)


def run_plain_logging(*args, device: str = "cpu") -> float:
    """The hand-written loop doing the logging module's work by hand."""
    return run_plain(*args, log=True, device=device)


def sync_check(data: TensorDataset, batch: int, width: int, steps: int = 120) -> None:
    """Fit the logging module on the GPU with the default callbacks and loggers (writing every
    50 steps) under sync debug mode "warn" from the 6th step on; print the syncs per step,
    apart for the steps that write the loggers and the others, with where the first came from."""
    import warnings

    from gpu import sync_site  # benchmarks/gpu.py, beside this script

    step, found = [-1], {}  # found: step -> [where]

    def record(message, category, filename, lineno, file=None, line=None):  # noqa: ANN001
        where = sync_site(message, filename, lineno)
        if where is not None:
            found.setdefault(step[0], []).append(where)

    class Watch(nt.Callback):
        def on_train_step_start(self, trainer, module, b, batch_idx):
            torch.cuda.set_sync_debug_mode("default")
            torch.cuda.synchronize()  # what is queued before the step is not its sync
            step[0] = trainer.global_step
            if step[0] >= 5:
                torch.cuda.set_sync_debug_mode("warn")

        def on_train_end(self, trainer, module):
            torch.cuda.set_sync_debug_mode("default")

    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as root, warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        trainer = nt.Trainer(
            strategy=nt.SingleDeviceStrategy("cuda"), max_steps=steps, global_batch_size=batch,
            micro_batch_size=batch, gradient_clip_val=1.0, callbacks=[Watch()],
            default_root_dir=root, log_every_n_steps=50,
        )  # fmt: skip
        try:
            trainer.fit(Regressor(width, log_every_step=True), train_dataloaders=data)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    writing = {s for s in range(5, steps) if (s + 1) % 50 == 0 or s == steps - 1}
    for kind, chosen in (("non-writing", set(range(5, steps)) - writing), ("writing", writing)):
        hits = {s: found[s] for s in sorted(chosen) if s in found}
        total = sum(len(v) for v in hits.values())
        print(f"sync check, {kind} steps ({len(chosen)}): {total} syncs in {len(hits)} steps")
        places = collections.Counter(w for where in hits.values() for w in where)
        for where, n in places.most_common():
            print(f"  {n}x at {where}")


class _OpCounter(TorchDispatchMode):
    """Counts the ATen ops dispatched while `on`."""

    def __init__(self) -> None:
        super().__init__()
        self.ops, self.on = 0, False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        self.ops += self.on
        return func(*args, **(kwargs or {}))


def _host_work(runner, data: TensorDataset, batch: int, width: int, device: str,
               counted: list[int]) -> tuple[float, float]:  # fmt: skip
    """(ATen ops, Python calls) per step of `runner` over the steps in `counted`, from two
    runs: the op counter's own Python code must not count as the runner's calls."""
    counter, profile = _OpCounter(), cProfile.Profile()
    real = _StepClock.at_batch_start

    def counting_ops(clock: _StepClock, step: int) -> None:
        counter.on = step in counted
        real(clock, step)

    def profiling(clock: _StepClock, step: int) -> None:
        # the profile covers exactly the counted steps (it is on from one start to the next)
        (profile.enable if step in counted else profile.disable)()
        real(clock, step)

    try:
        _StepClock.at_batch_start = counting_ops
        with counter:
            runner(data, batch, counted[-1] + 2, 10, width, device=device)
        _StepClock.at_batch_start = profiling
        runner(data, batch, counted[-1] + 2, 10, width, device=device)
    finally:
        _StepClock.at_batch_start = real
        profile.disable()
    calls = sum(stat[1] for stat in pstats.Stats(profile).stats.values())
    return counter.ops / len(counted), calls / len(counted)


def _host_time(runner, data: TensorDataset, batch: int, width: int, device: str,
               counted: list[int]) -> tuple[dict[str, float], dict[str, float]]:  # fmt: skip
    """Per step of `runner` over the steps in `counted`: (µs of own time per Python function,
    µs of self CPU time per op or CUDA runtime call), from two runs (each profiler's own
    work stays out of the other's figures)."""
    profile = cProfile.Profile()
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    ops = torch.profiler.profile(activities=activities)
    real = _StepClock.at_batch_start
    state = {"ops": False}

    def profiling_python(clock: _StepClock, step: int) -> None:
        (profile.enable if step in counted else profile.disable)()
        real(clock, step)

    def profiling_ops(clock: _StepClock, step: int) -> None:
        if step in counted and not state["ops"]:
            ops.start()
            state["ops"] = True
        elif step not in counted and state["ops"]:
            ops.stop()
            state["ops"] = False
        real(clock, step)

    try:
        _StepClock.at_batch_start = profiling_python
        runner(data, batch, counted[-1] + 2, 10, width, device=device)
        profile.disable()
        _StepClock.at_batch_start = profiling_ops
        runner(data, batch, counted[-1] + 2, 10, width, device=device)
    finally:
        _StepClock.at_batch_start = real
        profile.disable()
        if state["ops"]:
            ops.stop()
    n = len(counted)
    python = collections.Counter()
    for (filename, line, name), stat in pstats.Stats(profile).stats.items():
        where = filename.split("site-packages/")[-1].split("/work/main/")[-1]
        python[f"{name} ({where}:{line})"] += stat[2] * 1e6 / n  # tottime, µs per step
    by_op = collections.Counter()
    for event in ops.key_averages():
        by_op[event.key] += event.self_cpu_time_total / n
    return dict(python), dict(by_op)


def host_profile(data: TensorDataset, batch: int, width: int, device: str) -> None:
    """Print where "plain loop+log" and "nanotrain+log" spend host time per step (steps 20-59
    but the logger-writing one), and the largest differences."""
    counted = [s for s in range(20, 60) if (s + 1) % 50]
    runs = {
        name: _host_time(RUNNERS[name], data, batch, width, device, counted)
        for name in ("plain loop+log", "nanotrain+log")
    }
    for kind, index in (("Python functions, own time", 0), ("ops and CUDA calls, self CPU", 1)):
        plain, ours = runs["plain loop+log"][index], runs["nanotrain+log"][index]
        print(f"{kind} (µs per step): plain loop+log {sum(plain.values()):.0f}, "
              f"nanotrain+log {sum(ours.values()):.0f}")  # fmt: skip
        extra = {k: ours.get(k, 0.0) - plain.get(k, 0.0) for k in set(plain) | set(ours)}
        print("  most added by nanotrain+log:")
        for key, more in sorted(extra.items(), key=lambda kv: -kv[1])[:15]:
            print(f"    {more:+9.1f}  {key}")
        print("  most of nanotrain+log's:")
        for key, value in sorted(ours.items(), key=lambda kv: -kv[1])[:10]:
            print(f"    {value:9.1f}  {key}")


def count_host_work(data: TensorDataset, batch: int, width: int, device: str) -> None:
    """Print each runner's ATen ops and Python calls per step over steps [20, 60), leaving out
    the steps that write the loggers (every 50th), with ratios to its plain loop."""
    counted = [s for s in range(20, 60) if (s + 1) % 50]
    per_step = {
        name: _host_work(runner, data, batch, width, device, counted)
        for name, runner in RUNNERS.items()
    }
    print(
        f"{'runner':<18} {'ATen ops/step':>13} {'vs plain':>9} {'Python calls/step':>18} {'vs plain':>9}"
    )
    for name, (ops, calls) in per_step.items():
        plain = per_step["plain loop+log" if name.endswith("+log") else "plain loop"]
        print(
            f"{name:<18} {ops:>13.1f} {ops / plain[0]:>9.3f} {calls:>18.1f} {calls / plain[1]:>9.3f}"
        )


RUNNERS = {
    "plain loop": run_plain,
    "plain loop+log": run_plain_logging,
    "nanotrain": run_nanotrain,
    "lightning": run_lightning,
    "nanotrain+defaults": run_nanotrain_defaults,
    "nanotrain+log": run_nanotrain_logging,
    "lightning+log": run_lightning_logging,
}


def main() -> None:
    """Run every runner `--rounds` times, interleaved, and print median ms/step and ratios."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--sync-check", action="store_true", help="only the GPU sync check")
    parser.add_argument(
        "--count-host-work", action="store_true", help="only the ops and Python calls per step"
    )
    parser.add_argument(
        "--host-profile", action="store_true", help="only where the logging runs spend host time"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    data = make_data(args.batch * 64, args.width)
    if args.count_host_work:
        count_host_work(data, args.batch, args.width, args.device)
        return
    if args.host_profile:
        host_profile(data, args.batch, args.width, args.device)
        return
    if args.sync_check:
        sync_check(data, args.batch, args.width)
        return
    times: dict[str, list[float]] = {name: [] for name in RUNNERS}
    for i in range(args.rounds):
        # every other round in reverse order: a drift of the machine's speed during a round
        # then favours no runner over the rounds
        order = list(RUNNERS.items()) if i % 2 == 0 else list(RUNNERS.items())[::-1]
        for name, runner in order:
            times[name].append(
                runner(data, args.batch, args.steps, args.warmup, args.width, device=args.device)
            )
    print(
        f"steps={args.steps} warmup={args.warmup} rounds={args.rounds} batch={args.batch} "
        f"width={args.width} threads={args.threads} device={args.device} "
        f"torch={torch.__version__}"
    )
    print(
        f"{'runner':<18} {'ms/step (median)':>17} {'vs plain':>9} {'paired':>7} {'best':>6}"
        "   all rounds (ms/step)"
    )
    for name, values in times.items():
        med = statistics.median(values)
        # a logging runner against the plain loop that logs the same by hand
        plain = times["plain loop+log" if name.endswith("+log") else "plain loop"]
        base = statistics.median(plain)
        # the same round's plain loop ran moments before: its ratio cancels slow drifts
        paired = statistics.median(v / p for v, p in zip(values, plain, strict=True))
        # the fastest rounds: what each runner costs when nothing else takes the core
        best = min(values) / min(plain)
        rounds = " ".join(f"{v:.3f}" for v in values)
        print(f"{name:<18} {med:>17.3f} {med / base:>9.3f} {paired:>7.3f} {best:>6.3f}   {rounds}")


if __name__ == "__main__":
    main()
