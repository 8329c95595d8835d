"""ModelCheckpoint: when to save checkpoints and which ones to keep, with Lightning's arguments."""

from __future__ import annotations

import logging
import math
import shutil
import time
import warnings
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from nanotrain.callbacks.base import Callback
from nanotrain.callbacks.checkpoint_names import CheckpointNames
from nanotrain.callbacks.checkpoint_options import (
    check_filename,
    check_options,
    is_int,
    merge_interval,
    merge_steps,
)
from nanotrain.callbacks.checkpoint_retention import CheckpointRetention
from nanotrain.checkpoint.async_save import PendingSave
from nanotrain.checkpoint.collective import attempt, raise_first_failure
from nanotrain.checkpoint.commit import check_writable
from nanotrain.checkpoint.files import check_resumable
from nanotrain.checkpoint.health import gather_nonfinite
from nanotrain.checkpoint.save_load import write_weights_only
from nanotrain.checkpoint.step_flag import StepFlag
from nanotrain.runtime.run_files import RunFilesError

if TYPE_CHECKING:
    from nanotrain.module import NanoModule
    from nanotrain.strategies.base import StepOutput
    from nanotrain.trainer import Trainer

log = logging.getLogger(__name__)


class ModelCheckpoint(CheckpointNames, CheckpointRetention, Callback):
    """Save checkpoints on a cadence and at the end of training; keep the `save_top_k` best.

    Lightning's `ModelCheckpoint` arguments with Lightning's meaning (docs/checkpointing.md
    lists the differences), plus nanotrain's own (`every_n_steps`, `every_n_minutes`,
    `save_on_exception`, `keep_best_k`, `async_save`). A checkpoint is a directory
    `<dirpath>/<name>/` written by `trainer.save_checkpoint` (atomic); `<dirpath>/last` names the
    newest one, which retention never deletes, nor the newest one whose state is finite. Every
    rank runs this callback and they all decide alike: step and epoch cadences are the same
    everywhere, the time cadence is decided on rank 0 and broadcast, and `monitor` is read from
    `trainer.callback_metrics` (already reduced across ranks).

    Args:
        dirpath: where checkpoints go; None means `trainer.checkpoint_dir`
            (`<run_dir>/checkpoints`).
        filename: Lightning's name template, e.g. "{epoch}-{step}-{val_loss:.2f}" (with
            `auto_insert_metric_name`: "epoch=1-step=20-val_loss=0.53"); it names the checkpoint
            directory (no ".ckpt"). None: nanotrain's `step-XXXXXXXX`.
        monitor: a key of `trainer.callback_metrics` (e.g. "val/loss") to rank checkpoints by.
        verbose: log (rank 0) each monitored save and whether it made the top k.
        save_last: also save when training ends (unless that step was just saved), and write a
            checkpoint at every trigger even when it is not among the top k (Lightning's
            `last.ckpt`; nanotrain's `last` pointer always names the newest checkpoint).
            "link" is the same as True.
        save_top_k: with `monitor`: keep the k best by `monitor` (-1: all, 0: none). Without:
            keep the k newest (-1: all). Default: 1 with a `monitor` (Lightning's), -1
            without (nanotrain's: nothing is deleted unless asked).
        save_on_exception: save when an exception escapes the training loop, as
            `<name>-exception`. Safe only when every rank sees the exception (a save is
            collective); a one-rank failure would leave the others waiting.
        save_weights_only: the cadence, last and exception saves hold the model weights only
            (plus the config that `load_from_checkpoint` and `nanotrain export` need); `fit`
            refuses to resume from one. `save_now` (preemption, other callbacks) always saves
            the whole state.
        mode: "min" or "max": whether a lower or a higher `monitor` value is better.
        auto_insert_metric_name: as Lightning: "{epoch}" in `filename` becomes "epoch=3".
        every_n_train_steps: Lightning's name for `every_n_steps` (0 or None: off).
        train_time_interval: Lightning's name for `every_n_minutes`, a `datetime.timedelta`.
        every_n_epochs: save at the end of every n-th training epoch (0: off). When no cadence
            is given at all, 1 (as Lightning).
        save_on_train_epoch_end: save the epoch cadence at the end of the training epoch
            (True) or at the end of validation (False); None decides as Lightning: at the end
            of validation when it runs mid-epoch (`val_check_interval`) or not every epoch.
        enable_version_counter: with a `filename` template, a name that exists already gets
            "-v1", "-v2", ... (False: it is overwritten).
        every_n_steps: save after every this many optimizer steps (None: no step cadence).
        every_n_minutes: save when this many minutes of wall time passed since the last save
            (or since training started); None disables it.
        keep_best_k: nanotrain's older spelling: keep at least this many of the best by
            `monitor` (it raises `save_top_k` to it).
        async_save: write checkpoints in a background thread: the loop waits only while the
            state is copied to host memory; the save is committed (and `last` moved) when the
            next save starts or training ends, whichever comes first.

    At the start of `fit` the checkpoint folder is checked to be writable (nothing is left
    behind): a PermissionError / ValueError then, instead of at the first save.

    Raises:
        ValueError / TypeError: at construction, for an argument out of range or of the wrong
            type, two spellings of one cadence that disagree, a `filename` that would not
            make one directory name, or `save_weights_only` with `async_save`; at the start of
            `fit`, when resuming a weights-only checkpoint; at a save, when `monitor` is not in
            `trainer.callback_metrics`.
    """

    def __init__(
        self,
        dirpath: str | Path | None = None,
        filename: str | None = None,
        monitor: str | None = None,
        verbose: bool = False,
        save_last: bool | str | None = True,
        save_top_k: int | None = None,
        save_on_exception: bool = False,
        save_weights_only: bool = False,
        mode: str = "min",
        auto_insert_metric_name: bool = True,
        every_n_train_steps: int | None = None,
        train_time_interval: timedelta | None = None,
        every_n_epochs: int | None = None,
        save_on_train_epoch_end: bool | None = None,
        enable_version_counter: bool = True,
        *,
        every_n_steps: int | None = None,
        every_n_minutes: float | None = None,
        keep_best_k: int | None = None,
        async_save: bool = False,
    ) -> None:
        check_filename(filename, auto_insert_metric_name)
        steps = merge_steps(every_n_steps, every_n_train_steps)
        interval_s = merge_interval(every_n_minutes, train_time_interval)
        if every_n_epochs is not None and (not is_int(every_n_epochs) or every_n_epochs < 0):
            raise ValueError(
                f"every_n_epochs must be an integer >= 0 (0: no epoch cadence) or None, got "
                f"{every_n_epochs!r}"
            )
        if save_top_k is None:
            save_top_k = 1 if monitor is not None else -1
        check_options(save_top_k, mode, keep_best_k, monitor, save_last)
        if keep_best_k and save_top_k != -1:  # nanotrain's older spelling of a larger top k
            save_top_k = max(save_top_k, keep_best_k)
        if save_weights_only and async_save:
            raise ValueError(
                "save_weights_only=True cannot be combined with async_save=True: a weights-only "
                "checkpoint is written synchronously; drop one of them"
            )
        self._user_dirpath = Path(dirpath) if dirpath is not None else None
        self.dirpath = self._user_dirpath  # resolved per run in `setup`
        self.filename = filename or None
        self.monitor = monitor
        self.verbose = verbose
        self.save_last = save_last
        self.save_top_k = save_top_k
        self.save_on_exception = save_on_exception
        self.save_weights_only = save_weights_only
        self.mode = mode
        self.auto_insert_metric_name = auto_insert_metric_name
        self.enable_version_counter = enable_version_counter
        self._save_on_train_epoch_end = save_on_train_epoch_end
        self.every_n_steps = steps
        self._interval_s = interval_s
        self.every_n_minutes = None if interval_s is None else interval_s / 60
        if every_n_epochs is None:  # Lightning: no cadence at all means every epoch
            every_n_epochs = 1 if steps is None and interval_s is None else 0
        self._every_n_epochs = every_n_epochs
        self.keep_best_k = keep_best_k or 0
        self.async_save = async_save
        #: the final save of fit competes for the top k (set on the Trainer's default callback)
        self.final_save_competes = False
        # An asynchronous save still being written: (PendingSave, paths to delete once it is
        # committed, the state to restore if it fails).
        self._pending: tuple[Any, list[Path], dict[str, Any]] | None = None
        # Checkpoints this callback saved and still keeps, oldest first: {"path": str,
        # "step": int, "score": float | None, "finite": bool, "candidate": bool}; candidates
        # are the cadence saves that compete for the top k.
        self._saved: list[dict[str, Any]] = []
        self._last_saved_step: int | None = None
        self._last_trigger_step = 0  # a cadence save not written (not among the top k)
        self._defer_save = False  # a step/time save waits for validation to log `monitor`
        self._save_kind = "now"  # which kind of save `save_now` is making (see `_save_as`)
        self._clock: Callable[[], float] = time.monotonic  # seconds; replaceable in tests
        self._last_save_time = self._clock()
        self._time_due = StepFlag()  # rank 0's clock says "save", agreed by every rank
        # Lightning's attributes (best_k_models: path -> score, in the order they entered)
        self.best_k_models: dict[str, torch.Tensor] = {}
        self.kth_best_model_path = ""
        self.kth_value = torch.tensor(math.inf if mode == "min" else -math.inf)
        self.best_model_path = ""
        self.best_model_score: torch.Tensor | None = None
        self.current_score: torch.Tensor | None = None
        self.last_model_path = ""

    # -- what other code reads ------------------------------------------------------------------
    @property
    def every_n_epochs(self) -> int:
        """The epoch cadence in use (0: none), as Lightning's property."""
        return self._every_n_epochs

    @property
    def saved_paths(self) -> list[str]:
        """Paths of the checkpoints this callback keeps, oldest first."""
        return [entry["path"] for entry in self._saved]

    # -- hooks ------------------------------------------------------------------------------------
    def setup(self, trainer: Trainer, module: NanoModule, stage: str) -> None:
        self.dirpath = self._user_dirpath or trainer.checkpoint_dir
        self._last_save_time = self._clock()
        self._time_due = StepFlag(self._time_due.defer_reads)  # nothing left from a last run
        self._defer_save = False
        if stage == "fit":
            # An unwritable folder is an error now, not after the first hours of training.
            error = attempt(lambda: self._check_writable(self.dirpath))[1]
            raise_first_failure(trainer.strategy, error, "checking the checkpoint folder")
            resumed = getattr(trainer, "_resume_path", None)  # chosen before setup runs
            if resumed is not None:
                check_resumable(Path(resumed))

    @staticmethod
    def _check_writable(folder: Path) -> None:
        try:
            check_writable(folder)
        except OSError as err:  # its message names the folder and the fix: a user error
            raise RunFilesError(str(err)) from err

    def on_train_step_end(
        self,
        trainer: Trainer,
        module: NanoModule,
        outputs: StepOutput,
        microbatches: list[Any],
        step_idx: int,
    ) -> None:
        step = trainer.global_step
        due = bool(self.every_n_steps) and step % self.every_n_steps == 0
        if self._interval_s is not None:
            # Clocks differ between ranks: rank 0 decides, so that every rank saves together.
            # It posts the step at which its clock said "save"; on GPUs that is read a step
            # late, and a save since that step (e.g. the one it caused) makes it moot.
            late = self._clock() - self._last_save_time >= self._interval_s
            mine = step if late and trainer.is_global_zero else 0
            device = trainer.strategy.root_device
            said = self._time_due.agree(mine, trainer.world_size, device)
            due = due or said > max(self._last_saved_step or 0, self._last_trigger_step)
        if not due or self._skip(trainer):
            return
        if self.monitor is not None and self.save_top_k != 0:
            if self.monitor not in trainer.callback_metrics:
                if not _has_validation(trainer):
                    raise self._missing_monitor(trainer)
                # As Lightning: a metric that validation logs is ranked once validation ran.
                self._defer_save = True
                return
            if self._validation_follows(trainer):
                # As Lightning: the epoch's validation runs right after this last batch; rank
                # this checkpoint by its fresh value rather than by the previous one.
                self._defer_save = True
                return
        self._save_trigger(trainer)

    def on_train_epoch_end(self, trainer: Trainer, module: NanoModule) -> None:
        if self._saves_on_train_epoch_end(trainer) and self._epoch_due(trainer):
            self._save_trigger(trainer)

    def on_validation_end(self, trainer: Trainer, module: NanoModule) -> None:
        if not trainer.is_fitting or trainer.validation_is_extra:
            # `validate` alone saves nothing (as Lightning outside fitting), and a validation
            # lightning.Trainer would not run (fit's final one) does not rank checkpoints
            return
        if self._skip(trainer):
            return
        if self._defer_save:
            self._defer_save = False
            self._save_trigger(trainer)
            return
        if not self._saves_on_train_epoch_end(trainer) and self._epoch_due(trainer):
            self._save_trigger(trainer)

    def on_train_end(self, trainer: Trainer, module: NanoModule) -> None:
        if self.save_last and self._last_saved_step != trainer.global_step:
            # the Trainer's default callback (a step cadence, where Lightning's default saves
            # every epoch) counts its final save among the newest top k, so that
            # ckpt_path="best" finds the trained state as after Lightning's default
            final = "candidate" if self.final_save_competes and self.monitor is None else "last"
            self._save_as(trainer, final)
        self.finish_pending(trainer)

    def teardown(self, trainer: Trainer, module: NanoModule, stage: str) -> None:
        self._defer_save = False
        # After an exception no collective is safe: let the writer finish, commit nothing (its
        # temporary directory is removed by the next successful save).
        if self._pending is not None:
            self._pending[0].wait_written()
            self._restore(self._pending[2])
            self._pending = None

    def on_exception(self, trainer: Trainer, module: NanoModule, exception: BaseException) -> None:
        if not self.save_on_exception or not trainer.is_fitting:
            return
        try:
            self._save_as(trainer, "last", tag="exception")
        except Exception as exc:  # noqa: BLE001 - never hide the exception being handled
            warnings.warn(f"ModelCheckpoint could not save on exception: {exc}", stacklevel=2)

    # -- when ---------------------------------------------------------------------------------
    def _skip(self, trainer: Trainer) -> bool:
        # As Lightning: nothing to save before the first step, nor twice at one step.
        step = trainer.global_step
        return step in (0, self._last_saved_step, self._last_trigger_step)

    def _epoch_due(self, trainer: Trainer) -> bool:
        n = self._every_n_epochs
        return n >= 1 and (trainer.current_epoch + 1) % n == 0 and not self._skip(trainer)

    def _saves_on_train_epoch_end(self, trainer: Trainer) -> bool:
        """Lightning's `_should_save_on_train_epoch_end`, with nanotrain's settings."""
        if self._save_on_train_epoch_end is not None:
            return self._save_on_train_epoch_end
        s = trainer.settings
        if s.check_val_every_n_epoch != 1:
            return False
        if not _has_validation(trainer):
            return True
        return s.val_check_interval is None  # validation only at epoch ends

    def _validation_follows(self, trainer: Trainer) -> bool:
        st, s = trainer.state, trainer.settings
        if self._saves_on_train_epoch_end(trainer) or st.steps_in_epoch != st.steps_per_epoch:
            return False
        every = s.check_val_every_n_epoch
        return _has_validation(trainer) and bool(every) and (st.epoch + 1) % every == 0

    # -- saving -----------------------------------------------------------------------------------
    def save_now(self, trainer: Trainer, tag: str | None = None) -> Path | None:
        """Save a checkpoint of the whole current state now and apply the retention rules.

        Other callbacks call this to stop with a checkpoint (e.g. a NaN guard, a preemption);
        such a save holds the whole state (whatever `save_weights_only` says) and does not
        compete for the top k. Call it on every rank at the same step. The directory is the
        usual name, with `-<tag>` appended when a tag is given. Every save of this callback
        goes through this method (its own cadence, last and exception saves too), so a
        subclass may wrap it.

        Returns:
            The checkpoint directory; None only for a cadence save that did not make the
            top k and was not written (with `save_last` off, as Lightning).
        """
        kind, self._save_kind = self._save_kind, "now"  # what called: see `_save_as`
        return self._save(trainer, tag=tag, candidate=kind == "candidate", full=kind == "now")

    def _save_as(self, trainer: Trainer, kind: str, tag: str | None = None) -> None:
        # "candidate": a cadence save competing for the top k; "last": the end-of-training or
        # exception save (weights only when asked), through `save_now` for subclasses.
        if getattr(trainer, "fast_dev_run", False):
            return  # as Lightning: a dev run saves no checkpoint
        self._save_kind = kind
        try:
            self.save_now(trainer, tag)
        finally:
            self._save_kind = "now"

    def _save_trigger(self, trainer: Trainer) -> None:
        """A save of the step/time/epoch cadence: Lightning's top-k save plus its last.ckpt."""
        if self.save_top_k == 0:
            if self.save_last:  # only Lightning's last.ckpt is written at a trigger
                self._save_as(trainer, "last")
            return
        if self.monitor is not None and self.monitor not in trainer.callback_metrics:
            raise self._missing_monitor(trainer)
        self._save_as(trainer, "candidate")

    def _save(
        self,
        trainer: Trainer,
        tag: str | None = None,
        candidate: bool = False,
        full: bool = False,
    ) -> Path | None:
        if self.dirpath is None:
            self.dirpath = self._user_dirpath or trainer.checkpoint_dir
        self.finish_pending(trainer)  # the next save waits for the previous one
        step = trainer.global_step
        metrics = self._monitor_candidates(trainer)
        current = _score(metrics.get(self.monitor)) if self.monitor is not None else None
        evicted: str | None = None
        enters = candidate and self.monitor is not None and self._enters_top_k(current)
        if candidate and self.monitor is not None:
            if not enters:
                self._log_verbose(
                    trainer,
                    f"Epoch {trainer.current_epoch}, global step {step}: {self.monitor!r} was "
                    f"not in top {self.save_top_k}",
                )
                if not self.save_last:
                    # as Lightning, which writes only a top-k checkpoint then; the cadence
                    # (its clock included) still counts this as its save
                    self._last_trigger_step, self._last_save_time = step, self._clock()
                    return None
                # still written (Lightning's last.ckpt): the newest state, which `last` names
            elif len(self.best_k_models) == self._k() and self._k() > 0:
                evicted = self.kth_best_model_path
        elif candidate:
            evicted = self.best_model_path or None  # Lightning may reuse the latest's name
        nonfinite = gather_nonfinite(trainer)
        # Never write a non-finite state over the name of a kept (finite) one.
        path = self._path(trainer, metrics, tag, None if nonfinite else evicted)
        if nonfinite and trainer.is_global_zero:
            log.warning(
                "ModelCheckpoint: the state saved in %s is non-finite (%s); it is marked so in "
                "its meta.json, and the newest finite checkpoint is kept whatever save_top_k says",
                path,
                ", ".join(nonfinite),
            )
        before = self._state()
        score = None if current is None else float(current)
        if enters:
            self._update_best(trainer, str(path), current, evicted)
            score = float(self.best_k_models[str(path)])  # NaN is ranked as the worst
        elif candidate and self.monitor is None:
            self.best_model_path = str(path)  # as Lightning: the newest top-k checkpoint
        entry = {
            "path": str(path),
            "step": step,
            "score": score,
            "finite": not nonfinite,
            "candidate": candidate,
        }
        entries = [e for e in self._saved if e["path"] != entry["path"]] + [entry]
        # Decide retention before saving, so that the state stored in the checkpoint already
        # lists exactly the checkpoints that will exist after it.
        self._saved = self._retained(entries)
        self._last_saved_step, self.last_model_path = step, str(path)
        kept = {e["path"] for e in self._saved}
        dropped = [Path(e["path"]) for e in entries if e["path"] not in kept]
        try:
            if self.save_weights_only and not full:
                write_weights_only(trainer, path, {self.state_key: self.state_dict()})
            elif self.async_save:
                self._pending = (PendingSave(trainer, path), dropped, before)
            else:
                trainer.save_checkpoint(path)
        except BaseException:
            self._restore(before)
            raise
        self._last_save_time = self._clock()
        if self._pending is None:
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
            self._restore(before)
            raise
        self._delete(trainer, dropped)

    # -- messages -------------------------------------------------------------------------------
    def _missing_monitor(self, trainer: Trainer) -> ValueError:
        logged = sorted(trainer.callback_metrics)
        return ValueError(
            f"ModelCheckpoint(monitor={self.monitor!r}) found no {self.monitor!r} in "
            f"trainer.callback_metrics at step {trainer.global_step} (logged: {logged}); log it "
            f"with self.log({self.monitor!r}, value) in validation_step or training_step "
            "(training values reach callback_metrics on logging steps, log_every_n_steps), "
            "or pass monitor=None to keep the newest checkpoints"
        )

    def _log_verbose(self, trainer: Trainer, message: str) -> None:
        if self.verbose and trainer.is_global_zero:
            log.info(message)

    def _delete(self, trainer: Trainer, paths: list[Path]) -> None:
        # The one rank-0 side effect of this callback: dropping checkpoints retention let go.
        if trainer.is_global_zero:
            for path in paths:
                shutil.rmtree(path, ignore_errors=True)


# -- helpers ------------------------------------------------------------------------------------
def _has_validation(trainer: Trainer) -> bool:
    return sum(trainer.num_val_batches) > 0


def _score(value: Any) -> torch.Tensor | None:
    if value is None:
        return None
    return torch.as_tensor(value).detach().float().cpu().squeeze()
