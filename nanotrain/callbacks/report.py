"""RunReport: write `report.md`, `report.json` and pictures into the run directory when fit ends."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nanotrain.callbacks.base import Callback

if TYPE_CHECKING:
    from nanotrain.module import NanoModule
    from nanotrain.trainer import Trainer


class RunReport(Callback):
    """Leaves a report of what a run achieved in its run directory (rank 0 writes it).

    When training starts (`on_fit_start`) it records the facts the metric logs do not hold in
    `run_info.json` (strategy and layout, model size, data and tokenizer, settings); when
    `fit` ends, also after a stop request or an exception, it adds the outcome and writes
    `report.md`, `report.json` and `report/loss.png`, `report/lr.png` (see
    `nanotrain.report.write_report`). `nanotrain report RUN_DIR` rebuilds the same files
    later from the run directory alone.

    The numbers come from what the loggers wrote (`metrics.jsonl`, else TensorBoard), so
    keep at least one logger on; validation curves need validation, the LR picture needs
    `LearningRateMonitor`, throughput and MFU need `ThroughputMonitor`. A failure while
    writing the report is turned into a warning: it never hides the run's own outcome.
    """

    def __init__(self) -> None:
        self._info: dict[str, Any] | None = None
        self._failure: BaseException | None = None
        self.report: dict[str, Any] | None = None

    def setup(self, trainer: Trainer, module: NanoModule, stage: str) -> None:
        """Forget the previous run's state (the run directory is not written yet)."""
        self._info, self._failure, self.report = None, None, None

    def on_fit_start(self, trainer: Trainer, module: NanoModule) -> None:
        """Record the start facts once the run directory exists and a resumed checkpoint is
        loaded (a launch rejected before this point leaves no report, as it leaves no run
        directory)."""
        if not trainer.is_global_zero:
            return
        from nanotrain.report.run_info import start_info, write_run_info

        try:
            self._info = start_info(trainer)
            self._info["resumed_at_step"] = trainer.global_step
            write_run_info(Path(trainer.run_dir), self._info)
        except Exception as exc:  # noqa: BLE001 - a report must never stop training
            warnings.warn(f"RunReport: could not record run_info.json: {exc!r}", stacklevel=2)
            self._info = None

    def on_exception(self, trainer: Trainer, module: NanoModule, exception: BaseException) -> None:
        """Remember the failure for the report's status."""
        self._failure = exception

    def teardown(self, trainer: Trainer, module: NanoModule, stage: str) -> None:
        """Write the outcome and the report (fit only)."""
        if stage != "fit" or self._info is None:
            return
        from nanotrain.report import write_report
        from nanotrain.report.run_info import end_info, write_run_info

        if self._failure is not None:
            status = f"failed: {type(self._failure).__name__}: {self._failure}"[:500]
        elif trainer.should_stop:
            status = f"stopped early at step {trainer.global_step}"
        else:
            status = "finished"
        try:
            trainer.loggers.flush()
            write_run_info(Path(trainer.run_dir), {**self._info, **end_info(trainer, status)})
            self.report = write_report(trainer.run_dir)
        except Exception as exc:  # noqa: BLE001 - never mask the run's own outcome
            warnings.warn(f"RunReport: could not write the report: {exc!r}", stacklevel=2)
        self._info = None
