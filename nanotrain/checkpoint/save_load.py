"""Save, find and load whole checkpoints of a Trainer (see `files.py` for what is inside).

Every rank calls `save_checkpoint` at the same step. Rank 0 writes what all replicas share
(model, optimizer, trainer state), every rank writes its own `rank-XXXXX.pt`, and rank 0
commits the directory atomically once all ranks are done (`commit.py`).
"""

from __future__ import annotations

import errno
import shutil
import time
import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from nanotrain.checkpoint import commit as _commit
from nanotrain.checkpoint import files, health, optim_state
from nanotrain.checkpoint.collective import (
    agree_no_error,
    attempt,
    describe,
    exchange,
    raise_first_failure,
)
from nanotrain.checkpoint.layout import saved_layout, sharded_layout
from nanotrain.runtime.run_files import RunFilesError

if TYPE_CHECKING:
    from nanotrain.trainer import Trainer

# Payload keys whose value differs between ranks; everything else is rank 0's (identical on
# every replica under the replicated strategies).
PER_RANK_KEYS = ("rng",)
# Set by an asynchronous save: the optimizer state by name, exported before training goes on.
EXPORTED_OPTIMIZER = "_exported_optimizer"
_SEPARATE_KEYS = ("model", "optimizer", EXPORTED_OPTIMIZER, *PER_RANK_KEYS)


def save_checkpoint(trainer: Trainer, path: Path) -> Path:
    """Write the trainer's state (`trainer.checkpoint_payload()`) as the directory `path`.

    Call on every rank at the same step (it synchronizes the ranks). The directory appears
    under its final name only once complete, and `<path.parent>/last` then names it. Every
    file is hashed while it is written; `meta.json` records the sha256 of each, and whether
    the saved weights and last loss are finite (`"nonfinite": []` when they are).

    Under a strategy that shards the model (it has a mesh), every rank writes its own model
    and optimizer shard, and the checkpoint records the layout it was saved under.

    Returns:
        `path`.

    Raises:
        RuntimeError: writing failed on some rank (on every rank, so none hangs), naming the
            rank and the cause (e.g. "No space left on device (ENOSPC)"); the temporary
            directory of the failed save is removed.
    """
    final = Path(path)
    payload = trainer.checkpoint_payload()
    snapshot = Snapshot.of(trainer, payload)
    tmp = temporary_dir_on_all_ranks(trainer, final)
    written, error = attempt(lambda: _write_files(trainer, payload, tmp))
    return conclude(trainer, final, tmp, snapshot, written, error)


def write_weights_only(trainer: Trainer, path: Path, callback_states: dict[str, Any]) -> Path:
    """Write a checkpoint of the model weights only (collective: call on every rank).

    Beside the weights it holds what loading them needs (the config that
    `load_from_checkpoint` rebuilds the module from, what the module's `on_save_checkpoint`
    records, e.g. LanguageModelModule's model config for `nanotrain export`), the step and
    epoch, and `callback_states` (ModelCheckpoint's, so that ckpt_path="best" finds the best);
    no optimizer, LR scheduler, data position or RNG state: `fit` refuses to resume it.
    """
    final = Path(path)
    payload: dict[str, Any] = {
        "model": trainer.strategy.model_state_dict(),
        "optimizer": None,
        "config": trainer.resolved_config(),
        "global_step": trainer.global_step,
        "epoch": trainer.current_epoch,
        "callbacks": callback_states,
        files.WEIGHTS_ONLY_KEY: True,
    }
    # As Lightning: the module's hook runs for a weights-only checkpoint, the callbacks' do not.
    hook = getattr(trainer.module, "on_save_checkpoint", None)
    if callable(hook):
        hook(payload)
    snapshot = Snapshot.of(trainer, payload)
    tmp = temporary_dir_on_all_ranks(trainer, final)
    written, error = attempt(lambda: _write_files(trainer, payload, tmp))
    return conclude(trainer, final, tmp, snapshot, written, error)


class Snapshot(NamedTuple):
    """What `meta.json` records about the state being saved, taken when the save starts (an
    asynchronous save commits later, when the trainer has moved on)."""

    step: int
    nonfinite: list[str]
    param_names: list[list[str]] | None
    nbytes: int = 0  # the tensor bytes this rank writes (what a full disk is told it needs)

    @classmethod
    def of(cls, trainer: Trainer, payload: dict[str, Any]) -> Snapshot:
        """The snapshot of `trainer` now; `payload` is what is being saved."""
        nonfinite = health.nonfinite_parts(trainer, payload["model"])
        names = _optimizer_param_names(trainer)
        return cls(trainer.global_step, nonfinite, names, _tensor_bytes(payload))


