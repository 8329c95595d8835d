"""Save, find and load whole checkpoints of a Trainer (see `files.py` for what is inside).

Every rank calls `save_checkpoint` at the same step. Rank 0 writes what all replicas share
(model, optimizer, trainer state), every rank writes its own `rank-XXXXX.pt`, and rank 0
commits the directory atomically once all ranks are done (`commit.py`).
"""

from __future__ import annotations

import time
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from nanotrain.checkpoint import commit as _commit
from nanotrain.checkpoint import files

if TYPE_CHECKING:
    from nanotrain.strategies.base import Strategy
    from nanotrain.trainer import Trainer

# Payload keys whose value differs between ranks; everything else is rank 0's (identical on
# every replica under the replicated strategies).
PER_RANK_KEYS = ("rng",)
_SEPARATE_KEYS = ("model", "optimizer", *PER_RANK_KEYS)


def save_checkpoint(trainer: Trainer, path: Path) -> Path:
    """Write the trainer's state (`trainer.checkpoint_payload()`) as the directory `path`.

    Call on every rank at the same step (it synchronizes the ranks). The directory appears
    under its final name only once complete, and `<path.parent>/last` then names it.

    Returns:
        `path`.

    Under a strategy that shards the model (it has a mesh), every rank writes its own model
    and optimizer shard, and the checkpoint records the layout it was saved under.

    Raises:
        RuntimeError: writing failed on some rank (on every rank, so none hangs).
    """
    strategy = trainer.strategy
    final = Path(path)
    payload = trainer.checkpoint_payload()
    tmp_name, error = None, None
    if trainer.is_global_zero:
        tmp_name, error = _attempt(lambda: str(_commit.temporary_dir(final)))
    tmp_name, message = strategy.broadcast_object((tmp_name, _describe(error)))
    if message is not None:
        raise RuntimeError(f"could not create a temporary directory for {final}: {message}")
    tmp = Path(tmp_name)
    _, error = _attempt(lambda: _write_files(trainer, payload, tmp))
    _agree_no_error(strategy, error, f"writing checkpoint {final}")
    if trainer.is_global_zero:
        _, error = _attempt(lambda: _finish(trainer, payload, tmp, final))
    _agree_no_error(strategy, error, f"committing checkpoint {final}")
    return final


def load_checkpoint(trainer: Trainer, path: Path) -> dict[str, Any]:
    """Read the checkpoint directory `path` into a payload for `trainer.load_checkpoint_payload`.

    Each rank reads the shared files and its own `rank-XXXXX.pt`. When the checkpoint was
    saved by a different number of ranks, every rank takes rank 0's per-rank state (its RNG
    states) and a warning says so: the model, optimizer and data position still resume
    exactly, random streams do not.

    Raises:
        FileNotFoundError: `path` or a file of the checkpoint is missing.
        ValueError: a file is truncated or corrupt, or holds more than tensors and plain values.
    """
    ckpt = Path(path)
    meta = files.read_meta(ckpt)
    files.check_files(ckpt, meta)
    saved_layout, layout = meta.get("layout"), sharded_layout(trainer.strategy)
    if saved_layout is not None or layout is not None:
        return _load_sharded(trainer, ckpt, meta, saved_layout, layout)
    saved_world = int(meta["world_size"])
    source_rank = trainer.global_rank
    if saved_world != trainer.world_size:
        source_rank = 0
        warnings.warn(
            f"checkpoint {ckpt} was saved by {saved_world} ranks and is loaded on "
            f"{trainer.world_size}: model, optimizer and data position resume exactly, but "
            "every rank restores rank 0's RNG state",
            stacklevel=2,
        )
    payload = _read_shared(ckpt, meta)
    payload.update(files.read_torch(ckpt / files.rank_file(source_rank)))
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
    state: dict[str, Any] = files.read_model(ckpt / files.MODEL_FILE)
    state.update(files.read_torch(ckpt / files.TRAINER_STATE_FILE).get("model_extra", {}))
    return state


def resolve_checkpoint_path(trainer: Trainer, ckpt_path: str | Path) -> Path:
    """The checkpoint directory `ckpt_path` stands for.

    `"last"` is the checkpoint `last` names in `trainer.checkpoint_dir` (the run directory the
    trainer resumed). A folder of checkpoints, or its `last` file, resolves the same way; any
    other path is taken as a checkpoint directory. If `last` names a checkpoint that is gone
    or incomplete, the newest complete one is used, with a warning.

    Raises:
        FileNotFoundError: the path does not exist, or a folder holds no complete checkpoint.
    """
    if str(ckpt_path) == _commit.LAST_POINTER:
        return _resolve_last(trainer.checkpoint_dir)
    path = Path(ckpt_path)
    if path.name == _commit.LAST_POINTER and path.is_file():
        return _resolve_last(path.parent)
    if not path.exists():
        raise FileNotFoundError(
            f"checkpoint {path} does not exist; pass a checkpoint directory such as "
            "<run>/checkpoints/step-00000100, or ckpt_path='last'"
        )
    if path.is_dir() and not (path / files.META_FILE).exists():
        if (path / _commit.LAST_POINTER).is_file() or _commit.complete_checkpoints(path):
            return _resolve_last(path)
    return path


def _resolve_last(checkpoints_dir: Path) -> Path:
    pointed = _commit.read_last_pointer(checkpoints_dir)
    if pointed is not None and (pointed / files.META_FILE).is_file():
        return pointed
    candidates = _commit.complete_checkpoints(checkpoints_dir)
    if not candidates:
        raise FileNotFoundError(
            f"no checkpoint to resume from in {checkpoints_dir}: it holds no complete "
            "checkpoint. Start without ckpt_path, or pass the path of a checkpoint directory"
        )
    newest = max(candidates, key=lambda p: (_saved_step(p), candidates.index(p)))
    if pointed is not None:
        warnings.warn(
            f"{checkpoints_dir / _commit.LAST_POINTER} names {pointed.name}, which is missing or "
            f"incomplete; resuming from the newest complete checkpoint {newest.name}",
            stacklevel=3,
        )
    return newest


