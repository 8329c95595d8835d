"""Model FLOPs utilization (MFU) of a ~1B dense and a ~1B MoE model in bf16 on one GPU.

    python benchmarks/gpu.py                      # sync check, then both presets, eager and compiled
    python benchmarks/gpu.py --sync-check-only    # seconds: only the host-sync check
    python benchmarks/gpu.py --no-sync-check --experts-only   # expert layer by number of experts
    python benchmarks/gpu.py --find-syncs ddp:bf16-mixed      # where each sync comes from
    python benchmarks/gpu.py --preset dense-1b --micro-batch 8 --seq-len 2048 --compile model

Each step is forward + backward + fused AdamW over one micro-batch of random tokens, with no
Trainer (the bare loop): on bf16 weights with bf16 AdamW state by default, or with
`--precision bf16-mixed` / `bf16-true` as the Trainer keeps them (fp32 weights under bf16
autocast; bf16 weights, fp32 main grads and fp32 masters), the figures `benchmarks/gpu_fit.py`
sets beside `nanotrain fit`'s own. Time is measured with CUDA events after warm-up. MFU =
flops_per_token x tokens/s / peak, with `nanotrain.models.accounting.flops_per_token` (6 x
active matmul parameters + causal attention) and the GPU's dense bf16 peak the
ThroughputMonitor uses (`nanotrain.callbacks.flops.device_peak_flops`: H100 SXM 989 TFLOP/s,
A100 312; give --peak-tflops for others). `--compile` lists what to run each preset as, one table row each:
"none" (eager), "layers" (torch.compile per decoder layer), "model" (the whole model as one
graph), as `LanguageModelModule(compile_layers=...)` / `compile_model=...` compile it, and
"cudagraphs" (the whole model with `mode="reduce-overhead"`: its graphs replayed as CUDA
graphs, one launch each); the default runs eager and the compiled model side by side. Without
CUDA it checks its arguments, prints the presets' sizes and exits 0 without timing anything.

First (unless --no-sync-check) it fits the tiny DeepSeek model with the Trainer on the GPU,
under SingleDeviceStrategy, DDPStrategy and MegatronStrategy (one NCCL rank), in bf16-true and
in bf16-mixed, with its default callbacks, and runs six non-logging steps of each under
`torch.cuda.set_sync_debug_mode("warn")`. It prints every host-device sync in
them with the nanotrain line that caused it and the steps it came in (all of them, so one run
finds them all; a sync that torch reports only on stderr, from C++ code or a thread without
Python, is counted from there). The MFU runs still follow, and the script exits 1 if any step
after the second synced: step 2 is reported but not failed, since one-time work can still
happen there (torch's DDP rebuilds its gradient buckets in step 2's forward, with two syncs;
docs/performance.md, "Host-device synchronizations").

`--find-syncs ddp:bf16-mixed` profiles steps 2-14 of that fit instead and prints each blocking
CUDA runtime call in them (`SYNC_CALLS`) with its thread, its enclosing ops (and Python
functions, where the profiler links them) and its steps: the source of a sync that sync debug
mode reports only on stderr, and the syncs it does not report at all (DDP's waits on CUDA
events). It exits 1 on any after the warm-up (`warm_up_last`: step 11 under torch's DDP, whose
runtime statistics wait on events through step 11; step 2 otherwise).

`benchmarks/gpu_session.sh` runs this with the CUDA tests and `benchmarks/nccl_check.py` as
one command for a short GPU lease.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
from pathlib import Path
from typing import NamedTuple

import torch

from nanotrain.callbacks.flops import device_peak_flops
from nanotrain.models import build_model, presets
from nanotrain.models.accounting import active_params, flops_per_token, total_params
from nanotrain.models.compile import compile_layers, compile_model
from nanotrain.precision import resolve_precision


def _load_nccl_check():
    """benchmarks/nccl_check.py, loaded by its path (benchmarks/ is not a package, and putting
    it on sys.path would shadow modules named like its scripts)."""
    import importlib.util

    path = Path(__file__).resolve().parent / "nccl_check.py"
    spec = importlib.util.spec_from_file_location("nanotrain_benchmarks_nccl_check", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_nccl_check = _load_nccl_check()
Tokens, one_rank_world = _nccl_check.Tokens, _nccl_check.one_rank_world

#: name -> (base preset, overrides)
PRESETS = {
    # Llama-style 1.1B (the TinyLlama shape)
    "dense-1b": (
        "dense-100m",
        dict(hidden_size=2048, num_layers=22, num_heads=32, num_kv_heads=4, intermediate_size=5632),
    ),
    # DeepSeek-V3-style MoE, ~1B total / ~0.3B active
    "moe-1b": (
        "deepseek-100m",
        dict(
            hidden_size=1024,
            num_layers=14,
            num_heads=16,
            intermediate_size=2816,
            q_lora_rank=384,
            kv_lora_rank=256,
            n_routed_experts=32,
            moe_intermediate_size=704,
            num_experts_per_tok=4,
            n_group=4,
            topk_group=2,
            mtp_depth=0,
        ),
    ),
}


#: what --compile can run each preset as: eager, torch.compile per decoder layer, the whole
#: model as one graph, and the whole model under CUDA graphs (torch.compile's
#: mode="reduce-overhead": each compiled graph is replayed with one launch)
COMPILE_RUNS = ("none", "layers", "model", "cudagraphs")


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse and check the arguments (ValueError-style errors through argparse)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", choices=[*PRESETS, "all"], default="all")
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--steps", type=int, default=20, help="timed steps after 5 warm-up steps")
    p.add_argument("--peak-tflops", type=float, default=None, help="override the GPU's peak")
    p.add_argument(
        "--compile",
        default="none,model",
        help="comma-separated runs per preset: none (eager), layers, model, cudagraphs "
        "(default: none,model)",
    )
    p.add_argument(
        "--precision",
        choices=BARE_PRECISIONS,
        default="bf16",
        help="bf16 (bf16 weights and AdamW state, the default), or the Trainer precisions "
        "bf16-mixed / bf16-true (fp32 masters) to compare with benchmarks/gpu_fit.py",
    )
    p.add_argument("--no-sync-check", action="store_true", help="skip the Trainer sync check")
    p.add_argument(
        "--sync-check-only", action="store_true", help="run only the sync check (seconds)"
    )
    p.add_argument(
        "--profile", action="store_true", help="also print each run's 15 costliest CUDA kernels"
    )
    p.add_argument(
        "--find-syncs",
        action="append",
        default=[],
        metavar="STRATEGY:PRECISION",
        help="profile steps 2-14 of the sync check's fit (e.g. ddp:bf16-mixed) and print where "
        "each host sync in them comes from; fails on one after the warm-up (step 11 under "
        "torch's DDP, else 2); repeatable; runs only that",
    )
    p.add_argument(
        "--experts-only",
        action="store_true",
        help="time only one expert layer by number of local experts (8, 32, 128)",
    )
    args = p.parse_args(argv)
    for name in ("micro_batch", "seq_len", "steps"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.peak_tflops is not None and args.peak_tflops <= 0:
        p.error(f"--peak-tflops must be > 0, got {args.peak_tflops}")
    args.compile = [c.strip() for c in args.compile.split(",") if c.strip()]
    unknown = sorted(set(args.compile) - set(COMPILE_RUNS))
    if unknown or not args.compile:
        p.error(f"--compile takes {', '.join(COMPILE_RUNS)} (comma-separated), got {unknown}")
    for item in args.find_syncs:
        strategy, _, precision = item.partition(":")
        if strategy not in SYNC_STRATEGIES or not precision:
            p.error(
                f"--find-syncs takes STRATEGY:PRECISION with a strategy of {SYNC_STRATEGIES}, "
                f"e.g. ddp:bf16-mixed; got {item!r}"
            )
        try:
            resolve_precision(precision)
        except ValueError as err:
            p.error(f"--find-syncs {item!r}: {err}")
    return args


def config_of(name: str, seq_len: int):
    """The model config of preset `name` with room for `seq_len` tokens."""
    base, overrides = PRESETS[name]
    return presets.get(base, **overrides, max_seq_len=max(seq_len, 2048))


def peak_tflops(args: argparse.Namespace) -> float:
    """The GPU's dense bf16 peak; raises ValueError for an unknown GPU without --peak-tflops."""
    if args.peak_tflops is not None:
        return args.peak_tflops
    name = torch.cuda.get_device_name()
    peak = device_peak_flops(torch.device("cuda"), "bf16")  # the ThroughputMonitor's peak
    if peak is None:
        raise ValueError(f"unknown peak for {name!r}: pass --peak-tflops (dense bf16 TFLOP/s)")
    return peak / 1e12


