"""One rank's model, built on the meta device from the code's own constructors, and its counts.

The planner never re-derives how a layout splits a model: it builds, for each pipeline rank,
exactly what `MegatronStrategy` builds there (`build_model` / `PipelineStage`, with the
tensor- and expert-parallel layers sized by stand-in groups) on the meta device, where even
the 671B model costs no memory, and counts what is there. The stand-in `LayoutGroup` has the
two methods the layers ask a process group (`size()`, `rank()`).

Every rank of a pipeline stage holds tensors of the same shapes (tp and ep ranks hold equal
slices), so one build per pipeline rank covers the whole world.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from nanotrain.models.build import build_model
from nanotrain.models.stages import PipelineStage
from nanotrain.parallel.data_parallel import FlatLayout, backward_order
from nanotrain.planning.layout import PlanLayout
from nanotrain.strategies.megatron_grads import bucket_numel_for, expert_param_ids

__all__ = ["LayoutGroup", "RankModel", "build_rank_model", "rank_models"]


@dataclass(frozen=True)
class LayoutGroup:
    """Stand-in for a process group of `n` ranks seen from rank `r` (no communication)."""

    n: int
    r: int = 0

    def size(self) -> int:
        """Ranks in the group."""
        return self.n

    def rank(self) -> int:
        """This rank's index in the group."""
        return self.r


@dataclass(frozen=True)
class _Mesh:
    """The attributes of a `ParallelMesh` that the model builders read."""

    tp_group: LayoutGroup | None
    ep_group: LayoutGroup | None
    pp_size: int
    pp_rank: int


@dataclass(frozen=True)
class RankModel:
    """What one rank of pipeline stage `pp_rank` holds, read from its meta-device model.

    Attributes:
        pp_rank: the pipeline rank.
        chunks: layer indices of each of its chunks.
        dense: its non-expert trainable parameters in gradient-buffer order (tied once).
        experts: its routed-expert parameters (its 1/ep of the experts).
        buffers: elements of its buffers (router bias and load counters, RoPE caches).
        buffer_bytes: their bytes, each in its own dtype.
        module: the meta-device model (a `PipelineStage` under pp > 1).
    """

    pp_rank: int
    chunks: list[list[int]]
    dense: list[torch.Tensor]
    experts: list[torch.Tensor]
    buffers: int
    buffer_bytes: int
    module: nn.Module
    _flat: dict[tuple[int, int, int, float], tuple[int, int]] = field(
        default_factory=dict, compare=False, repr=False
    )
    _units: list[Any] = field(default_factory=list, compare=False, repr=False)  # ZeRO-3's

    @property
    def dense_params(self) -> int:
        """Elements of the non-expert trainable parameters."""
        return sum(p.numel() for p in self.dense)

    @property
    def expert_params(self) -> int:
        """Elements of the routed-expert parameters."""
        return sum(p.numel() for p in self.experts)

    @property
    def params(self) -> int:
        """All trainable parameter elements on this rank."""
        return self.dense_params + self.expert_params

    def flat_numels(self, layout: PlanLayout, element_size: int) -> tuple[int, int]:
        """Elements of the dense and expert flat buffers the strategy allocates for gradients
        (and ZeRO for parameters): buckets of `layout.bucket_size_mb` MiB of parameters of
        `element_size` bytes, each padded to a multiple of dp (dense) or dp / ep (experts)."""
        key = (layout.dp, layout.expert_dp, element_size, layout.bucket_size_mb)
        if key not in self._flat:
            numel = bucket_numel_for(element_size, layout.bucket_size_mb)
            dense = FlatLayout(self.dense, layout.dp, numel).numel if self.dense else 0
            experts = FlatLayout(self.experts, layout.expert_dp, numel).numel if self.experts else 0
            self._flat[key] = (dense, experts)
        return self._flat[key]