def _saved_step(ckpt: Path) -> int:
    try:
        return int(files.read_meta(ckpt).get("global_step", -1))
    except (OSError, ValueError):
        return -1


def sharded_layout(strategy: Strategy) -> dict[str, Any] | None:
    """The parallel layout of a strategy that shards the model, or None when every rank holds
    the whole model (then rank 0 writes one copy for all)."""
    mesh = strategy.mesh
    if mesh is None:
        return None
    return {
        "strategy": type(strategy).__name__,
        "world_size": strategy.world_size,
        **{axis: int(getattr(mesh, f"{axis}_size", 1)) for axis in ("tp", "pp", "ep", "dp")},
        "zero_stage": int(getattr(strategy, "zero_stage", 0)),
    }


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
    if saved != current:
        raise ValueError(
            f"checkpoint {ckpt} was saved under {_describe_layout(saved)} and cannot be loaded "
            f"under {_describe_layout(current)}: resharding across layouts is not implemented "
            "yet; resume with the layout it was saved under"
        )
    rank = trainer.global_rank
    payload = files.read_torch(ckpt / files.TRAINER_STATE_FILE)
    model: dict[str, Any] = files.read_model(ckpt / files.model_shard_file(rank))
    rank_state = files.read_torch(ckpt / files.rank_file(rank))
    model.update(rank_state.pop("model_extra", {}))
    payload["model"] = model
    shard = files.optimizer_shard_file(rank)
    has_optimizer = shard in meta.get("files", {})
    payload["optimizer"] = files.read_torch(ckpt / shard) if has_optimizer else None
    payload.update(rank_state)
    return payload


def _write_files(trainer: Trainer, payload: dict[str, Any], tmp: Path) -> None:
    rank = trainer.global_rank
    rank_state = {k: payload[k] for k in PER_RANK_KEYS if k in payload}
    shared = {k: v for k, v in payload.items() if k not in _SEPARATE_KEYS}
    if sharded_layout(trainer.strategy) is not None:
        rank_state["model_extra"] = files.write_model(
            payload["model"], tmp / files.model_shard_file(rank)
        )
        if payload.get("optimizer") is not None:
            files.write_torch(payload["optimizer"], tmp / files.optimizer_shard_file(rank))
    elif trainer.is_global_zero:
        shared["model_extra"] = files.write_model(payload["model"], tmp / files.MODEL_FILE)
        if payload.get("optimizer") is not None:
            files.write_torch(payload["optimizer"], tmp / files.OPTIMIZER_FILE)
    files.write_torch(rank_state, tmp / files.rank_file(rank))
    if trainer.is_global_zero:
        files.write_torch(shared, tmp / files.TRAINER_STATE_FILE)


def _finish(trainer: Trainer, payload: dict[str, Any], tmp: Path, final: Path) -> None:
    """Rank 0, after every rank wrote its files: meta.json, commit, cleanup."""
    layout = sharded_layout(trainer.strategy)
    ranks = range(trainer.world_size)
    names = [files.TRAINER_STATE_FILE] + [files.rank_file(r) for r in ranks]
    with_optimizer = payload.get("optimizer") is not None
    if layout is None:
        names += [files.MODEL_FILE] + ([files.OPTIMIZER_FILE] if with_optimizer else [])
    else:
        names += [files.model_shard_file(r) for r in ranks]
        names += [files.optimizer_shard_file(r) for r in ranks] if with_optimizer else []
    meta = {
        "format": files.FORMAT_NAME,
        "version": files.FORMAT_VERSION,
        "world_size": trainer.world_size,
        "global_step": trainer.global_step,
        "strategy": type(trainer.strategy).__name__,
        "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "torch_version": torch.__version__,
        "files": {name: (tmp / name).stat().st_size for name in names},
        "optimizer_param_names": _optimizer_param_names(trainer),
        "layout": layout,
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


def _read_shared(ckpt: Path, meta: dict[str, Any]) -> dict[str, Any]:
    payload = files.read_torch(ckpt / files.TRAINER_STATE_FILE)
    model: dict[str, Any] = files.read_model(ckpt / files.MODEL_FILE)
    model.update(payload.pop("model_extra", {}))
    payload["model"] = model
    has_optimizer = files.OPTIMIZER_FILE in meta.get("files", {})
    payload["optimizer"] = files.read_torch(ckpt / files.OPTIMIZER_FILE) if has_optimizer else None
    return payload


def _attempt(fn: Any) -> tuple[Any, Exception | None]:
    """Run `fn`; return (result, None) or (None, the exception) so that a failing rank can
    still take part in the collective that tells the others."""
    try:
        return fn(), None
    except Exception as exc:  # noqa: BLE001 - re-raised on every rank by _agree_no_error
        return None, exc


def _describe(error: Exception | None) -> str | None:
    return None if error is None else f"{type(error).__name__}: {error}"


def _agree_no_error(strategy: Strategy, error: Exception | None, what: str) -> None:
    # A max-reduce of "did I fail" doubles as the barrier: every rank learns of a failure
    # anywhere instead of hanging at a barrier the failed rank never reaches.
    # Over every rank (the default group), not only data-parallel replicas: under a sharded
    # layout each rank writes files of its own.
    flag = torch.tensor(0.0 if error is None else 1.0, device=strategy.root_device)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if float(flag) > 0:
        detail = _describe(error) or "it failed on another rank (see that rank's error)"
        raise RuntimeError(f"{what} failed: {detail}") from error
