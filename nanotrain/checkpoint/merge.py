"""Merge the model shards of a sharded checkpoint into whole-model tensors, in one process.

Under `MegatronStrategy` every rank writes `model-rank-XXXXX.safetensors`: its local slices,
keyed by whole-model parameter names (`files.py`). This module puts them back together
offline, without `torch.distributed`, e.g. for `nanotrain export`:

* rank -> (tp, pp, dp, ep) coordinates come from the layout `meta.json` records, through the
  pure `MeshLayout` (tensor fastest, then data, then pipeline; `dp_rank = ep_rank + ep *
  expert_dp_rank`);
* which dim of a tensor is split comes from the module that owns it in the whole model, built
  on the meta device (no memory): `ColumnParallelLinear` splits dim 0 (weight and bias),
  `RowParallelLinear` the weight's dim 1, `VocabParallelEmbedding` and the LM head dim 0 of a
  vocabulary padded to a multiple of tp (the padding rows are dropped again), and routed
  experts (`GroupedExperts.ep_partition_dims`) dim 0 over the expert-parallel ranks;
* everything else is replicated: the copy of tp rank 0 / dp rank 0 is taken;
* pipeline stages hold disjoint names, except that the last stage may hold a copy of the
  embedding (for MTP or tied weights); its gradient is summed with the first stage's, so the
  copies are equal, and the first stage's is taken.

Only the files of dp ranks ``[0, ep)`` (one replica, all experts) are read, tensor by tensor.
`open_model_shards` reads nothing but the shards' headers: it gives every whole tensor as a
`LazyTensor` that reads its pieces (or only the part of them a slice needs) when asked, so
`nanotrain export` holds one whole tensor and its shards at a time, never the whole model.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

from safetensors import SafetensorError, safe_open
from torch import Tensor, nn

from nanotrain.checkpoint import files
from nanotrain.models.config import DeepSeekConfig, DenseConfig, config_from_dict
from nanotrain.models.lazy import FileTensor, LazyTensor, SafetensorsFile, concat, in_memory
from nanotrain.parallel.mesh import MeshLayout
from nanotrain.parallel.tensor import VocabParallelEmbedding, _TensorParallelModule, pad_vocab_size

# LanguageModelModule keeps the model under this attribute, so its state_dict keys carry it.
MODULE_PREFIX = "model."

__all__ = ["merge_model_shards", "open_model_shards", "saved_mesh_layout"]

_SHARD_PREFIX, _SHARD_SUFFIX = "model-rank-", ".safetensors"


def saved_mesh_layout(ckpt_dir: str | Path, meta: dict[str, Any] | None = None) -> MeshLayout:
    """The `MeshLayout` a sharded checkpoint was saved under, checked against its files.

    Args:
        ckpt_dir: the checkpoint directory. meta: its `meta.json` if already read.

    Raises:
        ValueError: the checkpoint was not saved sharded, its layout is inconsistent (sizes
            that do not multiply to the world size), or the model shard files it lists or
            holds are not exactly one per rank.
    """
    ckpt = Path(ckpt_dir)
    meta = files.read_meta(ckpt) if meta is None else meta
    saved = meta.get("layout")
    if saved is None:
        raise ValueError(
            f"{ckpt} was not saved sharded (its meta.json records no layout): it holds the whole "
            "model in model.safetensors; read it with nanotrain.checkpoint.load_model_weights"
        )
    where = f"{ckpt / files.META_FILE}"
    try:
        mesh = MeshLayout(
            tp=int(saved["tp"]), pp=int(saved["pp"]), dp=int(saved["dp"]), ep=int(saved["ep"])
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(
            f"{where} records an unusable layout {saved!r} ({exc}); the checkpoint is corrupt, "
            "use another one"
        ) from exc
    worlds = {"world_size": meta["world_size"], "layout world_size": saved.get("world_size")}
    for what, world in worlds.items():
        if world is not None and world != mesh.world_size:
            raise ValueError(
                f"{where}: {what}={world} does not match its layout tp*pp*dp="
                f"{mesh.tp}*{mesh.pp}*{mesh.dp}={mesh.world_size}; the checkpoint is corrupt, "
                "use another one"
            )
    expected = {files.model_shard_file(r) for r in range(mesh.world_size)}
    listed = {n for n in meta["files"] if n.startswith(_SHARD_PREFIX)}
    present = {p.name for p in ckpt.glob(f"{_SHARD_PREFIX}*{_SHARD_SUFFIX}")}
    for what, found in (("lists", listed), ("directory holds", present)):
        if found != expected:
            extra, lacking = sorted(found - expected), sorted(expected - found)
            raise ValueError(
                f"the layout in {where} (tp={mesh.tp}, pp={mesh.pp}, dp={mesh.dp}, ep={mesh.ep}:"
                f" {mesh.world_size} ranks) does not match the model shards its {what}: "
                f"unexpected {extra[:4]}, missing {lacking[:4]}. Files were added, removed or "
                "copied from another checkpoint: use an intact checkpoint"
            )
    return mesh


def merge_model_shards(ckpt_dir: str | Path, model: nn.Module | None = None) -> dict[str, Tensor]:
    """The whole-model state dict of a sharded checkpoint, merged from its per-rank shards.

    The result has the same keys, shapes and values as the model state dict a single-process
    run saves (`load_model_weights` of an unsharded checkpoint): e.g. for a LanguageModelModule
    `model.embed_tokens.weight` [vocab_size, H] and the routed experts stacked over all E
    experts, [E, ...]. Non-tensor entries (`_extra_state`) are not included. It holds the
    whole model in memory; `open_model_shards` reads one tensor at a time.

    Args:
        ckpt_dir: a checkpoint directory saved under a sharded layout (`MegatronStrategy`).
        model: the whole module whose `state_dict()` the checkpoint holds, built for one
            process (the meta device is enough; only names, shapes and owning modules are
            used). None rebuilds it from the model config a `LanguageModelModule` records.

    Returns:
        name -> CPU tensor in the saved dtype.

    Raises:
        FileNotFoundError / ValueError: as `open_model_shards`.
    """
    with contextlib.ExitStack() as stack:
        lazy = open_model_shards(ckpt_dir, model, stack)
        return {name: tensor.read() for name, tensor in lazy.items()}


def open_model_shards(
    ckpt_dir: str | Path,
    model: nn.Module | None = None,
    stack: contextlib.ExitStack | None = None,
) -> dict[str, LazyTensor]:
    """`merge_model_shards` without reading any tensor yet: name -> `LazyTensor`.

    The shards' names and shapes are all checked against the model and the recorded layout
    from the files' headers first. A whole tensor is read (from its shards) when its `read()`
    is called, and a slice of it (`narrow`, `[a:b]`, `unbind`) reads only the shards, and the
    parts of them, it covers.

    Args:
        ckpt_dir, model: as `merge_model_shards`.
        stack: closes the shard files when it closes (None: they close when the lazy tensors
            are garbage-collected).

    Raises:
        FileNotFoundError: the checkpoint or one of its files is missing.
        ValueError: a shard is corrupt or truncated (checked against meta.json's checksums
            first), the layout in meta.json does not match the shard files, or the shards'
            names or shapes do not fit the model (another config, or another layout than
            recorded); a shard whose data cannot be read also raises, when it is read.
    """
    ckpt = Path(ckpt_dir)
    meta = files.read_meta(ckpt)
    files.check_files(ckpt, meta)
    mesh = saved_mesh_layout(ckpt, meta)
    template = _model_from_checkpoint(ckpt) if model is None else model
    expected = template.state_dict(keep_vars=True)  # name -> tensor with the whole shape
    reader = _ShardReader(ckpt)
    if stack is not None:
        stack.enter_context(reader)
    stage_of = _stage_of_each_name(reader, mesh, set(expected))
    return {
        name: _merged(reader, mesh, template, name, tensor, stage_of[name])
        for name, tensor in expected.items()
    }


class _ShardReader(contextlib.ExitStack):
    """Opens each rank's shard once (lazily) and reads single tensors from it."""

    def __init__(self, ckpt: Path) -> None:
        super().__init__()
        self.ckpt = ckpt
        self._open: dict[int, Any] = {}
        self._files: dict[int, SafetensorsFile] = {}

    def path(self, rank: int) -> Path:
        return self.ckpt / files.model_shard_file(rank)

    def _handle(self, rank: int) -> Any:
        if rank not in self._open:
            try:
                self._open[rank] = self.enter_context(
                    safe_open(str(self.path(rank)), framework="pt", device="cpu")
                )
            except (SafetensorError, OSError) as exc:
                raise ValueError(
                    f"model shard {self.path(rank)} is corrupt or truncated ({exc}); use "
                    "another checkpoint"
                ) from exc
        return self._open[rank]

    def keys(self, rank: int) -> set[str]:
        return set(self._handle(rank).keys())

    def lazy(self, rank: int, name: str) -> FileTensor:
        """Tensor `name` of `rank`'s shard, not read yet (its shape from the header)."""
        if rank not in self._files:
            self._files[rank] = SafetensorsFile(self.path(rank), self._handle(rank))
        return self._files[rank].tensor(name)

    def tensor(self, rank: int, name: str) -> Tensor:
        try:
            return self._handle(rank).get_tensor(name)
        except (SafetensorError, OSError) as exc:
            raise ValueError(
                f"model shard {self.path(rank)} is corrupt: cannot read {name!r} ({exc}); use "
                "another checkpoint"
            ) from exc


