"""Optimizer state keyed by parameter name, in pieces any parallel layout can put back together.

`torch.optim` numbers its state by parameter position, and under ZeRO its "parameters" are
flat slices of a bucket buffer: neither means anything under another layout. A checkpoint
therefore stores each state tensor shaped like a parameter (Adam's `exp_avg`/`exp_avg_sq`,
and any other entry with one value per parameter element, e.g. fp32 master copies kept as
optimizer state) as a 1-D *piece* of the rank-local parameter shard, flattened:

    "<state key>::<start>::<parameter name>"  ->  tensor [numel]

`start` is where the piece begins in the flattened rank-local shard (0 and the whole shard
without ZeRO). Where the rank-local shard sits in the whole tensor follows from the layout and
the owning module (`merge.py`). Entries that are not per-element (Adam's `step`, a loss-scaler
dict) are small and identical on every rank: they are kept once, as "scalars", and given to
every parameter on load; the param groups' hyperparameters (lr, betas, ...) are kept by group
index, which does not depend on the layout.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

from torch import Tensor
from torch.distributed.tensor import DTensor

SEP = "::"
#: the piece key of fp32 master weights (when the precision keeps parameters in bf16): the
#: values of the tensors the optimizer steps, saved like per-element state
MASTER_KEY = "master_weight"


class Slot(NamedTuple):
    """What one tensor the optimizer steps covers.

    Attributes:
        name: the full-model parameter name (as in the model state dict).
        start: where it begins in the flattened rank-local parameter.
        numel: its number of elements.
        shape: the optimizer tensor's own shape (the parameter's, or 1-D under ZeRO).
    """

    name: str
    start: int
    numel: int
    shape: tuple[int, ...]


def optimizer_slots(strategy: Any) -> list[list[Slot]]:
    """Per param group of `strategy.optimizer`, the `Slot` of each tensor it steps.

    Raises:
        ValueError: the optimizer steps a tensor that is no parameter of the module.
    """
    names = {id(p): n for n, p in strategy.module.named_parameters()}
    # fp32 master weights (bf16-true without ZeRO) stand in for their parameters.
    for param, master in getattr(getattr(strategy, "_master_holder", None), "pairs", []):
        names[id(master)] = names[id(param)]
    pieces: dict[int, Slot] = {}
    # ZeRO rewrites the groups to hold flat pieces; map each back to its parameter.
    zero = getattr(strategy, "_zero", None)
    if zero is not None:
        for k, piece, shard in zero.pieces:
            param = zero.sets.sets[k].layout.params[piece.param_index]
            slot = Slot(names[id(param)], piece.param_start, piece.numel, tuple(shard.shape))
            pieces[id(shard)] = slot
    groups = []
    for gi, group in enumerate(strategy.optimizer.param_groups):
        slots = []
        for q in group["params"]:
            if id(q) in pieces:
                slots.append(pieces[id(q)])
            elif id(q) in names and isinstance(q, DTensor):  # ZeRO-3: this rank's FSDP shard
                local = q.to_local()
                start = fsdp_shard_offset(q)
                slots.append(Slot(names[id(q)], start, local.numel(), tuple(local.shape)))
            elif id(q) in names:
                slots.append(Slot(names[id(q)], 0, q.numel(), tuple(q.shape)))
            elif getattr(strategy, "zero_stage", 0) and zero is None:
                raise ValueError(
                    "the ZeRO optimizer's shards are released when fit ends; save sharded "
                    "checkpoints during fit (ModelCheckpoint, or trainer.save_checkpoint in a "
                    "callback hook such as on_train_end)"
                )
            else:
                raise ValueError(
                    f"optimizer group {gi} steps a tensor of shape {tuple(q.shape)} that is no "
                    "parameter of the module; its state cannot be saved by parameter name"
                )
        groups.append(slots)
    return groups


def fsdp_shard_offset(param: DTensor) -> int:
    """Where this rank's FSDP2 shard of ``param`` (``Shard(0)``: rows in chunks of
    ``ceil(dim0 / group size)``) starts in the flattened rank-local tensor."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    _, offset = compute_local_shape_and_global_offset(
        param.shape, param.device_mesh, param.placements
    )
    if not param.shape:
        return 0
    row = param.shape[1:].numel()
    return min(int(offset[0]), param.shape[0]) * row


def piece_key(key: str, start: int, name: str) -> str:
    """The file key of a state piece."""
    return f"{key}{SEP}{start}{SEP}{name}"


