"""The files inside one checkpoint directory: names, how each is written and safely read.

A checkpoint directory (format version 1) holds:

    meta.json            written last; format version, world size, step, file sizes
    model.safetensors    the whole model state dict by parameter name (rank 0)
    optimizer.pt         the optimizer state dict (rank 0)
    trainer_state.pt     LR scheduler, TrainState, data position, callbacks, config (rank 0)
    rank-00000.pt ...    what differs per rank: its RNG states (every rank writes its own)

Under a strategy that shards the model (a mesh: tensor/pipeline/expert parallel, ZeRO), the
model and optimizer are written by every rank as its own shard instead:

    model-rank-00000.safetensors ...   this rank's model shard, by full-model parameter name
    optimizer-rank-00000.pt ...        this rank's optimizer shard

Every `.pt` file is read with `torch.load(weights_only=True)`, so a checkpoint can only hold
tensors and plain Python values; a file that would need arbitrary unpickling is rejected.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

FORMAT_NAME = "nanotrain-checkpoint"
FORMAT_VERSION = 1
META_FILE = "meta.json"
MODEL_FILE = "model.safetensors"
OPTIMIZER_FILE = "optimizer.pt"
TRAINER_STATE_FILE = "trainer_state.pt"


def rank_file(rank: int) -> str:
    """Name of the per-rank file of `rank`, e.g. `rank-00003.pt`."""
    return f"rank-{rank:05d}.pt"


def model_shard_file(rank: int) -> str:
    """Name of `rank`'s model shard under a sharded layout."""
    return f"model-rank-{rank:05d}.safetensors"


def optimizer_shard_file(rank: int) -> str:
    """Name of `rank`'s optimizer shard under a sharded layout."""
    return f"optimizer-rank-{rank:05d}.pt"


def fsync_path(path: Path) -> None:
    """Flush a file's or a directory's contents to disk (a rename is durable only after the
    directory holding it is synced)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError:
        # Some filesystems cannot fsync a directory (EINVAL); the rename is still atomic there,
        # only its durability across a power loss is up to the filesystem.
        if not path.is_dir():
            raise
    finally:
        os.close(fd)


def write_torch(obj: Any, path: Path) -> None:
    """`torch.save` `obj` to `path` and fsync it."""
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def write_model(state: dict[str, Any], path: Path) -> dict[str, Any]:
    """Write the tensors of a model state dict to `path` (safetensors) and fsync it.

    Tensors are cloned to contiguous CPU memory first: safetensors refuses tensors that share
    storage (tied embeddings), and the clone also decouples the file from live parameters.
    Returns the non-tensor entries (e.g. `_extra_state` objects), which the caller stores in a
    `.pt` file instead.
    """
    tensors = {k: v.detach().cpu().contiguous().clone() for k, v in state.items() if _is_tensor(v)}
    save_file(tensors, str(path), metadata={"format": FORMAT_NAME})
    fsync_path(path)
    return {k: v for k, v in state.items() if not _is_tensor(v)}


def write_meta(meta: dict[str, Any], path: Path) -> None:
    """Write `meta` as indented JSON to `path` and fsync it."""
    with open(path, "w", encoding="utf-8") as f:
        json.dump(meta, f, indent=2, sort_keys=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())


def read_meta(ckpt_dir: Path) -> dict[str, Any]:
    """Read and check `meta.json` of the checkpoint directory `ckpt_dir`.

    Raises:
        FileNotFoundError: `ckpt_dir` does not exist or has no `meta.json` (not a checkpoint,
            or a save that never finished).
        ValueError: `meta.json` is not valid JSON, is not a nanotrain checkpoint's, or has a
            format version this nanotrain cannot read.
    """
    if not ckpt_dir.is_dir():
        raise FileNotFoundError(
            f"checkpoint {ckpt_dir} does not exist (or is not a directory); pass the path of a "
            "checkpoint directory such as <run>/checkpoints/step-00000100, or ckpt_path='last'"
        )
    path = ckpt_dir / META_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} is missing: {ckpt_dir} is not a complete nanotrain checkpoint (meta.json "
            "is written last, so its save never finished); resume from an earlier checkpoint"
        )
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(
            f"{path} is corrupt (not valid JSON: {exc}); use another checkpoint"
        ) from exc
    if not isinstance(meta, dict) or meta.get("format") != FORMAT_NAME:
        raise ValueError(
            f"{path} does not describe a nanotrain checkpoint (no format={FORMAT_NAME!r})"
        )
    if meta.get("version") != FORMAT_VERSION:
        raise ValueError(
            f"{path} has checkpoint format version {meta.get('version')!r}; this nanotrain reads "
            f"version {FORMAT_VERSION}. Load it with the nanotrain release that wrote it"
        )
    if not isinstance(meta.get("world_size"), int) or not isinstance(meta.get("files"), dict):
        raise ValueError(
            f"{path} is corrupt: it lacks 'world_size' or 'files'; use another checkpoint"
        )
    return meta


def check_files(ckpt_dir: Path, meta: dict[str, Any]) -> None:
    """Check that every file listed in `meta["files"]` exists with the recorded size.

    Raises:
        FileNotFoundError: a listed file is missing.
        ValueError: a file's size differs from the recorded one (truncated or overwritten).
    """
    for name, size in meta.get("files", {}).items():
        path = ckpt_dir / name
        if not path.is_file():
            raise FileNotFoundError(
                f"checkpoint file {path} is missing (listed in {ckpt_dir / META_FILE}); the "
                "checkpoint was modified after it was saved: resume from another checkpoint"
            )
        actual = path.stat().st_size
        if actual != size:
            raise ValueError(
                f"checkpoint file {path} has {actual} bytes, {size} were saved: it is truncated "
                "or was overwritten; resume from another checkpoint"
            )


def read_torch(path: Path) -> Any:
    """Load a `.pt` file with `weights_only=True` (tensors and plain Python values only).

    Raises:
        FileNotFoundError: the file does not exist.
        ValueError: the file is corrupt/truncated, or holds objects that need arbitrary
            unpickling (which nanotrain refuses: that would run code from the file).
    """
    if not path.is_file():
        raise FileNotFoundError(
            f"checkpoint file {path} is missing; resume from another checkpoint"
        )
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        # The weights-only unpickler names the class it refused; anything else is damage.
        if "Unsupported global" in str(exc):
            raise ValueError(
                f"{path} holds objects other than tensors and plain Python values, which "
                "nanotrain refuses to unpickle (weights_only=True). Store only tensors, numbers, "
                "strings, lists and dicts in checkpoints (callback state_dicts included)"
            ) from exc
        raise ValueError(f"checkpoint file {path} is corrupt or truncated ({exc})") from exc


def read_model(path: Path) -> dict[str, torch.Tensor]:
    """Load the model tensors of `model.safetensors` onto the CPU.

    Raises:
        FileNotFoundError: the file does not exist.
        ValueError: the file is corrupt or truncated.
    """
    if not path.is_file():
        raise FileNotFoundError(
            f"checkpoint file {path} is missing; resume from another checkpoint"
        )
    try:
        return load_file(str(path), device="cpu")
    except (SafetensorError, OSError, ValueError) as exc:
        raise ValueError(f"checkpoint file {path} is corrupt or truncated ({exc})") from exc


def _is_tensor(value: Any) -> bool:
    return isinstance(value, torch.Tensor)