def _tensor_bytes(obj: Any) -> int:
    """Bytes of every tensor in a nested payload (dicts, lists, tuples)."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v) for v in obj.values())
    if isinstance(obj, list | tuple):
        return sum(_tensor_bytes(v) for v in obj)
    return 0


def disk_full_error(final: Path, needed: int) -> RunFilesError:
    """The one-line error of a checkpoint save that found the disk full: the folder, the bytes
    the checkpoint needs and those free, and what to do."""
    folder = final.parent
    try:
        free = f"{shutil.disk_usage(folder).free:,} bytes are free"
    except OSError:
        free = "the free space is unknown"
    return RunFilesError(
        f"no space left on the disk of {folder} to save checkpoint {final.name}: it needs about "
        f"{needed:,} bytes and {free}; the partial save was removed and earlier checkpoints "
        "are untouched; free some space, or save elsewhere with ModelCheckpoint(dirpath=...) "
        "or --trainer.default_root_dir",
    )


def temporary_dir_on_all_ranks(trainer: Trainer, final: Path) -> Path:
    """Collective: rank 0 creates `<final>.tmp-<random>/` and every rank learns its name.

    Raises:
        RuntimeError: on every rank when rank 0 could not create it.
    """
    tmp_name, error = None, None
    if trainer.is_global_zero:
        tmp_name, error = attempt(lambda: str(_commit.temporary_dir(final)))
    tmp_name, message = trainer.strategy.broadcast_object((tmp_name, describe(error)))
    if message is not None:
        raise RuntimeError(f"could not create a temporary directory for {final}: {message}")
    return Path(tmp_name)


def conclude(
    trainer: Trainer,
    final: Path,
    tmp: Path,
    snapshot: Snapshot,
    written: dict[str, Any] | None,
    error: Exception | None,
) -> Path:
    """Collective, after every rank wrote its files into `tmp` (or failed): agree, then rank
    0 writes meta.json and commits `tmp` as `final` (or removes `tmp` after a failure).

    Raises:
        RuntimeError: on every rank when a write or the commit failed anywhere.
    """
    strategy = trainer.strategy
    # One exchange is the barrier, the error agreement and the collection of checksums.
    code = getattr(error, "errno", None)
    report = (describe(error), written or {}, snapshot.nonfinite, code, snapshot.nbytes)
    reports = exchange(strategy, report)
    failed = [(rank, msg) for rank, (msg, *_) in enumerate(reports) if msg is not None]
    if failed:
        if trainer.is_global_zero:
            shutil.rmtree(tmp, ignore_errors=True)
        if any(r[3] in (errno.ENOSPC, errno.EDQUOT) for r in reports):
            raise disk_full_error(final, sum(r[4] for r in reports)) from error
        rank, msg = failed[0]
        raise RuntimeError(
            f"writing checkpoint {final} failed on rank {rank}: {msg}. The partial save "
            f"{tmp.name} was removed; earlier checkpoints are untouched"
        ) from error
    file_info = {name: info for _, infos, *_ in reports for name, info in infos.items()}
    bad = sorted({part for _, _, parts, *_ in reports for part in parts})
    if trainer.is_global_zero:
        _, error = attempt(
            lambda: _finish(trainer, tmp, final, file_info, snapshot._replace(nonfinite=bad))
        )
        if error is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    agree_no_error(strategy, error, f"committing checkpoint {final}")
    return final


def load_checkpoint(trainer: Trainer, path: Path) -> dict[str, Any]:
    """Read the checkpoint directory `path` into a payload for `trainer.load_checkpoint_payload`.

    Each rank reads the shared files and its own `rank-XXXXX.pt`, checking each file's
    sha256 first. When the checkpoint was saved by a different number of ranks, every rank
    takes rank 0's per-rank state (its RNG states) and a warning says so: the model,
    optimizer and data position still resume exactly, random streams do not.

    Collective: a failure on any rank raises on every rank (the same type, naming the rank).

    Raises:
        FileNotFoundError: `path` or a file of the checkpoint is missing.
        ValueError: a file is truncated or its content differs from what was saved (naming
            the file); the model config or parameter names/shapes differ from the model's
            (listing the differences).
        UnsafeCheckpointError (a ValueError): a file holds pickled code or classes.
    """
    ckpt = Path(path)
    payload, error = attempt(lambda: _load(trainer, ckpt))
    raise_first_failure(trainer.strategy, error, f"loading checkpoint {ckpt}")
    return payload


def _load(trainer: Trainer, ckpt: Path) -> dict[str, Any]:
    meta = files.read_meta(ckpt)
    files.check_files(ckpt, meta)
    saved, layout = saved_layout(meta), sharded_layout(trainer.strategy)
    if saved is not None or layout is not None:
        return _load_sharded(trainer, ckpt, meta, saved, layout)
    saved_world = int(meta["world_size"])
    source_rank = trainer.global_rank
    if saved_world != trainer.world_size:
        source_rank = 0
        warnings.warn(
            f"checkpoint {ckpt} was saved by {saved_world} ranks and is loaded on "
            f"{trainer.world_size}: model, optimizer and data position resume exactly, but "
            "every rank restores rank 0's RNG state",
            stacklevel=3,
        )
    payload = _read_shared(trainer, ckpt, meta)
    payload.update(_read_torch(ckpt, meta, files.rank_file(source_rank)))
    return payload


def load_model_weights(path: str | Path) -> dict[str, Any]:
    """The whole model state dict (parameter name → CPU tensor) of a checkpoint, no Trainer
    needed (for export and inspection).

    Raises:
        FileNotFoundError / ValueError: as `load_checkpoint`.
    """
    ckpt = Path(path)
    meta = files.read_meta(ckpt)
    files.check_files(ckpt, meta)
    if meta.get("layout") is not None:
        raise ValueError(
            f"{ckpt} was saved sharded under {_describe_layout(meta['layout'])}; merge its "
            "shards into whole tensors with nanotrain.checkpoint.merge.merge_model_shards(path) "
            "or `nanotrain export --to nanotrain`"
        )
    state: dict[str, Any] = _read_model(ckpt, meta, files.MODEL_FILE)
    state.update(_read_torch(ckpt, meta, files.TRAINER_STATE_FILE).get("model_extra", {}))
    return state


def _describe_layout(layout: dict[str, Any] | None) -> str:
    if layout is None:
        return "a replicated strategy (single device or DDP)"
    sizes = ", ".join(f"{k}={v}" for k, v in layout.items() if k != "strategy")
    return f"{layout.get('strategy', '?')}({sizes})"


def _load_sharded(
    trainer: Trainer,
    ckpt: Path,
    meta: dict[str, Any],
    saved: dict[str, Any] | None,
    current: dict[str, Any] | None,
) -> dict[str, Any]:
    rank = trainer.global_rank
    payload = _read_torch(ckpt, meta, files.TRAINER_STATE_FILE)
    _check_model_config(trainer, ckpt, payload)
    if saved != current:
        from nanotrain.checkpoint.reshard import load_resharded

        return load_resharded(trainer, ckpt, meta, payload, _READERS)
    model: dict[str, Any] = _read_model(ckpt, meta, files.model_shard_file(rank))
    _check_model_state(trainer, ckpt, model)
    rank_state = _read_torch(ckpt, meta, files.rank_file(rank))
    model.update(rank_state.pop("model_extra", {}))
    payload["model"] = model
    info = rank_state.pop("optimizer_info", None)
    shard = files.optimizer_shard_file(rank)
    payload["optimizer"] = None
    if files.optim_shard_file(rank) in meta["files"] and info is not None:
        own = _read_model(ckpt, meta, files.optim_shard_file(rank))
        keys = sorted({optim_state.parse_piece_key(k)[0] for k in own})
        payload["optimizer"] = optim_state.import_state(
            trainer.strategy,
            info,
            keys,
            lambda slot, key: own.get(optim_state.piece_key(key, slot.start, slot.name)),
        )
    elif shard in meta["files"]:  # written before optimizer state was kept by name
        payload["optimizer"] = _read_torch(ckpt, meta, shard)
    payload.update(rank_state)
    return payload


def _write_files(trainer: Trainer, payload: dict[str, Any], tmp: Path) -> dict[str, Any]:
    """Write this rank's files into `tmp`; return {file name: [size, sha256]}."""
    rank = trainer.global_rank
    rank_state = {k: payload[k] for k in PER_RANK_KEYS if k in payload}
    shared = {k: v for k, v in payload.items() if k not in _SEPARATE_KEYS}
    digests: dict[str, str] = {}
    if sharded_layout(trainer.strategy) is not None:
        name = files.model_shard_file(rank)
        rank_state["model_extra"], digests[name] = files.write_model(payload["model"], tmp / name)
        if payload.get("optimizer") is not None:
            # By parameter name, so that any other layout can reassemble it (reshard.py);
            # an asynchronous save exported it already, while the state could not change.
            exported = payload.get(EXPORTED_OPTIMIZER) or optim_state.export_state(trainer.strategy)
            pieces, rank_state["optimizer_info"] = exported
            name = files.optim_shard_file(rank)
            digests[name] = files.write_model(pieces, tmp / name)[1]
    elif trainer.is_global_zero:
        shared["model_extra"], digests[files.MODEL_FILE] = files.write_model(
            payload["model"], tmp / files.MODEL_FILE
        )
        if payload.get("optimizer") is not None:
            name = files.OPTIMIZER_FILE
            digests[name] = files.write_torch(payload["optimizer"], tmp / name)
    name = files.rank_file(rank)
    digests[name] = files.write_torch(rank_state, tmp / name)
    if trainer.is_global_zero:
        name = files.TRAINER_STATE_FILE
        digests[name] = files.write_torch(shared, tmp / name)
    return {name: [(tmp / name).stat().st_size, digest] for name, digest in digests.items()}