def _stage_of_each_name(reader: _ShardReader, mesh: MeshLayout, names: set[str]) -> dict[str, int]:
    """Pipeline stage each model name is read from (the first that holds it).

    Every rank of a stage must hold the same names, and together the stages exactly the
    model's: anything else means the recorded layout or the model config is not the one the
    shards were written with.
    """
    stage_of: dict[str, int] = {}
    for stage in range(mesh.pp):
        ranks = [mesh.rank_of(t, d, stage) for d in range(mesh.dp) for t in range(mesh.tp)]
        held = reader.keys(ranks[0])
        for rank in ranks[1:]:
            if reader.keys(rank) != held:
                diff = sorted(reader.keys(rank) ^ held)
                raise ValueError(
                    f"{reader.path(rank).name} and {reader.path(ranks[0]).name} belong to "
                    f"pipeline stage {stage} under the recorded layout (pp={mesh.pp}, "
                    f"tp={mesh.tp}, dp={mesh.dp}) but hold different names, e.g. {diff[:3]}: "
                    "meta.json's layout does not match the shard files"
                )
        for name in held:
            stage_of.setdefault(name, stage)
    missing, unexpected = sorted(names - set(stage_of)), sorted(set(stage_of) - names)
    if missing or unexpected:
        found = {"missing": missing, "unexpected": unexpected}
        parts = [f"{what} {len(keys)}, e.g. {keys[:3]}" for what, keys in found.items() if keys]
        raise ValueError(
            f"the shards of {reader.ckpt} do not hold the model's tensors ({'; '.join(parts)}): "
            "the model (or the config in the checkpoint) differs from the one that was "
            "trained, or its keys carry another prefix"
        )
    return stage_of