def parse_piece_key(text: str) -> tuple[str, int, str]:
    """Inverse of `piece_key`: (state key, start, parameter name)."""
    key, start, name = text.split(SEP, 2)
    return key, int(start), name


def export_state(strategy: Any) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """This rank's optimizer state by parameter name.

    Returns:
        (pieces, info): `pieces` maps `piece_key(...)` to a 1-D tensor (with fp32 master
        weights, also their values under `MASTER_KEY`); `info` holds "groups" (each group's
        hyperparameters, without "params"), "scalars" (per-parameter state that is not per
        element, e.g. Adam's `step`, taken from the first parameter) and "precision" (the
        precision plugin's plain state, e.g. the loss scaler: the same on every rank).
    """
    optimizer = strategy.optimizer
    pieces: dict[str, Tensor] = {}
    scalars: dict[str, Any] = {}
    slots = optimizer_slots(strategy)
    keeps_masters = getattr(strategy, "_master_holder", None) is not None
    for group_slots, group in zip(slots, optimizer.param_groups, strict=True):
        for slot, q in zip(group_slots, group["params"], strict=True):
            if keeps_masters:
                pieces[piece_key(MASTER_KEY, slot.start, slot.name)] = q.detach().reshape(-1)
            for key, value in optimizer.state.get(q, {}).items():
                if isinstance(value, DTensor):
                    value = value.to_local()
                if isinstance(value, Tensor) and value.dim() > 0 and value.numel() == slot.numel:
                    pieces[piece_key(key, slot.start, slot.name)] = value.detach().reshape(-1)
                else:
                    scalars.setdefault(key, value)
    groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    precision = strategy.precision.state_dict() if hasattr(strategy, "precision") else {}
    return pieces, {"groups": groups, "scalars": scalars, "precision": precision}


def import_state(
    strategy: Any,
    info: dict[str, Any],
    state_keys: list[str],
    piece_of: Callable[[Slot, str], Tensor | None],
) -> dict[str, Any]:
    """The `strategy.optimizer_state_dict()` of the current layout, built slot by slot: the
    optimizer's state dict plus "precision" (the plugin's state and, when the strategy keeps
    fp32 masters and the checkpoint has them, "master_weights").

    Args:
        info: the "groups" and "scalars" `export_state` saved.
        state_keys: the per-element state keys saved (e.g. ["exp_avg", "exp_avg_sq"]).
        piece_of: `(slot, key)` -> the flat values of that slot (`slot.numel`), or None when
            the checkpoint holds no such state for it (the parameter then starts without).

    Raises:
        ValueError: the optimizer has another number of param groups than the saved one.
    """
    slots = optimizer_slots(strategy)
    if len(slots) != len(info["groups"]):
        raise ValueError(
            f"the optimizer has {len(slots)} param group(s), the checkpoint {len(info['groups'])}:"
            " configure_optimizers must build the same groups to resume its state"
        )
    state_keys = [k for k in state_keys if k != MASTER_KEY]
    state: dict[int, dict[str, Any]] = {}
    groups, index = [], 0
    for group_slots, saved_group in zip(slots, info["groups"], strict=True):
        indices = []
        for slot in group_slots:
            entry: dict[str, Any] = {}
            for key in state_keys:
                flat = piece_of(slot, key)
                if flat is not None:
                    entry[key] = flat.reshape(slot.shape).clone()
            if entry:
                entry.update({k: _copy(v) for k, v in info["scalars"].items()})
                state[index] = entry
            indices.append(index)
            index += 1
        groups.append({**saved_group, "params": indices})
    result: dict[str, Any] = {"state": state, "param_groups": groups}
    result["precision"] = dict(info.get("precision", {}))
    holder = getattr(strategy, "_master_holder", None)
    if holder is not None:
        # in the holder's own order, which `load_optimizer_state_dict` copies by position
        slot_of = {
            id(q): slot
            for group_slots, group in zip(slots, strategy.optimizer.param_groups, strict=True)
            for slot, q in zip(group_slots, group["params"], strict=True)
        }
        masters = [piece_of(slot_of[id(m)], MASTER_KEY) for m in holder.masters]
        if all(m is not None for m in masters):  # else they start from the loaded weights
            result["precision"]["master_weights"] = [
                m.reshape(q.shape).clone() for m, q in zip(masters, holder.masters, strict=True)
            ]
    return result


def _copy(value: Any) -> Any:
    return value.clone() if isinstance(value, Tensor) else value