#: what the bare loop keeps in which dtype (--precision): "bf16" = bf16 weights and bf16 AdamW
#: state (no masters); "bf16-mixed" and "bf16-true" = the Trainer precisions of those names
#: (fp32 weights under bf16 autocast; bf16 weights with fp32 main grads and fp32 masters)
BARE_PRECISIONS = ("bf16", "bf16-mixed", "bf16-true")


def _training_step(name: str, compile_as: str, args: argparse.Namespace, device: str = "cuda"):
    """A closure running one training step of preset `name` compiled as `compile_as` (one of
    COMPILE_RUNS) in `args.precision` (one of BARE_PRECISIONS) with fused AdamW, and the
    model's config. No Trainer: the bf16-true loop uses the same fp32 main-grad and master
    pieces the strategies use (`nanotrain.precision.MainGrads`, `MasterWeights`)."""
    from nanotrain.precision import MainGrads, MasterWeights

    config = config_of(name, args.seq_len)
    torch.manual_seed(0)
    model = build_model(config, device=device)
    if args.precision != "bf16-mixed":
        model = model.to(torch.bfloat16)
    if compile_as == "layers":
        compile_layers(model)
    elif compile_as == "model":
        compile_model(model)
    elif compile_as == "cudagraphs":
        compile_model(model, mode="reduce-overhead")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    main_grads = masters = None
    if args.precision == "bf16-true":
        main_grads = MainGrads(list(model.parameters()))
        masters = MasterWeights(opt)
    autocast = torch.autocast(device, torch.bfloat16, enabled=args.precision == "bf16-mixed")
    tokens = torch.randint(
        0, config.vocab_size, (args.micro_batch, args.seq_len + 1), device=device
    )

    def step() -> None:
        if compile_as == "cudagraphs":  # a new iteration: the last one's graph outputs are free
            torch.compiler.cudagraph_mark_step_begin()
        with autocast:
            loss = model(tokens[:, :-1], tokens[:, 1:]).total_loss
        loss.backward()
        if masters is not None:
            masters.step()
            main_grads.zero_()
        else:
            opt.step()
        opt.zero_grad(set_to_none=True)

    return step, config


