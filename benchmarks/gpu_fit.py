"""What `nanotrain fit` itself gives a user on one GPU, beside the bare loop in the same precision.

    python benchmarks/gpu_fit.py                                   # the user's path: 4 fits
    python benchmarks/gpu_fit.py --preset moe-1b --precision bf16-true --compile cudagraphs
    python benchmarks/gpu_fit.py --preset dense-3b --precision bf16-mixed,torchao-float8 \\
        --steps 200 --no-bare                                      # fp8: speed and loss curve
    python benchmarks/gpu_fit.py --plan-memory                     # planner vs allocator
    python benchmarks/gpu_fit.py --smoke                           # CPU: the same path, tiny

**Fits** (default): for every preset x precision, `python -m nanotrain fit` in its own process:
the Trainer with its default callbacks (checkpointing off: a 1B model's checkpoint is 16 GB of
disk), `TokenDataModule` on the built-in demo corpus (byte tokens; the preset keeps its own
vocabulary, so its FLOPs equal the bare loop's), `compile_model` as `--compile` says,
`MemoryMonitor` added. Each run's report.json, metrics.jsonl and TensorBoard events are copied
to `--out` (default `docs/gpu-logs/<date>-fit/<preset>-<precision>-<compile>/`). The table
gives the ThroughputMonitor's MFU as the run report has it (the last logging window, the steady
state; the mean over windows beside it), the bare loop's MFU in the same precision
(`benchmarks/gpu.py --precision`, same process as this script, after the fits), and the
Trainer's tokens/s over the bare loop's.

**fp8** (`--precision bf16-mixed,torchao-float8 --steps 200`): the same table, plus the mean and
last-20-steps gap between each precision's train/loss curve and the first precision's (same
seed, same data).

**Planner** (`--plan-memory`): for each preset at micro-batch 2 and 4, `nanotrain plan`'s
memory (model state + activations, without its fixed reserve) against
`torch.cuda.max_memory_allocated` of a 6-step fit at that size; then the largest micro-batch
the plan says fits this GPU, fitted for 3 steps (it must not run out of memory).

Without CUDA it checks its arguments and exits 0 (`--smoke` runs the fit path on the CPU with
the tiny preset, for the tests).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]

#: preset name -> (base preset, overrides); the ~1B ones are benchmarks/gpu.py's
EXTRA_PRESETS = {
    # Llama-3.2-3B's shape: large enough GEMMs for fp8 to pay
    "dense-3b": (
        "dense-100m",
        dict(hidden_size=3072, num_layers=28, num_heads=24, num_kv_heads=8, intermediate_size=8192),
    ),
}
PRECISIONS = ("bf16-mixed", "bf16-true", "torchao-float8", "32-true")
COMPILE = {"none": "false", "model": "true", "cudagraphs": "{mode: reduce-overhead}"}


def _load_gpu_benchmark():
    """benchmarks/gpu.py, loaded by its path (benchmarks/ is not a package)."""
    spec = importlib.util.spec_from_file_location("nanotrain_gpu_bench", REPO / "benchmarks/gpu.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gpu = _load_gpu_benchmark()
PRESETS = {**gpu.PRESETS, **EXTRA_PRESETS}


def _csv(kind: str, allowed: tuple[str, ...] | dict, text: str, p: argparse.ArgumentParser):
    items = [s.strip() for s in text.split(",") if s.strip()]
    unknown = [s for s in items if s not in allowed]
    if unknown or not items:
        p.error(f"--{kind} takes {', '.join(allowed)} (comma-separated), got {text!r}")
    return items


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse and check the arguments (errors name the flag, through argparse)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="dense-1b,moe-1b", help=f"of {', '.join(PRESETS)}")
    p.add_argument("--precision", default="bf16-mixed,bf16-true", help=", ".join(PRECISIONS))
    p.add_argument("--compile", default="model", help=", ".join(COMPILE))
    p.add_argument("--steps", type=int, default=40, help="optimizer steps per fit")
    p.add_argument("--log-every", type=int, default=10, help="the Trainer's log_every_n_steps")
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--out", type=Path, default=None, help="where the runs' logs are kept")
    p.add_argument("--no-bare", action="store_true", help="skip the bare-loop comparison")
    p.add_argument("--plan-memory", action="store_true", help="run only the planner check")
    p.add_argument("--smoke", action="store_true", help="CPU: tiny preset, 3 steps, fp32")
    args = p.parse_args(argv)
    for name in ("steps", "log_every", "micro_batch", "seq_len"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.smoke:
        args.preset, args.precision, args.compile = "tiny", "32-true", "none"
        args.steps, args.log_every, args.micro_batch, args.seq_len = 3, 1, 2, 64
        args.no_bare = True
    presets = {**PRESETS, "tiny": ("tiny", {})}
    args.preset = _csv("preset", presets, args.preset, p)
    args.precision = _csv("precision", PRECISIONS, args.precision, p)
    args.compile = _csv("compile", COMPILE, args.compile, p)
    if args.out is None:
        args.out = REPO / "docs" / "gpu-logs" / f"{time.strftime('%F')}-fit"
    return args


def _yaml_map(values: dict) -> str:
    return "{" + ", ".join(f"{k}: {v}" for k, v in values.items()) + "}"


def fit_command(preset: str, precision: str, compile_as: str, args, root: Path, name: str,
                micro_batch: int | None = None, steps: int | None = None) -> list[str]:  # fmt: skip
    """The `nanotrain fit` command line of one run (a list for subprocess)."""
    base, overrides = {**PRESETS, "tiny": ("tiny", {})}[preset]
    micro = micro_batch or args.micro_batch
    overrides = {**overrides, "max_seq_len": max(args.seq_len, 2048)}
    command = [
        sys.executable, "-m", "nanotrain", "fit",
        "--model.init_args.model", base,
        "--model.init_args.compile_model", COMPILE[compile_as],
        "--data.init_args.seq_len", str(args.seq_len),
        "--data.init_args.micro_batch_size", str(micro),
        "--trainer.precision", precision,
        "--trainer.max_steps", str(steps or args.steps),
        "--trainer.micro_batch_size", str(micro),
        "--trainer.global_batch_size", str(micro),
        "--trainer.log_every_n_steps", str(args.log_every),
        "--trainer.limit_val_batches", "0",
        "--trainer.enable_checkpointing", "false",
        "--trainer.enable_progress_bar", "false",
        "--trainer.default_root_dir", str(root),
        "--trainer.name", name,
        "--callbacks+", "nanotrain.callbacks.MemoryMonitor",
    ]  # fmt: skip
    if base != "tiny":  # the preset's own vocabulary (the byte ids fit in it)
        command += ["--model.init_args.model_overrides", _yaml_map(overrides)]
    return command


def run_fit(command: list[str], run_root: Path, name: str, keep: Path) -> dict:
    """Run one fit; copy its logs to `keep`; return its report.json (with "returncode")."""
    started = time.time()
    proc = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    keep.mkdir(parents=True, exist_ok=True)
    (keep / "fit.log").write_text(proc.stdout + proc.stderr)
    runs = sorted((run_root / name).glob("version_*"))
    report: dict = {"returncode": proc.returncode, "wall_s": time.time() - started}
    if runs:
        run_dir = runs[-1]
        for item in ("report.json", "metrics.jsonl", "precision.json", "tensorboard"):
            source = run_dir / item
            if source.is_dir():
                shutil.copytree(source, keep / item, dirs_exist_ok=True)
            elif source.exists():
                shutil.copy2(source, keep / item)
        if (run_dir / "report.json").exists():
            report.update(json.loads((run_dir / "report.json").read_text()))
    if proc.returncode != 0:
        print(f"  {name}: exit {proc.returncode}; last lines:\n" + proc.stderr[-1500:])
    return report


def metric_series(keep: Path, key: str) -> list[tuple[int, float]]:
    """(step, value) of `key` from a kept run's metrics.jsonl."""
    path, out = keep / "metrics.jsonl", []
    if path.exists():
        for line in path.read_text().splitlines():
            row = json.loads(line)
            if key in row:
                out.append((int(row.get("step", 0)), float(row[key])))
    return out


