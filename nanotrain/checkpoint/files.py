"""The files inside one checkpoint directory: names, how each is written and safely read.

A checkpoint directory (format version 1) holds:

    meta.json            written last; format version, world size, step, file sizes and
                         sha256 content checksums, whether the saved state is finite
    model.safetensors    the whole model state dict by parameter name (rank 0)
    optimizer.pt         the optimizer state dict (rank 0)
    trainer_state.pt     LR scheduler, TrainState, data position, callbacks, config (rank 0)
    rank-00000.pt ...    what differs per rank: its RNG states (every rank writes its own)

Under a strategy that shards the model (a mesh: tensor/pipeline/expert parallel, ZeRO), the
model and optimizer are written by every rank as its own shard instead:

    model-rank-00000.safetensors ...   this rank's model shard, by full-model parameter name
    optim-rank-00000.safetensors ...   this rank's optimizer state by parameter name, in
                                       pieces (`optim_state.py`); its param groups'
                                       hyperparameters and scalar state are in rank-XXXXX.pt
    (optimizer-rank-00000.pt ...       the index-keyed optimizer shard of older checkpoints)

Every `.pt` file is read with `torch.load(weights_only=True)`, so a checkpoint can only hold
tensors and plain Python values; a file that would need arbitrary unpickling is rejected.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from safetensors.torch import save as safetensors_bytes

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


def optim_shard_file(rank: int) -> str:
    """Name of `rank`'s optimizer state by parameter name under a sharded layout
    (`optim_state.py`: 1-D pieces keyed "<state key>::<start>::<parameter name>")."""
    return f"optim-rank-{rank:05d}.safetensors"


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


class _HashingFile:
    """A binary file opened for writing that hashes what goes through it (sha256), so that a
    checksum costs no second read of the file. Keeps the first OSError, which `torch.save` may
    otherwise wrap in a message that hides the cause (e.g. a full disk)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.file = open(path, "wb")  # noqa: SIM115 - closed in `close`
        self.hash = hashlib.sha256()
        self.error: OSError | None = None

    def write(self, data: bytes | memoryview) -> int:
        try:
            written = self.file.write(data)
        except OSError as exc:
            self.error = self.error or exc
            raise
        self.hash.update(data)
        return written

    def flush(self) -> None:
        self.file.flush()

    def close(self) -> str:
        """Flush, fsync and close the file; return its sha256 hex digest."""
        try:
            self.file.flush()
            os.fsync(self.file.fileno())
        finally:
            self.file.close()
        return self.hash.hexdigest()


def _write_with(path: Path, write: Any) -> str:
    """Open `path` through `_HashingFile`, run `write(file)`, fsync; return the sha256.

    Raises:
        OSError: writing failed; the error names `path` and the OS reason (e.g. ENOSPC).
    """
    try:
        out = _HashingFile(path)
    except OSError as exc:
        raise _os_error(exc, path) from exc
    try:
        write(out)
        return out.close()
    except BaseException as exc:
        cause = out.error or (exc if isinstance(exc, OSError) else None)
        with contextlib.suppress(OSError):
            out.file.close()
        if cause is not None:
            raise _os_error(cause, path) from exc
        raise


def _os_error(exc: OSError, path: Path) -> OSError:
    code = errno.errorcode.get(exc.errno or 0, "")
    reason = f"{exc.strerror or exc} ({code})" if code else str(exc)
    return OSError(exc.errno, f"could not write {path}: {reason}", str(path))


def write_torch(obj: Any, path: Path) -> str:
    """`torch.save` `obj` to `path`, fsync it and return its sha256 (hashed while writing).

    Raises:
        OSError: naming `path` and the OS reason (e.g. "No space left on device (ENOSPC)").
    """
    return _write_with(path, lambda f: torch.save(obj, f))


def write_model(state: dict[str, Any], path: Path) -> tuple[dict[str, Any], str]:
    """Write the tensors of a model state dict to `path` (safetensors) and fsync it.

    Tensors are copied to contiguous CPU memory in the serialized buffer: safetensors refuses
    tensors that share storage (tied embeddings) unless each is copied, and the copy also
    decouples the file from live parameters.

    Returns:
        The non-tensor entries (e.g. `_extra_state` objects), which the caller stores in a
        `.pt` file instead, and the file's sha256.

    Raises:
        OSError: naming `path` and the OS reason.
    """
    tensors = {k: v.detach().cpu().contiguous() for k, v in state.items() if _is_tensor(v)}
    data = safetensors_bytes(_unshare(tensors), metadata={"format": FORMAT_NAME})
    digest = _write_with(path, lambda f: f.write(data))
    return {k: v for k, v in state.items() if not _is_tensor(v)}, digest


