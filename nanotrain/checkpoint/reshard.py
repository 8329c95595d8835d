"""Load a checkpoint under another parallel layout or world size than it was saved with.

A source gives whole (one-process) tensors by name: the model's, and each per-element
optimizer state (`optim_state.py`). For a checkpoint saved sharded, a whole tensor is put
together from the ranks' pieces: the ZeRO pieces of one replica first fill the rank-local
shard, then the shards of the tensor/expert-parallel ranks are concatenated as `merge.py`
does for the weights. The current rank then takes its own slice of every whole tensor the way
pretrained weights are loaded (`nanotrain.models.sharding`), and under ZeRO its flat piece.

Memory: each process holds the whole model's weights once while loading, and one whole
optimizer-state tensor at a time.
"""

from __future__ import annotations

import contextlib
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import SafetensorError, safe_open
from torch import Tensor

from nanotrain.checkpoint import files, optim_state
from nanotrain.checkpoint.layout import sharded_layout
from nanotrain.checkpoint.merge import (
    _merge_one,
    _model_from_checkpoint,
    _ShardReader,
    _stage_of_each_name,
    merge_model_shards,
    saved_mesh_layout,
)

if TYPE_CHECKING:
    from nanotrain.trainer import Trainer

_PREFIX = "model."  # LanguageModelModule keeps its model under this attribute


class _ShardedSource(contextlib.ExitStack):
    """Whole tensors of a checkpoint saved under a sharded layout."""

    def __init__(self, ckpt: Path, meta: dict[str, Any]) -> None:
        super().__init__()
        self.ckpt, self.meta = ckpt, meta
        self.mesh = saved_mesh_layout(ckpt, meta)
        self.template = _model_from_checkpoint(ckpt)
        self.expected = self.template.state_dict(keep_vars=True)
        self.reader = self.enter_context(_ShardReader(ckpt))
        self.stage_of = _stage_of_each_name(self.reader, self.mesh, set(self.expected))
        self._optim: dict[int, Any] = {}
        self.index: dict[tuple[str, str], dict[int, list[tuple[int, str]]]] = {}
        for rank in range(self.mesh.world_size):
            name = files.optim_shard_file(rank)
            if name not in meta["files"]:
                raise ValueError(
                    f"{ckpt} holds no {name}: it was saved before optimizer state was stored "
                    "by parameter name, so it can only be resumed under the layout it was "
                    f"saved with ({meta.get('layout')})"
                )
            handle = self.enter_context(_open(ckpt / name))
            self._optim[rank] = handle
            for text in handle.keys():
                key, start, pname = optim_state.parse_piece_key(text)
                self.index.setdefault((pname, key), {}).setdefault(rank, []).append((start, text))
        self.state_keys = sorted({key for _, key in self.index})

    def model(self) -> dict[str, Tensor]:
        return merge_model_shards(self.ckpt, self.template)

    def optimizer_full(self, name: str, key: str) -> Tensor | None:
        held = self.index.get((name, key))
        if not held:
            return None
        return _merge_one(
            self.reader,
            self.mesh,
            self.template,
            name,
            self.expected[name],
            self.stage_of[name],
            get=lambda rank: self._local(rank, name, key, held),
        )

    def _local(self, rank: int, name: str, key: str, held: dict[int, list]) -> Tensor:
        """The state `key` of `rank`'s shard of `name`, from the pieces of its replicas."""
        c = self.mesh.coords(rank)
        prefix, _, local = name.rpartition(".")
        owner = self.template.get_submodule(prefix)
        expert = self.mesh.ep > 1 and local in getattr(owner, "ep_partition_dims", {})
        shape = self.reader._handle(rank).get_slice(name).get_shape()
        numel = int(torch.Size(shape).numel())
        flat: Tensor | None = None
        seen: set[int] = set()
        covered = 0
        for dp in range(self.mesh.dp):
            if expert and dp % self.mesh.ep != c.ep_rank:
                continue  # another expert-parallel rank: other experts
            source = self.mesh.rank_of(c.tp_rank, dp, c.pp_rank)
            for start, text in held.get(source, []):
                if start in seen:
                    continue  # a replica's copy of a piece already placed
                piece = self._optim[source].get_tensor(text)
                if flat is None:
                    flat = torch.zeros(numel, dtype=piece.dtype)
                flat[start : start + piece.numel()] = piece
                seen.add(start)
                covered += piece.numel()
        if flat is None or covered != numel:
            raise ValueError(
                f"{self.ckpt}: the saved pieces of optimizer state {key!r} of {name!r} cover "
                f"{covered} of the {numel} elements of rank {rank}'s shard; the checkpoint is "
                "incomplete, use another one"
            )
        return flat.reshape(shape)


class _WholeSource:
    """Whole tensors of a checkpoint saved by a replicated strategy (one process, DDP)."""

    def __init__(self, ckpt: Path, meta: dict[str, Any], read: Any) -> None:
        self.model_state = read.model(ckpt, meta, files.MODEL_FILE)
        optimizer = read.torch(ckpt, meta, files.OPTIMIZER_FILE)
        names = meta.get("optimizer_param_names")
        if names is None:
            raise ValueError(f"{ckpt} records no optimizer parameter names; it cannot reshard")
        flat_names = [n for group in names for n in group]
        self.by_name: dict[str, dict[str, Any]] = {}
        scalars: dict[str, Any] = {}
        for index, name in enumerate(flat_names):
            for key, value in optimizer["state"].get(index, {}).items():
                if isinstance(value, Tensor) and value.dim() > 0:
                    self.by_name.setdefault(name, {})[key] = value
                else:
                    scalars.setdefault(key, value)
        precision = dict(optimizer.get("precision", {}))
        masters = precision.pop("master_weights", None)
        if masters is not None:
            # kept in optimizer order for the parameters not already fp32 (MasterWeights)
            low = [n for n in flat_names if self.model_state[n].dtype != torch.float32]
            for name, master in zip(low, masters, strict=True):
                self.by_name.setdefault(name, {})[optim_state.MASTER_KEY] = master
        groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer["param_groups"]]
        self.info = {"groups": groups, "scalars": scalars, "precision": precision}
        self.state_keys = sorted({k for entry in self.by_name.values() for k in entry})

    def model(self) -> dict[str, Tensor]:
        return self.model_state

    def optimizer_full(self, name: str, key: str) -> Tensor | None:
        return self.by_name.get(name, {}).get(key)