def throughput(report: dict, key: str) -> tuple[float | None, float | None]:
    """(last window, mean over windows) of a ThroughputMonitor figure in report.json."""
    entry = (report.get("throughput") or {}).get(key) or {}
    return entry.get("last"), entry.get("mean")


def fits(args: argparse.Namespace) -> int:
    """The preset x precision x compile fits, each followed by the bare loop beside it; a table
    row is printed as soon as its pair is measured (a lease cut short keeps the rows so far)."""
    root = Path(os.environ.get("TMPDIR", "/tmp")) / f"nanotrain-gpu-fit-{os.getpid()}"
    curves, failed = {}, 0
    print(f"`nanotrain fit`, {time.strftime('%F')}, logs in {args.out}")
    print("| preset | precision | compile | fit MFU last (mean) | tokens/s | peak alloc GiB "
          "| bare loop MFU | fit / bare tokens/s |\n|---|---|---|---|---|---|---|---|", flush=True)  # fmt: skip
    for preset in args.preset:
        for compile_as in args.compile:
            for precision in args.precision:
                name = f"{preset}-{precision}-{compile_as}"
                command = fit_command(preset, precision, compile_as, args, root, name)
                report = run_fit(command, root, name, args.out / name)
                failed += report["returncode"] != 0
                curves[name] = metric_series(args.out / name, "train/loss")
                _print_row(preset, precision, compile_as, name, report, args)
    _loss_gaps(curves)
    return 1 if failed else 0


