"""TorchProfiler: `torch.profiler` traces of chosen training steps, one file per rank."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch.profiler import ProfilerActivity, profile, schedule

from nanotrain.callbacks.base import Callback

if TYPE_CHECKING:
    from nanotrain.module import NanoModule
    from nanotrain.strategies.base import StepOutput
    from nanotrain.trainer import Trainer


class TorchProfiler(Callback):
    """Records a `torch.profiler` trace of a few training steps on every rank.

    Steps are counted from the start of `fit` (resumed runs count from the resume step). The
    schedule skips `skip_first` steps, then for each of `repeat` cycles waits `wait` steps,
    warms up for `warmup` steps (recording starts but is thrown away) and records `active`
    steps. With the defaults (skip_first=0, wait=1, warmup=1, active=3) steps 3, 4 and 5 of a
    fresh run are recorded. When the last cycle is written the profiler is stopped, so the
    rest of the run pays nothing; without this callback nothing is profiled at all.

    Each cycle writes `<dirpath>/rank<R>.<N>.pt.trace.json` on every rank (N: the steps the
    profiler had seen when the cycle ended; named as TensorBoard's profiler plugin expects:
    worker `rank<R>`, span N), a Chrome-trace JSON that Perfetto (ui.perfetto.dev),
    chrome://tracing and TensorBoard (`tensorboard --logdir <run_dir>` with the
    `torch-tb-profiler` plugin installed; the run is called "profiler") open.
    The strategies label their parts of each step (`nanotrain.runtime.profiling.named_range`):
    `nanotrain/forward`, `nanotrain/backward`, `nanotrain/grad_reduction`,
    `nanotrain/optimizer_step`, and under pipeline parallelism
    `nanotrain/stage<k>/forward/mb<m>` and `nanotrain/stage<k>/backward/mb<m>` for each
    microbatch `m` of virtual stage `k`.

    Args:
        wait, warmup, active, repeat, skip_first: the `torch.profiler.schedule` (in steps).
        dirpath: where traces go; None means `<run_dir>/profiler`.
        record_shapes, profile_memory, with_stack: passed to `torch.profiler.profile`
            (each makes traces larger and the recorded steps slower).

    Raises:
        ValueError: for a negative count, `active` < 1 or `repeat` < 1.
    """

    def __init__(
        self,
        wait: int = 1,
        warmup: int = 1,
        active: int = 3,
        repeat: int = 1,
        skip_first: int = 0,
        dirpath: str | Path | None = None,
        record_shapes: bool = False,
        profile_memory: bool = False,
        with_stack: bool = False,
    ) -> None:
        for name, value, low in (
            ("wait", wait, 0),
            ("warmup", warmup, 0),
            ("active", active, 1),
            ("repeat", repeat, 1),
            ("skip_first", skip_first, 0),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"TorchProfiler: {name} must be an int >= {low}, got {value!r}")
        self.wait, self.warmup, self.active = wait, warmup, active
        self.repeat, self.skip_first = repeat, skip_first
        self._user_dirpath = Path(dirpath) if dirpath is not None else None
        self.dirpath = self._user_dirpath
        self.record_shapes = record_shapes
        self.profile_memory = profile_memory
        self.with_stack = with_stack
        self.trace_paths: list[Path] = []
        self._profiler: profile | None = None
        self._rank = 0
        self._steps = 0

    @property
    def total_steps(self) -> int:
        """Steps after which every cycle has been recorded."""
        return self.skip_first + self.repeat * (self.wait + self.warmup + self.active)

    def on_train_start(self, trainer: Trainer, module: NanoModule) -> None:
        """Start the profiler (it records only in the schedule's active steps)."""
        self.dirpath = self._user_dirpath or Path(trainer.run_dir) / "profiler"
        self.dirpath.mkdir(parents=True, exist_ok=True)
        self._rank, self._steps, self.trace_paths = trainer.global_rank, 0, []
        activities = [ProfilerActivity.CPU]
        if trainer.strategy.root_device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        self._profiler = profile(
            activities=activities,
            schedule=schedule(
                wait=self.wait,
                warmup=self.warmup,
                active=self.active,
                repeat=self.repeat,
                skip_first=self.skip_first,
            ),
            on_trace_ready=self._write_trace,
            record_shapes=self.record_shapes,
            profile_memory=self.profile_memory,
            with_stack=self.with_stack,
        )
        self._profiler.start()

    def _write_trace(self, prof: profile) -> None:
        path = self.dirpath / f"rank{self._rank}.{prof.step_num}.pt.trace.json"
        prof.export_chrome_trace(str(path))
        self.trace_paths.append(path)

    def on_train_step_end(
        self,
        trainer: Trainer,
        module: NanoModule,
        outputs: StepOutput,
        microbatches: list[Any],
        step_idx: int,
    ) -> None:
        """Advance the schedule; stop the profiler once the last cycle is written."""
        if self._profiler is None:
            return
        self._profiler.step()
        self._steps += 1
        if self._steps >= self.total_steps:
            self._stop()

    def _stop(self) -> None:
        if self._profiler is not None:
            profiler, self._profiler = self._profiler, None
            profiler.stop()

    def on_train_end(self, trainer: Trainer, module: NanoModule) -> None:
        """Stop a profiler still running (a run shorter than the schedule)."""
        self._stop()

    def on_exception(self, trainer: Trainer, module: NanoModule, exception: BaseException) -> None:
        """Stop the profiler so that it does not outlive a failed run."""
        self._stop()

    def teardown(self, trainer: Trainer, module: NanoModule, stage: str) -> None:
        self._stop()