class Measurement(NamedTuple):
    """One bare-loop run: milliseconds per step, tokens/s, MFU (fraction), peak GiB, and the
    kernel table with --profile ("" otherwise)."""

    ms: float
    tokens_per_s: float
    mfu: float
    peak_gib: float
    profile: str


def measure(name: str, compile_as: str, args: argparse.Namespace, peak: float) -> Measurement:
    """Time `args.steps` training steps of preset `name` compiled as `compile_as` (one of
    COMPILE_RUNS) and print tokens/s and MFU as a table row."""
    step, config = _training_step(name, compile_as, args)
    b, t = args.micro_batch, args.seq_len
    for _ in range(5):
        step()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(args.steps):
        step()
    end.record()
    torch.cuda.synchronize()
    seconds = start.elapsed_time(end) / 1e3 / args.steps
    tps = b * t / seconds
    mfu = flops_per_token(config, t) * tps / (peak * 1e12)
    mem = torch.cuda.max_memory_allocated() / 2**30
    print(
        f"| {name} | {compile_as} | {args.precision} | {total_params(config) / 1e9:.2f}B / "
        f"{active_params(config) / 1e9:.2f}B | {b}x{t} | {seconds * 1e3:.1f} | {tps:,.0f} "
        f"| {100 * mfu:.1f}% | {mem:.1f} |",
        flush=True,
    )
    table = profile(step, f"{name} ({compile_as}, {b}x{t})") if args.profile else ""
    return Measurement(seconds * 1e3, tps, mfu, mem, table)