class _Split(NamedTuple):
    """How one whole tensor is split over the saved mesh."""

    tp_dim: int | None  # dim split over tp (None: every tp rank holds all of it)
    ep_dim: int | None  # dim split over ep (routed experts)
    vocab_rows: int | None  # rows to keep after the tp concat (vocab padding), or None
    shard_shape: tuple[int, ...]  # what every rank must hold


def _split_of(
    model: nn.Module,
    name: str,
    full_shape: tuple[int, ...],
    held: tuple[int, ...],
    mesh: MeshLayout,
) -> _Split:
    """How the whole tensor `name` was split, from its owning module in `model`.

    `held` (the first shard's shape) settles one question the one-process model cannot: a
    tensor-parallel layer built without a tp group (MLA's down-projections are replicated
    ColumnParallelLinears) holds the whole tensor on every rank.
    """
    prefix, _, local = name.rpartition(".")
    owner = model.get_submodule(prefix)
    tp_dim = None
    if isinstance(owner, _TensorParallelModule) and mesh.tp > 1 and held != full_shape:
        tp_dim = owner.tp_partition_dims.get(local)
    ep_dim = getattr(owner, "ep_partition_dims", {}).get(local) if mesh.ep > 1 else None
    shape, vocab_rows = list(full_shape), None
    if tp_dim is not None:
        rows = full_shape[tp_dim]
        # the embedding and the LM head pad the vocabulary to a multiple of tp (zero rows)
        if isinstance(owner, VocabParallelEmbedding) or prefix.endswith("lm_head"):
            rows, vocab_rows = pad_vocab_size(rows, mesh.tp), rows
        shape[tp_dim] = rows // mesh.tp if rows % mesh.tp == 0 else -1
    if ep_dim is not None:
        shape[ep_dim] = shape[ep_dim] // mesh.ep if shape[ep_dim] % mesh.ep == 0 else -1
    return _Split(tp_dim, ep_dim, vocab_rows, tuple(shape))


