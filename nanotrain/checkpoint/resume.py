"""Which checkpoint a run resumes and which run directory it continues, decided before
anything is written.

`ckpt_path="last"` means the newest complete checkpoint of the experiment
(`<default_root_dir>/<name>/version_*/checkpoints/`), across versions, so that one command
serves both the first start and every restart: when there is none yet, the run starts fresh
(with a log line). Checkpoints marked non-finite are passed over for the newest finite one
when there is one.

`ckpt_path="best"` means, as in Lightning, the `best_model_path` of the Trainer's
`ModelCheckpoint`; when that callback has saved nothing yet in this process, the best
checkpoint the newest run of the experiment recorded (its ModelCheckpoint's state, kept in
every checkpoint), so that a new process can validate or test the best one too.
"""

from __future__ import annotations

import logging
import re
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from nanotrain.checkpoint import commit as _commit
from nanotrain.checkpoint import files
from nanotrain.checkpoint.lightning_ckpt import is_lightning_file

if TYPE_CHECKING:
    from nanotrain.trainer import Trainer

log = logging.getLogger(__name__)

_VERSION = re.compile(r"^version_(\d+)$")
LAST = _commit.LAST_POINTER
BEST = "best"


class ResumePlan(NamedTuple):
    """Where a fit/validate runs and what it resumes: `run_dir` (not created yet) and the
    checkpoint directory `checkpoint` (None: start fresh)."""

    run_dir: Path
    checkpoint: Path | None


def plan_resume(
    experiment_dir: Path, version: int | None, ckpt_path: Any, callbacks: Any = None
) -> ResumePlan:
    """Decide the run directory and the checkpoint for `ckpt_path`, reading only.

    - None: a fresh run in `version_<version>` (None: the next free number).
    - "last": the newest complete checkpoint in the `dirpath` of a ModelCheckpoint among
      `callbacks`, else in the experiment's versions (only in `version_<version>` when a
      version is given), continuing its run directory; none found → a fresh run, logged.
    - "best": the best checkpoint of the run's ModelCheckpoint (see `find_best`; `callbacks`
      are the Trainer's), continuing its run directory.
    - a path: that checkpoint (see `resolve_checkpoint_path`); a checkpoint inside a run
      directory continues that run directory; a Lightning `.ckpt` file starts a new one.

    Raises:
        FileNotFoundError: an explicit path that does not exist or holds no checkpoint.
        ValueError: a corrupt `last` pointer; "best" when no best checkpoint is known.
    """
    fresh = experiment_dir / f"version_{version if version is not None else _next(experiment_dir)}"
    if ckpt_path is None:
        return ResumePlan(fresh, None)
    if str(ckpt_path) == BEST:
        runs = [run / "checkpoints" for run in _versions_newest_first(experiment_dir, version)]
        ckpt = find_best(callbacks, runs)
        resumed = _run_dir_of(ckpt)
        return ResumePlan(resumed if resumed is not None else fresh, ckpt)
    if str(ckpt_path) == LAST:
        for folder in _saver_dirs(callbacks):  # a ModelCheckpoint's own dirpath first
            found = find_last(folder)
            if found is not None:
                resumed = _run_dir_of(found)
                return ResumePlan(resumed if resumed is not None else fresh, found)
        for run_dir in _versions_newest_first(experiment_dir, version):
            found = find_last(run_dir / "checkpoints")
            if found is not None:
                return ResumePlan(run_dir, found)
        log.info(
            "ckpt_path='last': no complete checkpoint in %s yet; starting a new run in %s",
            experiment_dir,
            fresh,
        )
        return ResumePlan(fresh, None)
    ckpt = resolve_path(Path(ckpt_path))
    if is_lightning_file(ckpt):  # lightning.Trainer's run folder is not continued
        return ResumePlan(fresh, ckpt)
    resumed = _run_dir_of(ckpt)
    return ResumePlan(resumed if resumed is not None else fresh, ckpt)


def resolve_checkpoint_path(trainer: Trainer, ckpt_path: str | Path) -> Path:
    """The checkpoint directory `ckpt_path` stands for.

    `"last"` is the newest complete checkpoint in `trainer.checkpoint_dir` (the run directory
    the trainer resumed); `"best"` the best checkpoint of the trainer's ModelCheckpoint (see
    `find_best`). A folder of checkpoints, or its `last` file, resolves the same way as
    "last"; any other path is taken as a checkpoint directory.

    Raises:
        FileNotFoundError: the path does not exist, or a folder holds no complete checkpoint.
        ValueError: "best" when no best checkpoint is known.
    """
    if str(ckpt_path) == LAST:
        for folder in _saver_dirs(trainer.callbacks):
            found = find_last(folder)
            if found is not None:
                return found
        return _require(find_last(trainer.checkpoint_dir), trainer.checkpoint_dir)
    if str(ckpt_path) == BEST:
        return find_best(trainer.callbacks, [trainer.checkpoint_dir])
    return resolve_path(Path(ckpt_path))