TABLE_HEAD = (
    "| preset | compile | precision | params total / active | batch | ms/step | tokens/s | MFU "
    "| peak GiB |\n|---|---|---|---|---|---|---|---|---|"
)


SYNC_STRATEGIES = ("single", "ddp", "megatron")


def _strategy(name: str):
    """The strategy `name` of SYNC_STRATEGIES, and the backend of the one-rank group it needs
    made for it (None: it makes its own, or needs none)."""
    import nanotrain as nt

    if name == "single":
        return nt.SingleDeviceStrategy("cuda"), None
    if name == "ddp":
        return nt.DDPStrategy(), None
    return nt.MegatronStrategy(zero_stage=1), "nccl"


#: the steps (batch_idx) the sync check watches: none of them logs (max_steps 8, logging every
#: 8th step), and the first step, which sets everything up, is not among them
WATCHED_STEPS = range(1, 7)
#: step 2 (batch_idx 1) is reported but not failed: one-time work can still happen there
#: (on an H100 torch's DDP synced twice in step 2's forward, rebuilding its gradient buckets,
#: and never later in sync debug mode's view); the check fails on syncs in steps 3-7
WARM_UP_STEPS = {2}
_SYNC_MESSAGE = "called a synchronizing CUDA operation"


def sync_site(message: object, filename: str, lineno: int) -> str | None:
    """Where a warning of sync debug mode comes from: the innermost nanotrain line on the
    stack (else the warning's own place); None for any other warning. Call it from the
    `warnings.showwarning` replacement, so the stack is the synchronizing call's."""
    import traceback

    if _SYNC_MESSAGE not in str(message):
        return None
    frames = [f for f in traceback.extract_stack()[:-2] if "/nanotrain/" in f.filename]
    if not frames:
        return f"{filename}:{lineno}"
    return f"{frames[-1].filename}:{frames[-1].lineno} ({frames[-1].name})"


