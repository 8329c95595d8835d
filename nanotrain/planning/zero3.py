"""ZeRO-3 (FSDP2, `MegatronStrategy(zero_stage=3)`) priced from the rank's meta-device model.

The wrapping rule is the strategy's (`nanotrain.parallel.fully_sharded`): every routed-expert
stack is one FSDP unit over the expert-data-parallel group, every decoder layer one over the
data-parallel group (its experts excluded), and the root (embedding, final norm, head, MTP
blocks, anything left) one over the data-parallel group that is never resharded after
forward.

FSDP2 shards each parameter on dim 0 of the rank-local tensor (a tensor-parallel slice):
``c = ceil(rows / g)`` rows per rank of a group of `g`, rank r holding
``clamp(rows - r * c, 0, c)`` of them (torch.chunk). What a rank allocates:

* parameters: a padded ``c x rest`` buffer per tensor on every rank (`sharded_numel`);
* gradients: the reduce-scatter output of each unit, padded the same way, in the parameter's
  dtype (`sharded_numel` again);
* optimizer state: AdamW's moments are ``zeros_like`` the unpadded local shard, so rank r
  holds its own rows only (`local_numels`; rank 0 holds the most, ``c`` rows per tensor),
  plus one 4-byte step counter per tensor, also on ranks whose shard is empty;
* gathered copies while a unit computes (`gathered_bytes`, not held between steps; under a
  split-backward pipeline schedule every unit's, kept from its backward to the step's end).

With ``cpu_offload`` the sharded parameters, gradients and optimizer state live on the host:
the GPU holds only the gathered copies.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from nanotrain.planning.layout import PlanLayout, pipeline_actions
from nanotrain.planning.rank_model import RankModel

__all__ = [
    "HOST_ADAM_BYTES_PER_S",
    "Zero3Units",
    "gathered_bytes",
    "gathers_per_step",
    "kept_gathered_bytes",
    "local_numels",
    "sharded_numel",
    "zero3_units",
]

#: host bytes/s one GPU's share of the CPU moves through torch's AdamW under cpu_offload: an
#: assumption, not a measurement (a two-socket DDR5 host streams a few hundred GB/s; torch's
#: CPU AdamW touches 28 B per fp32 element and runs well below that): 20 GB/s per GPU
HOST_ADAM_BYTES_PER_S = 20e9
#: bytes AdamW reads and writes per element on the host: param, grad, two moments read (16),
#: param and two moments written (12)
ADAM_BYTES_PER_ELEMENT = 28


def _rows_rest(p: torch.Tensor) -> tuple[int, int]:
    if p.dim() == 0:
        return 1, 1
    rows = p.shape[0]
    return rows, (p.numel() // rows if rows else 0)


def sharded_numel(params: Iterable[torch.Tensor], group: int) -> int:
    """Elements of FSDP2's padded shards of `params` on any rank of a group of `group`:
    ``sum(ceil(rows / group) * rest)`` (the parameter and gradient buffers)."""
    total = 0
    for p in params:
        rows, rest = _rows_rest(p)
        total += -(-rows // group) * rest
    return total


def local_numels(params: Iterable[torch.Tensor], group: int) -> list[int]:
    """Elements of the unpadded shard of `params` on each rank of a group of `group`
    (torch.chunk's rows: ``clamp(rows - r * ceil(rows / group), 0, ceil(rows / group))``);
    index = rank in the group."""
    out = [0] * group
    for p in params:
        rows, rest = _rows_rest(p)
        chunk = -(-rows // group)
        for r in range(group):
            out[r] += min(max(rows - r * chunk, 0), chunk) * rest
    return out


@dataclass(frozen=True)
class Zero3Units:
    """A rank's FSDP units, each a list of its parameters (meta tensors).

    Attributes:
        root: the root unit (embedding, final norm, head, anything not in a block).
        blocks: each decoder layer without its routed experts (over dp).
        experts: each routed-expert stack (over expert-dp).
    """

    root: list[torch.Tensor]
    blocks: list[list[torch.Tensor]]
    experts: list[list[torch.Tensor]]


def _block_modules(module: nn.Module) -> list[nn.Module]:
    """Entries of every ``layers`` ModuleList or ModuleDict, once each (the strategy's rule;
    a pipeline stage reaches its layers twice)."""
    seen: dict[int, nn.Module] = {}
    for name, sub in module.named_modules():
        if name.rpartition(".")[2] != "layers":
            continue
        entries = sub.values() if isinstance(sub, nn.ModuleDict) else sub
        if isinstance(sub, nn.ModuleDict | nn.ModuleList):
            for block in entries:
                seen.setdefault(id(block), block)
    return list(seen.values())


def zero3_units(rank: RankModel) -> Zero3Units:
    """The FSDP units of `rank`'s module under the strategy's wrapping rule (module
    docstring); only the trainable parameters the rank trains (`RankModel.dense` and
    `.experts`), each once."""
    if rank._units:
        return rank._units[0]
    trained = {id(p) for p in rank.dense} | {id(p) for p in rank.experts}
    expert_ids = {id(p) for p in rank.experts}
    placed: set[int] = set()
    experts: list[list[torch.Tensor]] = []
    for sub in rank.module.modules():  # expert stacks: modules owning only expert params
        own = [p for p in sub.parameters(recurse=False) if id(p) in trained]
        if own and all(id(p) in expert_ids for p in own):
            experts.append([p for p in own if id(p) not in placed])
            placed.update(id(p) for p in own)
    blocks = []
    for block in _block_modules(rank.module):
        params = [p for p in block.parameters() if id(p) in trained and id(p) not in placed]
        placed.update(id(p) for p in params)
        blocks.append(params)
    root = [p for p in rank.dense + rank.experts if id(p) not in placed]
    units = Zero3Units(root=root, blocks=[b for b in blocks if b], experts=experts)
    rank._units.append(units)
    return units


def gathers_per_step(layout: PlanLayout, micro: int, pp_rank: int = 0) -> tuple[int, int]:
    """(all-gathers of the root unit, all-gathers of each block and expert stack) one rank of
    pipeline stage `pp_rank` makes per step of `micro` microbatches.

    A unit is gathered where it is needed and not gathered already: in every forward, and
    again in its backward with ``reshard_after_forward`` (the root, never resharded after
    forward, once per microbatch). Under a split-backward schedule
    (`PlanLayout.keeps_gathered_in_backward`) a unit stays gathered from its backward (B or
    I) until the step's reduce-scatter, or until its next forward frees it: the gathers are
    counted by walking the schedule's actions, per model chunk (the runnable schedules give
    every chunk the same count, ``micro + 1`` with resharding; the largest is taken), and
    the root is gathered once per step."""
    if not layout.keeps_gathered_in_backward:
        return micro, micro * (2 if layout.reshard_after_forward else 1)
    gathered: dict[int, bool] = {}
    count: dict[int, int] = {}
    for action in pipeline_actions(layout.schedule, micro, layout.pp, pp_rank, layout.virtual_pp):
        chunk = action.chunk
        if action.kind == "W":  # differentiates the copies its I left gathered
            continue
        if not gathered.get(chunk, False):
            count[chunk] = count.get(chunk, 0) + 1
        # a forward frees them again with reshard_after_forward; a backward keeps them
        gathered[chunk] = action.kind != "F" or not layout.reshard_after_forward
    return 1, max(count.values(), default=0)


def kept_gathered_bytes(rank: RankModel, layout: PlanLayout, gather_size: int) -> int:
    """Bytes of the gathered copies a rank holds after its schedule's last backward, before
    the step's reduce-scatter, under a split-backward schedule
    (`PlanLayout.keeps_gathered_in_backward`; 0 otherwise): every unit of the stage (root,
    blocks, expert stacks) in FSDP2's padded all-gather buffers, ``sharded_numel x group``
    elements of `gather_size` bytes each. Exact (`tests/distributed/test_plan_zero3.py`)."""
    if not layout.keeps_gathered_in_backward:
        return 0
    units = zero3_units(rank)
    dense = sharded_numel(units.root, layout.dp) + sum(
        sharded_numel(b, layout.dp) for b in units.blocks
    )
    experts = sum(sharded_numel(e, layout.expert_dp) for e in units.experts)
    return (dense * layout.dp + experts * layout.expert_dp) * gather_size


def gathered_bytes(rank: RankModel, layout: PlanLayout, gather_size: int, grad_size: int) -> int:
    """Peak bytes of gathered (unsharded) copies a rank holds while it computes, an estimate
    (not held between steps, not measured on CPU): the root unit's parameters (gathered for
    the whole step) plus, with ``reshard_after_forward``, the two largest blocks' (the one
    computing and the one FSDP2 prefetches, each with its experts) and one block's unsharded
    gradient before its reduce-scatter; without it, every block's parameters stay gathered
    from its forward to its backward. Under a schedule that splits backwards
    (`PlanLayout.keeps_gathered_in_backward`: zb_*, DualPipeV with pp > 1) every unit keeps
    its gathered parameters from its backward until the step's reduce-scatter, so by the
    cooldown's last backwards the whole stage is gathered: every block counts
    (`kept_gathered_bytes`). Sizes: `gather_size` bytes per parameter element (the
    mixed-precision policy's compute dtype), `grad_size` per gradient element."""
    units = zero3_units(rank)
    dp, edp = layout.dp, layout.expert_dp
    root = sharded_numel(units.root, dp) * dp
    per_block = [sharded_numel(b, dp) * dp for b in units.blocks]
    # experts belong to the layer that computes them: add each stack to the largest blocks
    # (an upper bound: every MoE layer has one stack of the same size)
    stacks = sorted((sharded_numel(e, edp) * edp for e in units.experts), reverse=True)
    per_block.sort(reverse=True)
    for i, s in enumerate(stacks[: len(per_block)]):
        per_block[i] += s
    if not per_block:
        return (root * gather_size) + root * grad_size
    if layout.reshard_after_forward and not layout.keeps_gathered_in_backward:
        held = sum(per_block[:2])
    else:
        held = sum(per_block)
    in_backward = (root + held) * gather_size + per_block[0] * grad_size
    at_root = root * (gather_size + grad_size)  # the root's own gradient, at the very end
    return max(in_backward, at_root)