def _finish(
    trainer: Trainer, tmp: Path, final: Path, file_info: dict[str, Any], snapshot: Snapshot
) -> None:
    """Rank 0, after every rank wrote its files: meta.json, commit, cleanup."""
    meta = {
        "format": files.FORMAT_NAME,
        "version": files.FORMAT_VERSION,
        "world_size": trainer.world_size,
        "global_step": snapshot.step,
        "strategy": type(trainer.strategy).__name__,
        "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "torch_version": torch.__version__,
        "files": {name: int(info[0]) for name, info in sorted(file_info.items())},
        "sha256": {name: info[1] for name, info in sorted(file_info.items()) if info[1]},
        "nonfinite": snapshot.nonfinite,
        "optimizer_param_names": snapshot.param_names,
        "layout": sharded_layout(trainer.strategy),
    }
    files.write_meta(meta, tmp / files.META_FILE)
    _commit.commit(tmp, final)
    _commit.remove_stale_temporaries(final.parent)


def _optimizer_param_names(trainer: Trainer) -> list[list[str]] | None:
    # The optimizer state dict numbers parameters; their names let another layout remap it.
    setup, module = trainer.strategy.optimizer_setup, trainer.strategy.module
    if setup is None or module is None:
        return None
    names = {id(p): n for n, p in module.named_parameters()}
    return [[names.get(id(p), "?") for p in g["params"]] for g in setup.optimizer.param_groups]