def sync_check(precision: str, strategy: str = "single") -> bool:
    """Fit the tiny MoE 8 steps in `precision` (default callbacks) under `strategy` (one of
    SYNC_STRATEGIES, one rank on NCCL for ddp and megatron) with steps 2-7 under sync debug
    mode "warn", and print every place that synced with the host and in which steps: the
    innermost nanotrain line of each (all of them in one run, so one GPU session finds them
    all). A sync that torch reports only on stderr (from C++ code such as DDP's forward, or a
    thread without Python) is counted per step from there. True when none came after the
    warm-up step (WARM_UP_STEPS)."""
    import tempfile
    import warnings

    import nanotrain as nt

    found: dict[str, list[int]] = {}
    step = [-1]

    def record(message, category, filename, lineno, file=None, line=None):  # noqa: ANN001
        where = sync_site(message, filename, lineno)
        if where is not None:
            found.setdefault(where, []).append(step[0] + 1)

    class SyncWatch(nt.Callback):
        """Sync debug mode "warn" over the watched steps, stderr sent to a file meanwhile."""

        def __init__(self, log: str) -> None:
            self.log, self.saved_fd = log, None

        def on_train_step_start(self, trainer, module, batch, batch_idx):
            if batch_idx in WATCHED_STEPS:
                torch.cuda.synchronize()  # what is queued before the step is not its sync
                step[0] = batch_idx
                sys.stderr.flush()
                self.saved_fd = os.dup(2)
                with open(self.log, "w") as f:
                    os.dup2(f.fileno(), 2)
                torch.cuda.set_sync_debug_mode("warn")

        def on_train_step_end(self, trainer, module, outputs, batch, batch_idx):
            if self.saved_fd is None:  # not a watched step
                return
            torch.cuda.synchronize()  # the step's work on other threads is done and reported
            torch.cuda.set_sync_debug_mode("default")
            self.restore()
            with open(self.log) as f:
                n = sum(_SYNC_MESSAGE in line for line in f)
            found.setdefault("stderr only (C++ code or a thread without Python)", []).extend(
                [step[0] + 1] * n
            )

        def restore(self) -> None:
            if self.saved_fd is not None:
                sys.stderr.flush()
                os.dup2(self.saved_fd, 2)
                os.close(self.saved_fd)
                self.saved_fd = None

    chosen, backend = _strategy(strategy)
    with (
        tempfile.TemporaryDirectory() as root,
        warnings.catch_warnings(),
        one_rank_world(backend),
    ):
        warnings.simplefilter("always")
        warnings.showwarning = record
        watch = SyncWatch(f"{root}/stderr.log")
        trainer = nt.Trainer(
            strategy=chosen,
            precision=precision,
            max_steps=8,
            global_batch_size=8,
            micro_batch_size=4,
            log_every_n_steps=8,
            default_root_dir=root,
            callbacks=[watch],
        )
        module = nt.LanguageModelModule(model="tiny", vocab_size=256)
        try:
            trainer.fit(module, train_dataloaders=Tokens())
        finally:
            watch.restore()
            torch.cuda.set_sync_debug_mode("default")
    found = {where: steps for where, steps in found.items() if steps}
    steady = any(set(steps) - WARM_UP_STEPS for steps in found.values())
    if found:
        verdict = "FAILED" if steady else "passed, with syncs in the warm-up step only"
        print(f"sync check {verdict} ({strategy}, {precision}): non-logging steps synced at")
        for where, steps in found.items():
            print(f"  {len(steps)}x {where}, in steps {sorted(set(steps))}")
        return not steady
    print(f"sync check: no host-device sync in non-logging steps ({strategy}, {precision})")
    return True


#: CUDA runtime calls that block the host until the GPU catches up (`.item()`, a blocking
#: device-to-host copy and an explicit synchronize end in one of them)
SYNC_CALLS = (
    "cudaStreamSynchronize",
    "cudaDeviceSynchronize",
    "cudaEventSynchronize",
    "cudaMemcpy",
)


def warm_up_last(strategy: str, precision: str) -> int:
    """The last step whose host syncs `--find-syncs` reports without failing: 11 where torch's
    DDP runs (DDPStrategy in every precision but bf16-true), whose runtime statistics wait on
    CUDA events at the start of each of the first ten synchronized steps after a (re)start,
    steps 2-11; else 2 (one-time work may still happen in step 2)."""
    return 11 if strategy == "ddp" and precision != "bf16-true" else 2


def late_syncs(found: dict[str, list[int]], last: int) -> list[int]:
    """The steps after `last` in which `sync_sources` found a call (`found` as it returns)."""
    return sorted({n for steps in found.values() for n in steps if n > last})