def _merge_one(
    reader: _ShardReader,
    mesh: MeshLayout,
    model: nn.Module,
    name: str,
    like: Tensor,
    stage: int,
    get: Callable[[int], Tensor] | None = None,
) -> Tensor:
    """The whole tensor `name` (shape `like.shape`) from the shards of pipeline `stage`.

    `get(rank)` gives a rank's shard of it (default: the model shard file's tensor `name`);
    another getter merges tensors shaped like the parameter the same way (optimizer state).
    """
    pieces = None if get is None else (lambda rank: in_memory(get(rank)))
    return _merged(reader, mesh, model, name, like, stage, pieces).read()


def _merged(
    reader: _ShardReader,
    mesh: MeshLayout,
    model: nn.Module,
    name: str,
    like: Tensor,
    stage: int,
    get: Callable[[int], LazyTensor] | None = None,
) -> LazyTensor:
    """`_merge_one`, lazily: the shards' shapes are checked now, their data read later.

    `get(rank)` gives a rank's shard as a LazyTensor (default: the model shard file's
    tensor `name`, nothing read).
    """
    get = get or (lambda rank: reader.lazy(rank, name))
    full_shape = tuple(like.shape)
    first = get(mesh.rank_of(0, 0, stage))
    split = _split_of(model, name, full_shape, tuple(first.shape), mesh)
    ep_pieces = []
    # ep rank e of the first expert-data-parallel group sits at dp rank e
    for ep_rank in range(mesh.ep if split.ep_dim is not None else 1):
        tp_pieces = []
        for tp_rank in range(mesh.tp if split.tp_dim is not None else 1):
            rank = mesh.rank_of(tp_rank, ep_rank, stage)
            piece = first if rank == mesh.rank_of(0, 0, stage) else get(rank)
            if tuple(piece.shape) != split.shard_shape:
                raise ValueError(
                    f"{reader.path(rank).name}: {name!r} has shape {tuple(piece.shape)}, which "
                    f"is no share of the whole tensor {full_shape} under the recorded layout "
                    f"(tp={mesh.tp}, ep={mesh.ep}; expected {split.shard_shape}): meta.json's "
                    "layout does not match the shard files, or the model config differs from "
                    "the one that was trained"
                )
            tp_pieces.append(piece)
        whole = concat(tp_pieces, split.tp_dim or 0)
        if split.vocab_rows is not None:  # the padding rows are never read
            whole = whole.narrow(0, 0, split.vocab_rows)
        ep_pieces.append(whole)
    merged = concat(ep_pieces, split.ep_dim or 0)
    assert tuple(merged.shape) == full_shape, (name, merged.shape, full_shape)
    return merged


def checkpoint_config(ckpt: str | Path) -> DeepSeekConfig | DenseConfig:
    """The model config a LanguageModelModule recorded in its training checkpoint `ckpt`.

    Raises:
        FileNotFoundError / ValueError: a missing or corrupt checkpoint, or one not written by a
            LanguageModelModule (no model config inside).
    """
    folder = Path(ckpt)
    files.read_meta(folder)  # a clear error for a folder that is no (complete) checkpoint
    shared = files.read_torch(folder / files.TRAINER_STATE_FILE)
    if "model_config" not in shared:
        raise ValueError(
            f"{folder} holds no model config; only checkpoints of a LanguageModelModule can be "
            "exported"
        )
    return config_from_dict(shared["model_config"])


def _model_from_checkpoint(ckpt: Path) -> nn.Module:
    """The whole LanguageModelModule-shaped model (meta device) of a checkpoint's config, under
    the attribute the module keeps it in, so its state_dict names match the shards'."""
    from nanotrain.models.build import build_model

    holder = nn.Module()
    holder.add_module(
        MODULE_PREFIX.rstrip("."), build_model(checkpoint_config(ckpt), device="meta")
    )
    return holder