def _print_row(preset: str, precision: str, compile_as: str, name: str, report: dict,
               args: argparse.Namespace) -> None:  # fmt: skip
    mfu, mfu_mean = throughput(report, "mfu")
    tps, _ = throughput(report, "tokens_per_sec")
    memory = metric_series(args.out / name, "memory/peak_allocated_gib")
    bare = _bare(preset, precision, compile_as, args)
    cells = [
        f"{100 * mfu:.1f}% ({100 * mfu_mean:.1f}%)" if mfu and mfu_mean else "-",
        f"{tps:,.0f}" if tps else "-",
        f"{memory[-1][1]:.1f}" if memory else "-",
        f"{100 * bare.mfu:.1f}%" if bare else "-",
        f"{tps / bare.tokens_per_s:.3f}" if bare and tps else "-",
    ]
    print(f"| {preset} | {precision} | {compile_as} | " + " | ".join(cells) + " |", flush=True)


def _bare(preset: str, precision: str, compile_as: str, args: argparse.Namespace):
    """The bare loop's Measurement in the same precision (None: skipped or not comparable)."""
    if args.no_bare or not torch.cuda.is_available() or precision not in gpu.BARE_PRECISIONS:
        return None
    bare_args = argparse.Namespace(
        seq_len=args.seq_len, micro_batch=args.micro_batch, steps=10, precision=precision,
        profile=False,
    )  # fmt: skip
    gpu.PRESETS.setdefault(preset, PRESETS[preset])
    result = gpu.measure(preset, compile_as, bare_args, gpu.peak_tflops(_no_peak()))
    torch._dynamo.reset()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    return result


def _no_peak() -> argparse.Namespace:
    return argparse.Namespace(peak_tflops=None)


def _loss_gaps(curves: dict[str, list[tuple[int, float]]]) -> None:
    """Mean and last-20-steps |gap| of each run's train/loss to the first run of its preset."""
    first: dict[str, list[float]] = {}
    for name, series in curves.items():
        preset = name.split("-", 2)[0] + "-" + name.split("-", 2)[1]
        values = [v for _, v in series]
        if not values:
            continue
        if preset not in first:
            first[preset] = values
            continue
        ref = first[preset][: len(values)]
        gaps = [abs(a - b) for a, b in zip(values, ref, strict=False)]
        tail = gaps[-20:]
        print(f"train/loss gap of {name} to the first run of {preset}: mean "
              f"{sum(gaps) / len(gaps):.4f}, last {len(tail)} logged {sum(tail) / len(tail):.4f}")  # fmt: skip


def plan_memory(args: argparse.Namespace) -> int:
    """The planner's memory against the allocator's, and the largest micro-batch it allows."""
    from nanotrain.models import presets
    from nanotrain.planning import PlanLayout, Workload, gpu_spec, plan_layout
    from nanotrain.planning.gpus import GPUSpec

    props = torch.cuda.get_device_properties(0)
    spec = gpu_spec("h100")
    device = GPUSpec(**{**spec.to_dict(), "name": "this GPU", "memory_bytes": props.total_memory})
    root = Path(os.environ.get("TMPDIR", "/tmp")) / f"nanotrain-plan-{os.getpid()}"
    precision, failed = args.precision[0], 0
    print("| preset | micro batch | planned GiB (state + activations) | allocated GiB | ratio |")
    print("|---|---|---|---|---|")

    def planned(preset: str, micro: int):
        base, overrides = PRESETS[preset]
        config = presets.get(base, **overrides, max_seq_len=max(args.seq_len, 2048))
        work = Workload(args.seq_len, micro, micro, precision)
        return plan_layout(config, PlanLayout(), work, device, model_name=preset)

    for preset in args.preset:
        for micro in (2, 4):
            plan = planned(preset, micro)
            rank = plan.largest
            want = (rank.memory - rank.reserve) / 2**30
            name = f"plan-{preset}-mb{micro}"
            cmd = fit_command(preset, precision, args.compile[0], args, root, name, micro, 6)
            report = run_fit(cmd, root, name, args.out / name)
            failed += report["returncode"] != 0
            got = metric_series(args.out / name, "memory/peak_allocated_gib")
            got_gib = got[-1][1] if got else float("nan")
            print(f"| {preset} | {micro} | {want:.2f} | {got_gib:.2f} | {got_gib / want:.3f} |")
        largest = max((m for m in (1, 2, 4, 8, 16, 32, 64) if planned(preset, m).fits), default=0)
        if largest:
            name = f"plan-{preset}-largest-mb{largest}"
            cmd = fit_command(preset, precision, args.compile[0], args, root, name, largest, 3)
            report = run_fit(cmd, root, name, args.out / name)
            failed += report["returncode"] != 0
            outcome = "fits" if report["returncode"] == 0 else "FAILED (see fit.log)"
            print(f"{preset}: the largest micro-batch the plan allows, {largest}: {outcome}")
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if not torch.cuda.is_available() and not args.smoke:
        print("no CUDA device: arguments checked, nothing run (skipped)")
        return 0
    if args.plan_memory:
        return plan_memory(args)
    return fits(args)


if __name__ == "__main__":
    sys.exit(main())