_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def sync_sources(
    precision: str,
    strategy: str = "ddp",
    steps: range = range(2, 15),
    calls: tuple[str, ...] = SYNC_CALLS,
) -> dict[str, list[int]]:
    """Where the host syncs of training steps come from, including those sync debug mode does
    not see (it reports only syncs that go through torch's own synchronize calls, and some of
    those only on stderr): fit the tiny MoE as `sync_check` does, under `strategy` and
    `precision`, logging only after `steps`; profile `steps` (CPU and CUDA activities, Python
    stacks) and print each call of `calls` in them with its thread, its enclosing ops (and
    Python functions, where the profiler links them; innermost first) and the steps it came
    in. A step's share of time runs from the end of the one before (data loading and the
    callbacks between steps count) to its own end. Returns {that description: [step of each
    call]}."""
    import tempfile

    from torch.profiler import ProfilerActivity, record_function
    from torch.profiler import profile as torch_profile

    import nanotrain as nt

    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    prof = torch_profile(activities=activities, with_stack=True)
    ranges: dict[int, record_function] = {}

    class Watch(nt.Callback):
        """Profiles `steps`, each inside a range named after it, to place each call in time
        (steps counted here: batch_idx starts again at 0 in each epoch)."""

        n, recording = 0, False

        def on_train_step_start(self, trainer, module, batch, batch_idx):
            self.n += 1
            if self.n == steps[0]:
                if torch.cuda.is_available():
                    torch.cuda.synchronize()  # the earlier steps' work is not in the window
                prof.start()
                self.recording = True
            if self.n in steps:
                ranges[self.n] = record_function(f"sync_sources/step {self.n}")
                ranges[self.n].__enter__()

        def on_train_step_end(self, trainer, module, outputs, batch, batch_idx):
            if self.n in ranges:
                ranges[self.n].__exit__(None, None, None)
            if self.n == steps[-1]:
                self.stop()

        def on_train_end(self, trainer, module):
            self.stop()  # a run shorter than the window: the profiler must not outlive it

        def stop(self) -> None:
            if self.recording:
                prof.stop()
                self.recording = False

    chosen, backend = _strategy(strategy)
    with tempfile.TemporaryDirectory() as root, one_rank_world(backend):
        trainer = nt.Trainer(
            strategy=chosen,
            precision=precision,
            max_steps=steps[-1] + 1,
            global_batch_size=8,
            micro_batch_size=4,
            log_every_n_steps=steps[-1] + 1,
            default_root_dir=root,
            callbacks=[Watch()],
        )
        module = nt.LanguageModelModule(model="tiny", vocab_size=256)
        trainer.fit(module, train_dataloaders=Tokens())
    events = prof.events()
    ends = sorted(
        (e.time_range.end, int(e.name.rsplit(" ", 1)[1]))
        for e in events
        if e.name.startswith("sync_sources/step ")
    )
    found: dict[str, list[int]] = {}
    after = 0  # calls after the last step: the profiler's own when it stops
    for event in events:
        if event.name not in calls:
            continue
        step = next((n for end, n in ends if event.time_range.start <= end), None)
        if step is None:
            after += 1
            continue
        chain, parent = [], event.cpu_parent
        while parent is not None and not parent.name.startswith("sync_sources/step "):
            chain.append(_ADDRESS.sub("", parent.name))
            parent = parent.cpu_parent
        where = f"{event.name} (thread {event.thread}) in: " + " <- ".join(chain or ["no op"])
        found.setdefault(where, []).append(step)
    total = sum(len(v) for v in found.values())
    print(
        f"\nsync sources ({strategy}, {precision}, steps {steps[0]}-{steps[-1]}): {total} call(s)"
        + (f"; {after} after the last step (the profiler's own)" if after else "")
    )
    for where, in_steps in found.items():
        print(f"  {len(in_steps)}x {where}, in steps {sorted(set(in_steps))}")
    return found