def _unshare(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    # safetensors refuses two names over one storage (tied weights): clone the later ones.
    seen: set[int] = set()
    out = {}
    for name, t in tensors.items():
        ptr = t.untyped_storage().data_ptr() if t.numel() else -1
        out[name] = t.clone() if ptr in seen else t
        if ptr != -1:
            seen.add(ptr)
    return out


def sha256_of(path: Path) -> str:
    """The sha256 hex digest of the file at `path`, read in 16 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(16 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def verify_checksums(ckpt_dir: Path, meta: dict[str, Any], names: list[str]) -> None:
    """Check the content of the files `names` against the sha256 `meta.json` recorded.

    Checkpoints saved before checksums existed (no "sha256" in meta) are checked by size only.

    Raises:
        ValueError: a file's content differs from what was saved, naming the file.
    """
    recorded = meta.get("sha256") or {}
    for name in names:
        expected = recorded.get(name)
        if expected is None:
            continue
        path = ckpt_dir / name
        if sha256_of(path) != expected:
            raise ValueError(
                f"checkpoint file {path} is corrupt: its content does not match the sha256 "
                f"checksum recorded when it was saved ({ckpt_dir / META_FILE}); the file was "
                "damaged or modified on disk. Resume from another checkpoint"
            )


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
    with path.open("rb") as f:
        head = f.read(2)
    if head[:1] == b"\x80":  # a pickle protocol opcode: not torch.save's zip archive
        raise UnsafeCheckpointError(
            f"refused to load {path}: it is a raw pickle (pickle.dump, or torch.save with the "
            "legacy format), which can run code when loaded; nanotrain reads .pt files only as "
            "torch.save archives of tensors and plain values. Do not load it unless you know "
            "where it came from; re-save its tensors with torch.save"
        )
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        refused = refused_global(exc)
        if refused is not None:
            raise UnsafeCheckpointError(
                f"refused to load {path}: it holds a pickled object ({refused}) that could run "
                "code when loaded, and nanotrain refuses to unpickle anything but tensors and "
                "plain values (weights_only=True). This is not damage a retry would fix: do not "
                "load the file unless you know where it came from. Checkpoints (callback "
                "state_dicts included) may hold only tensors, numbers, strings, lists and dicts"
            ) from None
        raise corrupt_file_error(path, exc) from None


def corrupt_file_error(path: Path, exc: BaseException) -> ValueError:
    """The error for a checkpoint file that cannot be read: its path, the first sentence of
    the reader's own message (dropped when it advises weights_only=False, which nanotrain
    never does) and what to do."""
    text = str(exc).strip()
    detail = "" if "weights_only" in text else text.split(". ")[0].splitlines()[0]
    return ValueError(
        f"checkpoint file {path} is corrupt or truncated"
        + (f" ({detail})" if detail else "")
        + "; resume from another checkpoint"
    )


class UnsafeCheckpointError(ValueError):
    """A checkpoint file holds pickled code or classes, which nanotrain refuses to load."""


def refused_global(exc: BaseException) -> str | None:
    """What the weights-only unpickler refused (e.g. "GLOBAL posix.system"), or None when
    `exc` is not such a refusal (then the file is damaged, not unsafe)."""
    # A code payload needs a GLOBAL opcode to reach a callable; damaged bytes give other errors.
    for line in str(exc).splitlines():
        found = re.search(r"GLOBAL [\w.]+", line)
        if found:  # the refused name only: torch's advice around it is not nanotrain's
            return found.group(0)
        if "Unsupported global" in line:
            return line.strip().rstrip(".")
    return None


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
        raise corrupt_file_error(path, exc) from None


def _is_tensor(value: Any) -> bool:
    return isinstance(value, torch.Tensor)


#: trainer-state key of a checkpoint saved with ModelCheckpoint(save_weights_only=True)
WEIGHTS_ONLY_KEY = "weights_only"


def is_weights_only(ckpt: Path) -> bool:
    """Whether the checkpoint directory `ckpt` holds the model weights only (False when it is
    not a readable checkpoint: loading it reports that)."""
    try:
        state = read_torch(Path(ckpt) / TRAINER_STATE_FILE)
    except (OSError, ValueError):
        return False
    return isinstance(state, dict) and bool(state.get(WEIGHTS_ONLY_KEY))


def check_resumable(ckpt: Path) -> None:
    """Refuse to resume training (`fit`) from the checkpoint directory `ckpt` when it holds
    the model weights only.

    Raises:
        ValueError: `ckpt` was saved with `ModelCheckpoint(save_weights_only=True)`.
    """
    if is_weights_only(ckpt):
        raise ValueError(
            f"cannot resume training from {ckpt}: it holds the model weights only "
            "(ModelCheckpoint(save_weights_only=True)), without the optimizer, LR scheduler, "
            "data position and RNG state an exact resume needs. To start a new run from its "
            "weights, build the module with MyModule.load_from_checkpoint(path) and call fit "
            "without ckpt_path; to resume, pass a checkpoint saved without save_weights_only"
        )
