"""What the planner plans: a parallel layout (`PlanLayout`) and the batch it runs (`Workload`).

Both are plain frozen dataclasses, checked by the same rules the strategy applies at run time
(`MegatronStrategy.validate_model`, the pipeline partition, the schedule names), so a layout
the planner accepts is one `MegatronStrategy` accepts, and the error messages are the same.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from nanotrain.models.recompute import check_full_layers, check_recompute
from nanotrain.parallel.layout_checks import validate_layout
from nanotrain.parallel.mesh import MeshLayout
from nanotrain.parallel.node_dispatch import node_split
from nanotrain.parallel.pipeline import partition_layers, stage_layers
from nanotrain.parallel.placement import StagePlacement
from nanotrain.parallel.schedules import (
    SCHEDULES,
    Action,
    max_in_flight,
    splits_backward,
)
from nanotrain.precision import PRECISIONS as PRECISION_PLUGINS
from nanotrain.precision import precision_name
from nanotrain.strategies.megatron_options import check_options
from nanotrain.strategies.megatron_pipeline import pick_schedule

__all__ = [
    "KERNELS",
    "PRECISIONS",
    "PlanLayout",
    "Workload",
    "balanced_pipeline_layout",
    "pipeline_actions",
]

#: precision names the planner prices: the Trainer's `precision=` strings
PRECISIONS = tuple(PRECISION_PLUGINS)

#: the kernels a run computes with: name -> (elementwise ops, attention kernel).
#: "fused": norms, SwiGLU and RoPE at a fused kernel's bytes, attention at FlashAttention-3's
#: speed; "compiled": `torch.compile`d blocks (fused elementwise ops) around PyTorch's SDPA
#: (FlashAttention-2); "eager": eager PyTorch ops (`nanotrain.planning.memory_bound`) and SDPA
KERNELS: dict[str, tuple[str, str]] = {
    "fused": ("fused", "fa3"),
    "compiled": ("fused", "fa2"),
    "eager": ("eager", "fa2"),
}


@dataclass(frozen=True)
class PlanLayout(MeshLayout):
    """A `MegatronStrategy` layout: the mesh (`MeshLayout`: world = tp * cp * pp * dp, ep
    carved out of dp x cp, checked by the strategy's own `validate_layout`) and the strategy's
    settings that change memory and time.

    Attributes:
        tp, pp, dp, ep: tensor-, pipeline-, data- and expert-parallel sizes (dp: replicas
            that train different sequences).
        cp: context-parallel size: the ranks that share each sequence
            (`nanotrain.planning.context_parallel`); gradients and ZeRO reduce over dp x cp.
        virtual_pp: model chunks per pipeline rank (interleaved 1F1B when > 1; 2 under
            DualPipeV, whatever is given).
        zero_stage: 0, 1 or 2 (optimizer state, and with 2 the gradients, sharded over dp),
            or 3 (FSDP2: parameters too, `nanotrain.planning.zero3`).
        cpu_offload: ZeRO-3's shards, gradients and optimizer state on the host.
        reshard_after_forward: ZeRO-3 frees each block's gathered parameters after its
            forward and gathers them again in backward (False: kept, gathered once).
        reduce_scatter_every_microbatch: ZeRO-3 with pp = 1 reduce-scatters every
            microbatch's gradients into the shards instead of accumulating whole gradients
            until the last one.
        sequence_parallel: shard activations outside the tp matmuls along the sequence.
        pipeline_layout: layers per virtual stage (pp * virtual_pp numbers), None = even.
        schedule: a name of `nanotrain.parallel.schedules.SCHEDULES`; None = the strategy's default.
        recompute: None, "light", "selective" or "full" (`nanotrain.models.recompute`).
        recompute_full_layers: the first N decoder layers of each chunk recompute "full", the
            others `recompute` (`LanguageModelModule(recompute_full_layers=)`).
        bucket_size_mb: the strategy's gradient bucket size (ZeRO pads each bucket).
        overlap_forward_backward: paired forward and backward chunks run side by side (the
            strategy's option of that name).
        node_limited_dispatch: the strategy's option of that name (None: wherever an ep
            group spans nodes and the MoE layers are dropless).
        fp8_expert_activations: the routed experts keep their rows and SwiGLU inputs in fp8
            for backward (`LanguageModelModule(fp8_expert_activations=)`).
        fp8_dispatch: the routed copies cross the ep group in fp8 with tile scales
            (`LanguageModelModule(fp8_dispatch=)`; "fp8-emulated" does so anyway).
        fp8_expert_gemms: price the routed experts' grouped GEMMs at the fp8 peak of an fp8
            precision, as Megatron-Core's Transformer Engine grouped GEMMs run them. No
            nanotrain precision runs them so yet (`Precision.fp8_grouped_experts`): a plan
            with it says so in a note, and the search never sets it.
    """

    virtual_pp: int = 1
    cp: int = 1
    zero_stage: int = 0
    sequence_parallel: bool = False
    pipeline_layout: tuple[int, ...] | None = None
    schedule: str | None = None
    recompute: str | None = None
    recompute_full_layers: int = 0
    bucket_size_mb: float = 25.0
    overlap_forward_backward: bool = False
    node_limited_dispatch: bool | None = None
    fp8_expert_activations: bool = False
    fp8_dispatch: bool = False
    fp8_expert_gemms: bool = False
    cpu_offload: bool = False
    reshard_after_forward: bool = True
    reduce_scatter_every_microbatch: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.cp, bool) or not isinstance(self.cp, int) or self.cp < 1:
            raise ValueError(f"cp must be an int >= 1, got {self.cp!r}")
        # MeshLayout's check with the cp ranks among the data-parallel ones: experts are
        # drawn from dp x cp, as the runtime draws them
        validate_layout(self.world_size, self.tp, self.pp, self.ep, self.dp * self.cp)
        if self.pipeline_layout is not None:
            object.__setattr__(self, "pipeline_layout", tuple(self.pipeline_layout))
        # the strategy's own construction checks (`MegatronStrategy.__init__` runs the same
        # function), so a plan is refused exactly when the strategy would refuse it, with its
        # message; the schedule and chunk count are the strategy's resolved ones
        schedule, chunks = check_options(
            tp=self.tp,
            pp=self.pp,
            ep=self.ep,
            dp=self.dp,
            cp=self.cp,  # the strategy's own meaning: ZeRO and experts go over dp x cp
            zero_stage=self.zero_stage,
            bucket_size_mb=self.bucket_size_mb,
            virtual_pp=self.virtual_pp,
            schedule=self.schedule,
            pipeline_layout=self.pipeline_layout,
            overlap_forward_backward=self.overlap_forward_backward,
            ranks_per_node=None,
            node_limited_dispatch=self.node_limited_dispatch,
            cpu_offload=self.cpu_offload,
            reshard_after_forward=self.reshard_after_forward,
            reduce_scatter_every_microbatch=self.reduce_scatter_every_microbatch,
        )
        object.__setattr__(self, "schedule", schedule)
        object.__setattr__(self, "virtual_pp", chunks)
        # the model's options, not the strategy's (`LanguageModelModule` checks them)
        check_recompute(self.recompute)
        check_full_layers(self.recompute_full_layers, self.recompute)

    @property
    def world_size(self) -> int:
        """``tp * cp * pp * dp``."""
        return self.tp * self.cp * self.pp * self.dp

    @property
    def expert_dp(self) -> int:
        """Size of an expert-data-parallel group, ``dp * cp // ep``."""
        return self.dp * self.cp // self.ep

    @property
    def keeps_gathered_in_backward(self) -> bool:
        """Whether ZeRO-3 keeps each unit's gathered parameters from its backward until the
        step's reduce-scatter: under a schedule that splits backwards (zb_*, DualPipeV) the
        weight halves differentiate the gathered copies after FSDP2's post-backward hook
        (`MegatronStrategy`'s ``keep_gathered_in_backward``, the same rule)."""
        return self.zero_stage == 3 and splits_backward(self.schedule, self.pp)

    def layer_recompute(self, position: int) -> str | None:
        """The recompute mode of the decoder layer at `position` (0-based) within its chunk."""
        return "full" if position < self.recompute_full_layers else self.recompute

    def chunk_recomputes(self, layers: Sequence[int]) -> list[str | None]:
        """The recompute mode of each of a chunk's `layers`, in order."""
        return [self.layer_recompute(i) for i in range(len(layers))]

    def strategy(self) -> Any:
        """The `MegatronStrategy` of this layout (not set up: no process group is made)."""
        from nanotrain.strategies.megatron import MegatronStrategy

        context = {"cp": self.cp} if self.cp > 1 else {}
        zero3 = {}
        if self.zero_stage == 3:
            zero3 = dict(
                cpu_offload=self.cpu_offload,
                reshard_after_forward=self.reshard_after_forward,
                reduce_scatter_every_microbatch=self.reduce_scatter_every_microbatch,
            )
        return MegatronStrategy(
            **context,
            **zero3,
            tp=self.tp,
            pp=self.pp,
            ep=self.ep,
            dp=self.dp,
            zero_stage=self.zero_stage,
            sequence_parallel=self.sequence_parallel,
            virtual_pp=self.virtual_pp,
            schedule=self.schedule,
            pipeline_layout=self.pipeline_layout,
            bucket_size_mb=self.bucket_size_mb,
            overlap_forward_backward=self.overlap_forward_backward,
            node_limited_dispatch=self.node_limited_dispatch,
        )

    @classmethod
    def from_strategy(
        cls,
        strategy: Any,
        world_size: int,
        recompute: str | None = None,
        recompute_full_layers: int = 0,
        fp8_expert_activations: bool = False,
        fp8_dispatch: bool = False,
    ) -> PlanLayout:
        """The layout a `MegatronStrategy` (or single-device / DDP strategy) runs on
        `world_size` ranks; dp is inferred when the strategy leaves it unset."""
        tp = getattr(strategy, "tp", 1)
        pp = getattr(strategy, "pp", 1)
        cp = getattr(strategy, "cp", 1)
        dp = getattr(strategy, "dp", None) or world_size // (tp * pp * cp)
        layout = getattr(strategy, "pipeline_layout", None)
        return cls(
            cpu_offload=getattr(strategy, "cpu_offload", False),
            reshard_after_forward=getattr(strategy, "reshard_after_forward", True),
            reduce_scatter_every_microbatch=getattr(
                strategy, "reduce_scatter_every_microbatch", False
            ),
            tp=tp,
            pp=pp,
            dp=dp,
            cp=cp,
            ep=getattr(strategy, "ep", 1),
            virtual_pp=getattr(strategy, "virtual_pp", 1),
            zero_stage=getattr(strategy, "zero_stage", 0),
            sequence_parallel=getattr(strategy, "sequence_parallel", False),
            pipeline_layout=None if layout is None else tuple(layout),
            schedule=getattr(strategy, "schedule", None),
            overlap_forward_backward=getattr(strategy, "overlap_forward_backward", False),
            node_limited_dispatch=getattr(strategy, "node_limited_dispatch", None),
            recompute=recompute,
            recompute_full_layers=recompute_full_layers,
            fp8_expert_activations=fp8_expert_activations,
            fp8_dispatch=fp8_dispatch,
            # MegatronStrategy's bucket_size_mb, DDP's bucket_cap_mb
            bucket_size_mb=getattr(
                strategy, "bucket_size_mb", getattr(strategy, "bucket_cap_mb", 25.0)
            ),
        )

    def validate(self, config: Any) -> None:
        """Check the layout against the model with the strategy's own rules.

        Raises:
            ValueError / TypeError: the strategy's message (sizes that do not divide the
                heads, experts, layers or world size; a bad pipeline layout or schedule).
        """
        # how the model splits does not depend on the ZeRO stage: checked with a stage the
        # strategy of every version takes (ZeRO-3's refusals are mirrored in __post_init__)
        # the heads, experts and layers split as without cp (its own rule, seq_len a multiple
        # of 2 * cp, is the workload's: `context_parallel.check_seq_len`)
        split = replace(self, dp=self.dp * self.cp, cp=1) if self.cp > 1 else self
        if self.zero_stage == 3:
            split = replace(
                split,
                zero_stage=2,
                cpu_offload=False,
                reshard_after_forward=True,
                reduce_scatter_every_microbatch=False,
            )
        split.strategy().validate_model(config, world_size=self.world_size)
        if self.pp == 1 and self.virtual_pp == 1 and self.pipeline_layout is not None:
            partition_layers(config.num_layers, 1, 1, self.pipeline_layout)

    @property
    def placement(self) -> StagePlacement:
        """Which rank holds which virtual stage under this layout's schedule."""
        return StagePlacement.for_schedule(self.schedule, self.pp, self.virtual_pp)

    def ep_nodes(self, config: Any, ranks_per_node: int | None) -> tuple[int, int] | None:
        """(nodes, ep ranks per node) of the expert-parallel groups when the MoE layers
        dispatch node-limited on nodes of `ranks_per_node` ranks (the strategy's rule), else
        None (flat dispatch)."""
        if ranks_per_node is None or self.ep == 1 or self.node_limited_dispatch is False:
            return None
        if self.cp > 1:  # the ep groups are drawn from dp x cp, as in the folded mesh
            return replace(self, dp=self.dp * self.cp, cp=1).ep_nodes(config, ranks_per_node)
        if getattr(config, "capacity_factor", None) is not None:
            return None
        try:
            nodes, per_node = node_split(self.group_of("ep", 0), ranks_per_node)
        except ValueError:
            if self.node_limited_dispatch:
                raise
            return None
        if nodes == 1 and self.node_limited_dispatch:
            raise ValueError(
                f"node_limited_dispatch=True, but the expert-parallel group (ep={self.ep}) lies "
                f"on one node of {ranks_per_node} GPUs; use node_limited_dispatch=None"
            )
        return (nodes, per_node) if nodes > 1 else None

    def stage_chunks(self, config: Any, pp_rank: int) -> list[list[int]]:
        """Layer indices of each chunk pipeline rank `pp_rank` holds (the strategy's split)."""
        v_shape = self.placement.v_shape
        chunks = _stage_chunks(
            config.num_layers, self.pp, pp_rank, self.virtual_pp, self.pipeline_layout, v_shape
        )
        return [list(c) for c in chunks]

    def schedule_actions(self, num_microbatches: int, pp_rank: int) -> tuple[Action, ...]:
        """The schedule's forward/backward actions on pipeline rank `pp_rank` (the code's own
        schedule function, not a model of it)."""
        return pipeline_actions(self.schedule, num_microbatches, self.pp, pp_rank, self.virtual_pp)

    def in_flight(self, num_microbatches: int, pp_rank: int) -> int:
        """Most (microbatch, chunk) forwards rank `pp_rank` holds activations of at once."""
        if self.pp == 1:
            return 1  # gradient accumulation frees each microbatch before the next
        return _in_flight(self.schedule, num_microbatches, self.pp, pp_rank, self.virtual_pp)

    def describe(self) -> str:
        """Short text, e.g. ``tp1 pp4x2 dualpipev dp8 ep4 zero1 full-recompute overlapped`` (the
        schedule named when it is not the default for its chunks per rank)."""
        parts = [f"tp{self.tp}"] + ([f"cp{self.cp}"] if self.cp > 1 else [])
        if self.pp > 1:
            pipe = f"pp{self.pp}"
            if self.virtual_pp > 1:
                pipe += f"x{self.virtual_pp}"
            parts.append(pipe)
            if self.schedule != pick_schedule(None, self.virtual_pp):
                parts.append(self.schedule)
        parts.append(f"dp{self.dp}")
        if self.ep > 1:
            parts.append(f"ep{self.ep}")
        if self.zero_stage:
            parts.append(f"zero{self.zero_stage}")
        if self.zero_stage == 3 and not self.reshard_after_forward:
            parts.append("no-reshard")
        if self.reduce_scatter_every_microbatch:
            parts.append("rs-every-mb")
        if self.cpu_offload:
            parts.append("offload")
        if self.sequence_parallel and self.tp > 1:
            parts.append("sp")
        if self.recompute_full_layers:
            parts.append(f"{self.recompute or 'no'}-recompute+{self.recompute_full_layers}full")
        elif self.recompute:
            parts.append(f"{self.recompute}-recompute")
        if self.fp8_expert_activations:
            parts.append("fp8-expert-acts")
        if self.fp8_dispatch and self.ep > 1:
            parts.append("fp8-dispatch")
        if self.fp8_expert_gemms:
            parts.append("fp8-expert-gemms")
        if self.overlap_forward_backward:
            parts.append("overlapped")
        if self.node_limited_dispatch is False and self.ep > 1:
            parts.append("flat-dispatch")
        return " ".join(parts)

    def replace(self, **changes: Any) -> PlanLayout:
        """A copy with some fields changed (validated again)."""
        return replace(self, **changes)


@dataclass(frozen=True)
class Workload:
    """The batch a step trains and the precision it trains in.

    Attributes:
        seq_len: tokens per sequence.
        micro_batch_size: sequences per microbatch on one data-parallel rank.
        global_batch_size: sequences per optimizer step over all data-parallel ranks.
        precision: a `PRECISIONS` name, an alias the Trainer takes ("bf16", 32) or a
            precision plugin object (kept as its name).
        optimizer_states: fp32 tensors of optimizer state per parameter (AdamW: 2 moments).
        kernels: which kernels the step runs, a `KERNELS` name ("fused", "compiled",
            "eager"): how the memory-bound operations and attention are priced.
    """

    seq_len: int
    micro_batch_size: int = 1
    global_batch_size: int = 1
    precision: str = "bf16-mixed"
    optimizer_states: int = 2
    kernels: str = "fused"

    def __post_init__(self) -> None:
        for name in ("seq_len", "micro_batch_size", "global_batch_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if self.kernels not in KERNELS:
            raise ValueError(f"kernels must be one of {sorted(KERNELS)}, got {self.kernels!r}")
        # aliases ("bf16", 32) and plugin objects as the Trainer takes them
        object.__setattr__(self, "precision", precision_name(self.precision))

    def num_microbatches(self, layout: PlanLayout) -> int:
        """Microbatches per step on one data-parallel rank.

        Raises:
            ValueError: when the global batch does not split into micro_batch_size * dp.
        """
        per_step = self.micro_batch_size * layout.dp
        if self.global_batch_size % per_step != 0:
            raise ValueError(
                f"global_batch_size={self.global_batch_size} is not a multiple of "
                f"micro_batch_size*dp={self.micro_batch_size}*{layout.dp}={per_step}; pick a "
                "global batch that is, or another micro_batch_size or dp"
            )
        return self.global_batch_size // per_step

    @property
    def tokens_per_step(self) -> int:
        """Tokens one optimizer step trains on."""
        return self.global_batch_size * self.seq_len


def balanced_pipeline_layout(num_layers: int, chunks: int) -> tuple[int, ...] | None:
    """Layers per virtual stage when `num_layers` does not split evenly: every chunk gets
    ``ceil(L / chunks)`` and the last chunks give back the excess (the last stage also runs
    the head, loss and MTP, so it is the one to lighten). None when layers split evenly;
    raises when a chunk would be left empty.

    Example: 61 layers on 16 stages -> 15 x 4 + 1.

    Raises:
        ValueError: fewer layers than chunks, or an excess one chunk cannot give back.
    """
    if num_layers % chunks == 0:
        return None
    if num_layers < chunks:
        raise ValueError(f"{num_layers} layers cannot fill {chunks} pipeline chunks")
    per = -(-num_layers // chunks)
    layout = [per] * chunks
    excess = per * chunks - num_layers
    i = chunks - 1
    while excess:
        give = min(excess, layout[i] - 1)
        layout[i] -= give
        excess -= give
        i -= 1
    return tuple(layout)


# A search prices thousands of layouts that share a few (schedule, microbatches, pp, rank)
# shapes; each schedule is built once (the actions are frozen, so sharing them is safe).
@functools.lru_cache(maxsize=4096)
def pipeline_actions(
    schedule: str | None, num_microbatches: int, pp: int, pp_rank: int, virtual_pp: int
) -> tuple[Action, ...]:
    """`SCHEDULES[schedule]`'s actions on pipeline rank `pp_rank` (None: 1F1B), built once per
    shape."""
    fn = SCHEDULES[schedule or "1f1b"]
    return tuple(fn(num_microbatches, pp, pp_rank, virtual_pp))


@functools.lru_cache(maxsize=4096)
def _in_flight(
    schedule: str | None, num_microbatches: int, pp: int, pp_rank: int, virtual_pp: int
) -> int:
    return max_in_flight(
        list(pipeline_actions(schedule, num_microbatches, pp, pp_rank, virtual_pp))
    )


@functools.lru_cache(maxsize=65536)
def _stage_chunks(
    num_layers: int,
    pp: int,
    pp_rank: int,
    virtual_pp: int,
    pipeline_layout: tuple[int, ...] | None,
    v_shape: bool,
) -> tuple[tuple[int, ...], ...]:
    """`stage_layers`, once per shape (a search asks for each rank's chunks many times)."""
    chunks = stage_layers(num_layers, pp, pp_rank, virtual_pp, pipeline_layout, v_shape)
    return tuple(tuple(c) for c in chunks)
