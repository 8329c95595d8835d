"""ModelCheckpoint: when to save checkpoints and which ones to keep."""

from __future__ import annotations

import logging
import math
import shutil
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nanotrain.callbacks.base import Callback
from nanotrain.checkpoint.async_save import PendingSave
from nanotrain.checkpoint.collective import attempt, raise_first_failure
from nanotrain.checkpoint.commit import check_writable
from nanotrain.checkpoint.health import gather_nonfinite
from nanotrain.checkpoint.step_flag import StepFlag
from nanotrain.runtime.run_files import RunFilesError

if TYPE_CHECKING:
    from nanotrain.module import NanoModule
    from nanotrain.strategies.base import StepOutput
    from nanotrain.trainer import Trainer

log = logging.getLogger(__name__)


class ModelCheckpoint(Callback):
    """Save checkpoints on a cadence and at the end of training; keep the last k and the best k.

    Checkpoints are directories `<dirpath>/step-00000100/` written by `trainer.save_checkpoint`
    (atomic; `<dirpath>/last` names the newest). Every rank runs this callback and they all
    decide alike: step cadences are the same everywhere, the time cadence is decided on rank 0
    and broadcast, and the monitored metric comes from `trainer.callback_metrics` (already
    reduced across ranks).

    Args:
        dirpath: where checkpoints go; None means `trainer.checkpoint_dir`
            (`<run_dir>/checkpoints`).
        every_n_steps: save after every this many optimizer steps (None: no step cadence).
        every_n_minutes: save when this many minutes of wall time passed since the last save
            (or since training started); None disables it.
        save_last: save when training ends (unless that step was just saved).
        save_on_exception: save when an exception escapes the training loop, as
            `step-XXXXXXXX-exception`. Safe only when every rank sees the exception (a save is
            collective); a one-rank failure would leave the others waiting.
        save_top_k: keep the `save_top_k` most recent checkpoints saved by this callback;
            -1 keeps all of them. The newest checkpoint whose weights and loss are finite is
            always kept too, so that a run gone NaN never deletes its last good state.
        monitor: a key of `trainer.callback_metrics` (e.g. "val/loss") to rank checkpoints by.
        mode: "min" or "max": whether a lower or a higher `monitor` value is better.
        keep_best_k: also keep the `keep_best_k` best checkpoints by `monitor`, however old
            (default 1 when `monitor` is set, else 0).
        async_save: write checkpoints in a background thread: the loop waits only while the
            state is copied to host memory; the save is committed (and `last` moved) when the
            next save starts or training ends, whichever comes first.

    At the start of `fit` the checkpoint folder is checked to be writable (nothing is left
    behind): a PermissionError / ValueError then, instead of at the first save.

    Raises:
        ValueError: for a non-positive cadence, `save_top_k` not -1 or >= 1, an unknown
            `mode`, or `keep_best_k` > 0 without `monitor`.
    """

    def __init__(
        self,
        dirpath: str | Path | None = None,
        every_n_steps: int | None = None,
        every_n_minutes: float | None = None,
        save_last: bool = True,
        save_on_exception: bool = False,
        save_top_k: int = -1,
        monitor: str | None = None,
        mode: str = "min",
        keep_best_k: int | None = None,
        async_save: bool = False,
    ) -> None:
        _check_options(every_n_steps, every_n_minutes, save_top_k, mode, keep_best_k, monitor)
        self._user_dirpath = Path(dirpath) if dirpath is not None else None
        self.dirpath = self._user_dirpath  # resolved per run in `setup`
        self.every_n_steps = every_n_steps
        self.every_n_minutes = every_n_minutes
        self.save_last = save_last
        self.save_on_exception = save_on_exception
        self.save_top_k = save_top_k
        self.monitor = monitor
        self.mode = mode
        self.keep_best_k = keep_best_k if keep_best_k is not None else (1 if monitor else 0)
        self.async_save = async_save
        # An asynchronous save still being written: (PendingSave, paths to delete once it is
        # committed, the retention state to restore if it fails).
        self._pending: tuple[Any, list[Path], tuple] | None = None
        # Checkpoints this callback saved and still keeps, oldest first:
        # {"path": str, "step": int, "score": float | None}.
        self._saved: list[dict[str, Any]] = []
        self._last_saved_step: int | None = None
        self._clock: Callable[[], float] = time.monotonic  # seconds; replaceable in tests
        self._last_save_time = self._clock()
        self._time_due = StepFlag()  # rank 0's clock says "save", agreed by every rank
        self._warned_missing_monitor = False
        self.last_model_path = ""

    # -- what other code reads ------------------------------------------------------------------
    @property
    def best_model_path(self) -> str:
        """Path of the kept checkpoint with the best `monitor` value ("" if none has one)."""
        best = self._ranked()
        return best[0]["path"] if best else ""

    @property
    def best_model_score(self) -> float | None:
        """The best `monitor` value among kept checkpoints (None if none has one)."""
        best = self._ranked()
        return best[0]["score"] if best else None

    @property
    def saved_paths(self) -> list[str]:
        """Paths of the checkpoints this callback keeps, oldest first."""
        return [entry["path"] for entry in self._saved]

    # -- hooks ------------------------------------------------------------------------------------
    def setup(self, trainer: Trainer, module: NanoModule, stage: str) -> None:
        self.dirpath = self._user_dirpath or trainer.checkpoint_dir
        self._last_save_time = self._clock()
        self._time_due = StepFlag(self._time_due.defer_reads)  # nothing left from a last run
        if stage == "fit":
            # An unwritable folder is an error now, not after the first hours of training.
            error = attempt(lambda: self._check_writable(self.dirpath))[1]
            raise_first_failure(trainer.strategy, error, "checking the checkpoint folder")

    @staticmethod
    def _check_writable(folder: Path) -> None:
        try:
            check_writable(folder)
        except OSError as err:  # its message names the folder and the fix: a user error
            raise RunFilesError(str(err)) from err

    def on_train_batch_end(
        self,
        trainer: Trainer,
        module: NanoModule,
        outputs: StepOutput,
        batch: list[Any],
        batch_idx: int,
    ) -> None:
        step = trainer.global_step
        due = self.every_n_steps is not None and step % self.every_n_steps == 0
        if self.every_n_minutes is not None:
            # Clocks differ between ranks: rank 0 decides, so that every rank saves together.
            # It posts the step at which its clock said "save"; on GPUs that is read a step
            # late, and a save since that step (e.g. the one it caused) makes it moot.
            late = self._clock() - self._last_save_time >= 60 * self.every_n_minutes
            mine = step if late and trainer.is_global_zero else 0
            device = trainer.strategy.root_device
            said = self._time_due.agree(mine, trainer.world_size, device)
            due = due or said > (self._last_saved_step or 0)
        if due and self._last_saved_step != step:
            self.save_now(trainer)

    def on_train_end(self, trainer: Trainer, module: NanoModule) -> None:
        if self.save_last and self._last_saved_step != trainer.global_step:
            self.save_now(trainer)
        self.finish_pending(trainer)

    def teardown(self, trainer: Trainer, module: NanoModule, stage: str) -> None:
        # After an exception no collective is safe: let the writer finish, commit nothing (its
        # temporary directory is removed by the next successful save).
        if self._pending is not None:
            self._pending[0].wait_written()
            self._saved, self._last_saved_step, self.last_model_path = self._pending[2]
            self._pending = None

    def on_exception(self, trainer: Trainer, module: NanoModule, exception: BaseException) -> None:
        if not self.save_on_exception or not trainer.training:
            return
        try:
            self.save_now(trainer, tag="exception")
        except Exception as exc:  # noqa: BLE001 - never hide the exception being handled
            warnings.warn(f"ModelCheckpoint could not save on exception: {exc}", stacklevel=2)

    # -- saving -----------------------------------------------------------------------------------
    def save_now(self, trainer: Trainer, tag: str | None = None) -> Path:
        """Save a checkpoint of the current state now and apply the retention rules.

        Other callbacks call this to stop with a checkpoint (e.g. a NaN guard). Call it on every
        rank at the same step. The directory is `step-XXXXXXXX` or `step-XXXXXXXX-<tag>`.

        Returns:
            The checkpoint directory.
        """
        if self.dirpath is None:
            self.dirpath = self._user_dirpath or trainer.checkpoint_dir
        step = trainer.global_step
        name = f"step-{step:08d}" + (f"-{tag}" if tag else "")
        path = self.dirpath / name
        nonfinite = gather_nonfinite(trainer)
        entry = {"path": str(path), "step": step, "score": self._score(trainer)}
        entry["finite"] = not nonfinite
        if nonfinite and trainer.is_global_zero:
            log.warning(
                "ModelCheckpoint: the state saved in %s is non-finite (%s); it is marked so in "
                "its meta.json, and the newest finite checkpoint is kept whatever save_top_k says",
                path,
                ", ".join(nonfinite),
            )
        self.finish_pending(trainer)  # the next save waits for the previous one
        before = (list(self._saved), self._last_saved_step, self.last_model_path)
        candidates = [e for e in self._saved if e["path"] != entry["path"]] + [entry]
        # Decide retention before saving, so that the state stored in the checkpoint already
        # lists exactly the checkpoints that will exist after it.
        self._saved = self._retained(candidates)
        self._last_saved_step, self.last_model_path = step, str(path)
        kept = {e["path"] for e in self._saved}
        dropped = [Path(e["path"]) for e in candidates if e["path"] not in kept]
        try:
            if self.async_save:
                self._pending = (PendingSave(trainer, path), dropped, before)
            else:
                trainer.save_checkpoint(path)
        except BaseException:
            self._saved, self._last_saved_step, self.last_model_path = before
            raise
        self._last_save_time = self._clock()
        if not self.async_save:
            self._delete(trainer, dropped)
        return path

    def finish_pending(self, trainer: Trainer) -> None:
        """Commit the asynchronous save still being written, if any (collective: every rank
        calls it at the same point), then apply its retention."""
        if self._pending is None:
            return
        pending, dropped, before = self._pending
        self._pending = None
        try:
            pending.finish()
        except BaseException:
            self._saved, self._last_saved_step, self.last_model_path = before
            raise
        self._delete(trainer, dropped)

    def _retained(self, entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
        keep = {entries[-1]["path"]}  # the newest: `last` points at it
        # Never lose the last good state: a run whose loss turned NaN keeps saving, and its
        # NaN checkpoints must not push the newest finite one out.
        finite = [e for e in entries if e.get("finite", True)]
        keep.update(e["path"] for e in finite[-1:])
        recent = entries if self.save_top_k == -1 else entries[-self.save_top_k :]
        keep.update(e["path"] for e in recent)
        keep.update(e["path"] for e in self._ranked(entries)[: self.keep_best_k])
        return [e for e in entries if e["path"] in keep]

    def _ranked(self, entries: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
        scored = [e for e in (self._saved if entries is None else entries) if _finite(e["score"])]
        sign = 1.0 if self.mode == "min" else -1.0
        # Best first; among equal scores the newer checkpoint wins.
        order = sorted(enumerate(scored), key=lambda ie: (sign * ie[1]["score"], -ie[0]))
        return [e for _, e in order]

    def _score(self, trainer: Trainer) -> float | None:
        if self.monitor is None:
            return None
        value = trainer.callback_metrics.get(self.monitor)
        if value is None:
            if not self._warned_missing_monitor:
                available = sorted(trainer.callback_metrics)
                warnings.warn(
                    f"ModelCheckpoint(monitor={self.monitor!r}): no such metric yet (have "
                    f"{available}); checkpoints without it are kept only by recency",
                    stacklevel=3,
                )
                self._warned_missing_monitor = True
            return None
        return float(value)

    def _delete(self, trainer: Trainer, paths: list[Path]) -> None:
        # The one rank-0 side effect of this callback: dropping checkpoints retention let go.
        if trainer.is_global_zero:
            for path in paths:
                shutil.rmtree(path, ignore_errors=True)

    # -- state --------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Kept checkpoints (paths, steps, scores) and the last saved step; plain values."""
        return {
            "saved": [dict(e) for e in self._saved],
            "last_saved_step": self._last_saved_step,
            "last_model_path": self.last_model_path,
            "monitor": self.monitor,
            "mode": self.mode,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore `state_dict`; checkpoints deleted since then are forgotten."""
        if state_dict.get("monitor") != self.monitor or state_dict.get("mode") != self.mode:
            warnings.warn(
                f"ModelCheckpoint resumed with monitor={self.monitor!r}, mode={self.mode!r}; the "
                f"checkpoint ranked by {state_dict.get('monitor')!r} ({state_dict.get('mode')}): "
                "earlier scores are ignored",
                stacklevel=2,
            )
            saved = [{**e, "score": None} for e in state_dict["saved"]]
        else:
            saved = [dict(e) for e in state_dict["saved"]]
        self._saved = [e for e in saved if Path(e["path"]).is_dir()]
        self._last_saved_step = state_dict.get("last_saved_step")
        self.last_model_path = state_dict.get("last_model_path", "")


def _finite(score: float | None) -> bool:
    return score is not None and math.isfinite(score)


def _check_options(
    every_n_steps: int | None,
    every_n_minutes: float | None,
    save_top_k: int,
    mode: str,
    keep_best_k: int | None,
    monitor: str | None,
) -> None:
    if every_n_steps is not None and (not isinstance(every_n_steps, int) or every_n_steps <= 0):
        raise ValueError(f"every_n_steps must be a positive integer or None, got {every_n_steps!r}")
    if every_n_minutes is not None and not every_n_minutes > 0:
        raise ValueError(f"every_n_minutes must be positive or None, got {every_n_minutes!r}")
    if not isinstance(save_top_k, int) or (save_top_k != -1 and save_top_k < 1):
        raise ValueError(
            f"save_top_k must be -1 (keep all) or >= 1, got {save_top_k!r}; to save nothing, "
            "leave ModelCheckpoint out of the callbacks"
        )
    if mode not in ("min", "max"):
        raise ValueError(f"mode must be 'min' or 'max', got {mode!r}")
    if keep_best_k is not None and (not isinstance(keep_best_k, int) or keep_best_k < 0):
        raise ValueError(f"keep_best_k must be a non-negative integer, got {keep_best_k!r}")
    if keep_best_k and monitor is None:
        raise ValueError(
            f"keep_best_k={keep_best_k} needs a metric to rank by: set monitor, e.g. "
            "monitor='val/loss'"
        )