def _saver_dirs(callbacks: Any) -> list[Path]:
    """The folders ModelCheckpoints among `callbacks` were given (`dirpath`), in order: where
    `ckpt_path="last"` looks first, as Lightning does."""
    found = []
    for cb in callbacks or []:
        folder = getattr(cb, "_user_dirpath", None)  # a ModelCheckpoint's own dirpath
        if folder is not None and hasattr(cb, "last_model_path"):
            found.append(Path(folder))
    return found


def find_best(callbacks: Any, checkpoint_dirs: list[Path]) -> Path:
    """The checkpoint `ckpt_path="best"` stands for.

    As Lightning: the `best_model_path` of the first ModelCheckpoint in `callbacks` (a
    warning when there are several), i.e. the best by its `monitor`, or its newest top-k
    checkpoint without one. When that callback has saved nothing in this process (a new
    Trainer, e.g. `nanotrain validate --ckpt_path best`), the best checkpoint recorded in the
    newest checkpoint of its `dirpath`, else of the first of `checkpoint_dirs` (the
    experiment's runs, newest first) that holds a checkpoint.

    Raises:
        ValueError: no best checkpoint is known, or the recorded one no longer exists.
    """
    # a ModelCheckpoint is known by its `best_model_path` (this room does not import callbacks)
    savers = [cb for cb in callbacks or [] if hasattr(cb, "best_model_path")]
    if len(savers) > 1:
        warnings.warn(
            'ckpt_path="best" with several ModelCheckpoint callbacks: the first one\'s best '
            "checkpoint is used (as Lightning)",
            stacklevel=3,
        )
    saver = savers[0] if savers else None
    if saver is not None and saver.best_model_path:
        return _complete_best(Path(saver.best_model_path), "ModelCheckpoint.best_model_path")
    folders = list(checkpoint_dirs)
    if saver is not None and saver.dirpath is not None:
        folders = [Path(saver.dirpath)]  # a custom dirpath, or this Trainer's last run
    # the newest run that saved a checkpoint decides (an older run's best is not this one's)
    saved = next((f for f in folders if _newest(f) is not None), None)
    recorded = recorded_best(saved) if saved is not None else None
    if recorded is not None:
        return _complete_best(recorded, f"the ModelCheckpoint state saved in {saved}")
    where = (
        f"the newest checkpoint in {saved} records none"
        if saved is not None
        else "no run of this experiment has saved a checkpoint"
    )
    raise ValueError(
        'ckpt_path="best": no best checkpoint is known: this Trainer\'s ModelCheckpoint has '
        f"saved none, and {where} (ModelCheckpoint records its best in every checkpoint it "
        "saves, once it saved a top-k checkpoint). Pass a checkpoint path, or "
        'ckpt_path="last"'
    )


def recorded_best(checkpoints_dir: Path) -> Path | None:
    """The best checkpoint that the ModelCheckpoint state in the newest checkpoint of
    `checkpoints_dir` records (its first ModelCheckpoint's), or None when there is none."""
    newest = _newest(checkpoints_dir)
    if newest is None:
        return None
    try:
        state = files.read_torch(newest / files.TRAINER_STATE_FILE)
    except (OSError, ValueError):
        return None
    for value in (state.get("callbacks") or {}).values():
        # a ModelCheckpoint's (or a subclass's, under its own state_key) state
        if isinstance(value, dict) and "best_model_path" in value and "saved" in value:
            best = value.get("best_model_path")
            if not best:
                return None
            best = Path(best)
            # the run directory may have moved since: look for the name next to `newest`
            if not (best / files.META_FILE).is_file() and (newest.parent / best.name).is_dir():
                best = newest.parent / best.name
            return best
    return None


def _newest(checkpoints_dir: Path) -> Path | None:
    # the one `last` names when complete, else the newest complete one by step
    try:
        pointed = _commit.read_last_pointer(checkpoints_dir)
    except ValueError:
        pointed = None
    if pointed is not None and (pointed / files.META_FILE).is_file():
        return pointed
    candidates = _commit.complete_checkpoints(checkpoints_dir)
    if not candidates:
        return None
    return max(candidates, key=lambda p: (_meta(p).get("global_step", -1), candidates.index(p)))


def _complete_best(path: Path, source: str) -> Path:
    if not (path / files.META_FILE).is_file():
        raise ValueError(
            f'ckpt_path="best": the best checkpoint {path} ({source}) is gone or incomplete; '
            'pass a checkpoint path, or ckpt_path="last"'
        )
    return path