def load_resharded(
    trainer: Trainer, ckpt: Path, meta: dict[str, Any], payload: dict[str, Any], read: Any
) -> dict[str, Any]:
    """Fill `payload` (the shared trainer state already read) with this rank's model and
    optimizer state under the current layout, from a checkpoint saved under another one.

    `read` has `.model(ckpt, meta, name)` / `.torch(ckpt, meta, name)` (checksum-verified
    readers). The model weights are copied into the model here already.

    Raises:
        ValueError: the module is not a LanguageModelModule-like module with a `.model` built
            by nanotrain (resharding needs the owning modules to know how tensors split), the
            checkpoint lacks by-name optimizer state, or shapes do not fit.
    """
    strategy, module = trainer.strategy, trainer.module
    if meta.get("layout") is not None:
        source: Any = _ShardedSource(ckpt, meta)
        info = read.torch(ckpt, meta, files.rank_file(0)).get("optimizer_info")
    else:
        source = _WholeSource(ckpt, meta, read)
        info = source.info
    with source if isinstance(source, contextlib.ExitStack) else contextlib.nullcontext():
        full_model = source.model()
        shard = _place_model(strategy, module, full_model)
        payload["model"] = strategy.model_state_dict() if strategy.mesh is not None else full_model
        del full_model
        setup = strategy.optimizer_setup
        payload["optimizer"] = None
        if setup is not None and info is not None:
            cache: dict[tuple[str, str], Tensor | None] = {}

            def piece_of(slot: optim_state.Slot, key: str) -> Tensor | None:
                if (slot.name, key) not in cache:
                    cache.clear()  # slots of one parameter come together
                    whole = source.optimizer_full(slot.name, key)
                    cache[(slot.name, key)] = None if whole is None else shard(slot.name, whole)
                local = cache[(slot.name, key)]
                return (
                    None
                    if local is None
                    else local.reshape(-1)[slot.start : slot.start + slot.numel]
                )

            payload["optimizer"] = optim_state.import_state(
                strategy, info, source.state_keys, piece_of
            )
    payload.update(read.torch(ckpt, meta, files.rank_file(0)))
    payload.pop("model_extra", None)
    payload.pop("optimizer_info", None)
    warnings.warn(
        f"checkpoint {ckpt} was saved under {_describe(meta)} and is resharded for "
        f"{_describe_current(trainer)}: model, optimizer state, LR schedule and data position "
        "carry over; every rank restores rank 0's RNG state",
        stacklevel=4,
    )
    return payload


def _place_model(strategy: Any, module: Any, full: dict[str, Tensor]) -> Any:
    """Copy this rank's slices of `full` into the model (sharded layouts); return the function
    that slices a whole tensor named like a parameter for this rank."""
    if strategy.mesh is None:
        return lambda name, whole: whole
    from nanotrain.models.sharding import load_full_state_dict, shard_full_entry

    model = getattr(module, "model", None)
    if model is None:
        raise ValueError(
            f"resharding a checkpoint needs the model under `.model` of the module (as "
            f"LanguageModelModule keeps it); {type(module).__name__} has none. Resume with the "
            "layout the checkpoint was saved under"
        )
    inner = {k[len(_PREFIX) :]: v for k, v in full.items() if k.startswith(_PREFIX)}
    if getattr(strategy, "_fsdp", None) is not None:
        # ZeRO-3: the rank-local (tp / ep) slices, each rank then keeping its FSDP shard
        local = {}
        for name in strategy.module.state_dict():
            prefix, _, leaf = name[len(_PREFIX) :].rpartition(".")
            local[name] = shard_full_entry(model, model.get_submodule(prefix), leaf, full[name])
        strategy.load_model_state_dict(local)
    else:
        load_full_state_dict(model, inner, strict=True)

    def shard(name: str, whole: Tensor) -> Tensor:
        prefix, _, local = name[len(_PREFIX) :].rpartition(".")
        return shard_full_entry(model, model.get_submodule(prefix), local, whole)

    return shard


def _open(path: Path) -> Any:
    try:
        return safe_open(str(path), framework="pt", device="cpu")
    except (SafetensorError, OSError) as exc:
        raise ValueError(f"checkpoint file {path} is corrupt or truncated ({exc})") from exc


def _describe(meta: dict[str, Any]) -> str:
    layout = meta.get("layout")
    if layout is None:
        return f"{meta.get('strategy', '?')} on {meta['world_size']} rank(s)"
    axes = ("tp", "pp", "ep", "dp", "cp", "zero_stage")
    sizes = ", ".join(f"{k}={layout.get(k, 1 if k == 'cp' else 0)}" for k in axes)
    return f"{layout.get('strategy')}({sizes})"


def _describe_current(trainer: Trainer) -> str:
    layout = sharded_layout(trainer.strategy)
    meta = {"layout": layout, "strategy": type(trainer.strategy).__name__}
    return _describe({**meta, "world_size": trainer.world_size})