def _read_shared(trainer: Trainer, ckpt: Path, meta: dict[str, Any]) -> dict[str, Any]:
    payload = _read_torch(ckpt, meta, files.TRAINER_STATE_FILE)
    _check_model_config(trainer, ckpt, payload)
    model: dict[str, Any] = _read_model(ckpt, meta, files.MODEL_FILE)
    _check_model_state(trainer, ckpt, model)
    model.update(payload.pop("model_extra", {}))
    payload["model"] = model
    has_optimizer = files.OPTIMIZER_FILE in meta.get("files", {})
    payload["optimizer"] = _read_torch(ckpt, meta, files.OPTIMIZER_FILE) if has_optimizer else None
    return payload


def _read_torch(ckpt: Path, meta: dict[str, Any], name: str) -> Any:
    files.verify_checksums(ckpt, meta, [name])
    return files.read_torch(ckpt / name)


def _read_model(ckpt: Path, meta: dict[str, Any], name: str) -> dict[str, Any]:
    files.verify_checksums(ckpt, meta, [name])
    return files.read_model(ckpt / name)


_READERS = SimpleNamespace(model=_read_model, torch=_read_torch)


def _check_model_config(trainer: Trainer, ckpt: Path, payload: dict[str, Any]) -> None:
    # Before any tensor is read: a different model config is a list of fields, not a dump.
    saved = payload.get("model_config")
    current = health.current_model_config(trainer.module) if saved is not None else None
    if current is None:
        return
    diffs = health.config_differences(saved, current)
    if diffs:
        raise ValueError(
            f"checkpoint {ckpt} holds a different model than the one configured; the model "
            f"config differs in {len(diffs)} field(s):\n{health.summarize(diffs)}\nConfigure "
            "the model as it was saved, or start from its weights with a new run"
        )


def _check_model_state(trainer: Trainer, ckpt: Path, saved: dict[str, Any]) -> None:
    current = trainer.strategy.model_state_dict()
    diffs = health.state_differences(saved, current)
    if diffs:
        raise ValueError(
            f"checkpoint {ckpt} does not fit the model: {len(diffs)} difference(s) in "
            f"parameter names or shapes:\n{health.summarize(diffs)}\nConfigure the model as "
            "it was saved"
        )