def build_rank_model(config: Any, layout: PlanLayout, pp_rank: int = 0) -> nn.Module:
    """The model pipeline rank `pp_rank` of `layout` builds, on the meta device.

    A whole `CausalLM` for pp == 1, else its `PipelineStage` (the same chunks and the same
    embedding / head / MTP placement as `build_pipeline_stage`).
    """
    full = _full_model(config, layout.tp, layout.ep, layout.sequence_parallel)
    if layout.pp == 1:
        return full
    chunks = layout.stage_chunks(config, pp_rank)
    return PipelineStage(full, chunks, layout.pp, pp_rank, layout.placement.v_shape)


_FULL: dict[tuple[str, int, int, bool], nn.Module] = {}
_CONFIG_KEYS: dict[int, tuple[Any, dict[str, Any], str]] = {}


def config_key(config: Any) -> str:
    """`repr(config)`, the planner's cache key of a model config, made again only when the
    config changed (a search asks for it hundreds of thousands of times; comparing its fields
    with a copy taken with the key costs about a fifth of a repr)."""
    hit = _CONFIG_KEYS.get(id(config))
    if hit is None or hit[0] is not config or vars(config) != hit[1]:
        if len(_CONFIG_KEYS) > 64:
            _CONFIG_KEYS.clear()
        hit = (config, copy.deepcopy(vars(config)), repr(config))
        _CONFIG_KEYS[id(config)] = hit
    return hit[2]


def _full_model(config: Any, tp: int, ep: int, sequence_parallel: bool) -> nn.Module:
    """The whole model one rank of a tp x ep layout builds (meta device), cached: a
    `PipelineStage` only picks modules of it, so every pipeline rank can share one build."""
    key = (config_key(config), tp, ep, sequence_parallel)
    if key not in _FULL:
        if len(_FULL) > 256:
            _FULL.clear()
        mesh = _Mesh(LayoutGroup(tp) if tp > 1 else None, LayoutGroup(ep) if ep > 1 else None, 1, 0)
        _FULL[key] = build_model(
            config, mesh=mesh, device="meta", sequence_parallel=sequence_parallel
        )
    return _FULL[key]


def _rank_model(config: Any, layout: PlanLayout, pp_rank: int) -> RankModel:
    module = build_rank_model(config, layout, pp_rank)
    params = backward_order(module)  # trainable, deduplicated, in gradient-buffer order
    expert_ids = expert_param_ids(module)
    if layout.pp > 1:
        chunks = layout.stage_chunks(config, pp_rank)
    else:
        chunks = [list(range(config.num_layers))]
    return RankModel(
        pp_rank=pp_rank,
        chunks=chunks,
        dense=[p for p in params if id(p) not in expert_ids],
        experts=[p for p in params if id(p) in expert_ids],
        buffers=sum(b.numel() for b in module.buffers()),
        buffer_bytes=sum(b.numel() * b.element_size() for b in module.buffers()),
        module=module,
    )


_CACHE: dict[tuple[str, PlanLayout, int], RankModel] = {}
_VALID: set[tuple[str, PlanLayout]] = set()  # (config, layout) pairs already validated


def rank_models(config: Any, layout: PlanLayout) -> list[RankModel]:
    """`RankModel` of every pipeline rank (index = pp rank), cached per config and layout.

    Raises:
        ValueError: when the layout does not fit the model (`PlanLayout.validate`).
    """
    checked = (config_key(config), layout)
    if checked not in _VALID:
        layout.validate(config)
        if len(_VALID) > 4096:
            _VALID.clear()
        _VALID.add(checked)
    # dp, zero, recompute and the schedule (but for its placement) do not change what a
    # rank builds: share the builds
    v_schedule = layout.schedule if layout.placement.v_shape else None
    shape = layout.replace(
        dp=layout.ep,
        zero_stage=0,
        cpu_offload=False,
        reshard_after_forward=True,
        reduce_scatter_every_microbatch=False,
        recompute=None,
        recompute_full_layers=0,
        schedule=v_schedule,
    )
    out = []
    for r in range(layout.pp):
        key = (config_key(config), shape, r)
        if key not in _CACHE:
            if len(_CACHE) > 4096:
                _CACHE.clear()
            _CACHE[key] = _rank_model(config, shape, r)
        out.append(_CACHE[key])
    return out