def resolve_path(path: Path) -> Path:
    """A checkpoint directory, a folder of checkpoints (its newest complete one) or a `last`
    file, as the checkpoint directory to load.

    Raises:
        FileNotFoundError: the path does not exist, or a folder holds no complete checkpoint.
    """
    if path.name == LAST and path.is_file():
        return _require(find_last(path.parent), path.parent)
    if not path.exists():
        raise FileNotFoundError(
            f"checkpoint {path} does not exist; pass a checkpoint directory such as "
            "<run>/checkpoints/step-00000100, or ckpt_path='last'"
        )
    if path.is_dir() and not (path / files.META_FILE).exists():
        if (path / LAST).is_file() or _commit.complete_checkpoints(path):
            return _require(find_last(path), path)
    return path


def find_last(checkpoints_dir: Path) -> Path | None:
    """The checkpoint to resume in `checkpoints_dir`, or None when it holds none.

    The one `last` names when it is complete; else the newest complete one by step (with a
    warning when `last` names a missing or incomplete one). When that checkpoint is marked
    non-finite (NaN/inf weights or loss) and a finite one exists, the newest finite one is
    taken instead, with a warning.
    """
    pointed = _commit.read_last_pointer(checkpoints_dir)
    candidates = _commit.complete_checkpoints(checkpoints_dir)
    if pointed is not None and (pointed / files.META_FILE).is_file():
        chosen = pointed
    elif candidates:
        chosen = max(
            candidates, key=lambda p: (_meta(p).get("global_step", -1), candidates.index(p))
        )
        if pointed is not None:
            warnings.warn(
                f"{checkpoints_dir / LAST} names {pointed.name}, which is missing or incomplete; "
                f"resuming from the newest complete checkpoint {chosen.name}",
                stacklevel=3,
            )
    else:
        return None
    if _meta(chosen).get("nonfinite"):
        good = newest_finite(checkpoints_dir)
        if good is not None:
            warnings.warn(
                f"{chosen} holds a non-finite state ({', '.join(_meta(chosen)['nonfinite'])}); "
                f"resuming from the newest finite checkpoint {good.name} instead. Pass "
                f"ckpt_path={str(chosen)!r} to resume the non-finite one anyway",
                stacklevel=3,
            )
            return good
    return chosen


def _require(found: Path | None, checkpoints_dir: Path) -> Path:
    if found is None:
        raise FileNotFoundError(
            f"no checkpoint to resume from in {checkpoints_dir}: it holds no complete "
            "checkpoint. Start without ckpt_path, or pass the path of a checkpoint directory"
        )
    return found


def newest_finite(checkpoints_dir: Path) -> Path | None:
    """The newest complete checkpoint in `checkpoints_dir` (by step) whose saved state is
    finite (meta.json records no "nonfinite" part), or None when there is none."""
    candidates = _commit.complete_checkpoints(checkpoints_dir)
    finite = [p for p in candidates if not _meta(p).get("nonfinite")]
    if not finite:
        return None
    return max(finite, key=lambda p: (_meta(p).get("global_step", -1), finite.index(p)))


def _meta(ckpt: Path) -> dict[str, Any]:
    try:
        return files.read_meta(ckpt)
    except (OSError, ValueError):
        return {}


def _versions_newest_first(experiment_dir: Path, version: int | None) -> list[Path]:
    if version is not None:
        return [experiment_dir / f"version_{version}"]
    if not experiment_dir.is_dir():
        return []
    found = [
        (int(m.group(1)), p) for p in experiment_dir.iterdir() if (m := _VERSION.match(p.name))
    ]
    return [p for _, p in sorted(found, reverse=True)]


def _next(experiment_dir: Path) -> int:
    versions = _versions_newest_first(experiment_dir, None)
    return int(versions[0].name.split("_")[1]) + 1 if versions else 0


def _run_dir_of(ckpt: Path) -> Path | None:
    for parent in ckpt.resolve().parents:
        if _VERSION.match(parent.name):
            return parent
    return None


def plan_on_rank_zero(
    strategy: Any, experiment_dir: Path, settings: Any, ckpt_path: Any, callbacks: Any = None
) -> ResumePlan:
    """`plan_resume` decided on rank 0 and broadcast, so that every rank resumes the same
    checkpoint; a failure there raises on every rank (the same type and message)."""
    plan, error = None, None
    if strategy.is_global_zero:
        try:
            plan = plan_resume(experiment_dir, settings.version, ckpt_path, callbacks)
        except (OSError, ValueError) as exc:
            error = exc
    found, failure = strategy.broadcast_object(
        (
            None if plan is None else [str(plan.run_dir), plan.checkpoint and str(plan.checkpoint)],
            None if error is None else (type(error).__name__, str(error)),
        )
    )
    if error is not None:
        raise error
    if failure is not None:
        kind = FileNotFoundError if failure[0] == "FileNotFoundError" else ValueError
        raise kind(failure[1])
    run_dir, checkpoint = found
    return ResumePlan(Path(run_dir), Path(checkpoint) if checkpoint else None)