def profile(step, title: str) -> str:
    """The table of the 15 CUDA kernels that take the most time over 3 calls of `step`."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            step()
        torch.cuda.synchronize()
    table = prof.key_averages().table(
        sort_by="device_time_total", row_limit=15, max_name_column_width=70
    )
    return f"\n{title}: the CUDA kernels of 3 steps\n{table}"


def _device_ms(fn, device: torch.device, repeats: int) -> float:
    """Median milliseconds of `fn()` over `repeats` calls after 3 warm-up calls (CUDA events on
    a GPU, the host clock elsewhere)."""
    import statistics

    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(times)


def _copy_bandwidth(device: torch.device, mib: int = 256) -> float:
    """Bytes per second a large copy on `device` moves (bytes read + written)."""
    src = torch.ones(mib * 2**20 // 4, device=device)
    dst = torch.empty_like(src)
    return 2 * src.numel() * 4 / (_device_ms(lambda: dst.copy_(src), device, 5) / 1e3)


def expert_scaling(
    device: str = "cuda",
    dtype: torch.dtype = torch.bfloat16,
    rows: int = 32768,
    hidden: int = 1024,
    width: int = 704,
    experts: tuple[int, ...] = (8, 32, 128),
    repeats: int = 20,
) -> dict[int, float]:
    """fwd+bwd of one `GroupedExperts` layer at fixed rows and FLOPs (each row goes through one
    expert of `width`; equal groups) by number of local experts, as benchmarks/expert.py's
    table (c) on the CPU; defaults: moe-1b's shapes (4 x 2048 tokens x top-4). Prints each
    time, its ratio to the smallest E's, and the floor of that ratio that memory alone sets:
    the weights grow with E and a step reads them twice and writes their gradients once, at
    the device's measured copy bandwidth. Returns ms per number of experts."""
    from nanotrain.models.moe import GroupedExperts

    dev = torch.device(device)
    bandwidth = _copy_bandwidth(dev)
    grad_out = torch.randn(rows, hidden, device=dev, dtype=dtype)
    ms = {}
    for e in experts:
        torch.manual_seed(0)
        layer = GroupedExperts(e, hidden, width, device=dev).to(dtype)
        for p in layer.parameters():
            torch.nn.init.normal_(p, std=0.02)
        x = torch.randn(rows, hidden, device=dev, dtype=dtype, requires_grad=True)
        counts = torch.full((e,), rows // e, device=dev)

        def step(layer=layer, x=x, counts=counts) -> None:
            layer(x, counts).backward(grad_out)
            layer.zero_grad(set_to_none=True)
            x.grad = None

        ms[e] = _device_ms(step, dev, repeats)
    size = torch.finfo(dtype).bits // 8
    base = experts[0]
    print(f"\nexpert layer fwd+bwd, {rows} rows, hidden {hidden}, width {width}, {dtype}, {device}")
    print("| local experts | ms | / smallest E | memory floor of that ratio |")
    print("|---|---|---|---|")
    for e in experts:
        extra = 3 * 3 * (e - base) * hidden * width * size / bandwidth * 1e3  # ms
        print(
            f"| {e} | {ms[e]:.2f} | {ms[e] / ms[base]:.2f}x | {(ms[base] + extra) / ms[base]:.2f}x |"
        )
    print(f"copy bandwidth: {bandwidth / 1e9:.0f} GB/s")
    return ms


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    names = list(PRESETS) if args.preset == "all" else [args.preset]
    for name in names:
        c = config_of(name, args.seq_len)
        print(f"{name}: {total_params(c):,} params, {active_params(c):,} active per token")
    if not torch.cuda.is_available():
        print("no CUDA device: arguments checked, nothing timed (skipped)")
        return 0
    if args.find_syncs:
        steady = False
        for item in args.find_syncs:
            strategy, _, precision = item.partition(":")
            found = sync_sources(precision, strategy)
            last = warm_up_last(strategy, precision)
            late = late_syncs(found, last)
            steady |= bool(late)
            print(
                f"  steady state (steps after {last}): "
                + (f"syncs in {late}" if late else "no sync")
            )
        return 1 if steady else 0
    # the sync check first: it takes seconds, and a failure should not wait for the MFU runs
    synced = False
    if not args.no_sync_check:
        results = [
            sync_check(precision, strategy)
            for strategy in SYNC_STRATEGIES
            for precision in ("bf16-true", "bf16-mixed")
        ]
        synced = not all(results)
    if args.sync_check_only:
        return 1 if synced else 0
    if args.experts_only:
        expert_scaling()
        return 1 if synced else 0
    peak = peak_tflops(args)
    print(f"\n{torch.cuda.get_device_name()}, bf16 peak {peak:.0f} TFLOP/s, {time.strftime('%F')}")
    print(TABLE_HEAD)
    profiles = []
    for name in names:
        for compile_as in args.compile:
            profiles.append(measure(name, compile_as, args, peak).profile)
            torch._dynamo.reset()  # each run compiles its own model afresh
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
    for table in filter(None, profiles):
        print(table)
    return 1 if synced else 0


if __name__ == "__main__":
    sys.exit(main())
