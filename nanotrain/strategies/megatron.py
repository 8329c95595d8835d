"""MegatronStrategy: tensor (+ sequence), context, pipeline, expert and data parallelism,
ZeRO-1/2/3.

It composes the pieces of `nanotrain.parallel`: a `ParallelMesh` of process groups (the model
is built against it in ``configure_model``), flat gradient buckets reduced while backward runs
(`data_parallel.GradBuckets`: dense weights over the data-parallel group, routed-expert weights
over the expert-data-parallel group), the sharded optimizer (`zero.ZeroOptimizer`) and the
cross-shard grad norm (`grads`). With ``pp > 1`` the microbatch loop is a pipeline schedule
(`megatron_pipeline.PipelineEngine`, GPipe, 1F1B or interleaved 1F1B) and the grad norm also
sums over the pipeline group. With ``ep > 1`` each MoE layer holds ``1 / ep`` of the routed
experts and moves token copies to them with all-to-all (`nanotrain.parallel.expert`).
``zero_stage=3`` replaces the buckets and the sharded optimizer by torch's FSDP2
(`nanotrain.parallel.fully_sharded`, driven by `megatron_sharded` / `megatron_zero3`).

Per optimizer step (the loop the Trainer drives):

1. every microbatch: ``training_step`` forward, ``(loss * weight).backward()``; on
   the last one the gradient buckets are reduced as soon as they are complete (dense over dp,
   experts over expert-dp; both divided by dp);
2. under sequence parallelism the grads of tp-replicated parameters (which saw only this
   rank's part of the sequence) are summed over tp;
3. the global grad norm counts tp-replicated parameters once and sums tp shards, experts over
   ep (and, under ZeRO-2, dp / expert-dp shards); clipping scales what the optimizer reads;
4. the update: the module's optimizer on whole parameters, or under ZeRO on this rank's flat
   slices followed by an all-gather of the parameters.

Loss averaging: the gradient is that of the objective over the whole global batch. Each loss
term's count (LM tokens, MTP targets, sequences; or just the tokens of a module that reports
one loss) is summed over every microbatch of every dp rank (one small all-reduce before any
backward) and each microbatch's term is weighed by ``count * dp / global_count`` (see
`weighting.weigh_microbatches`). `StepOutput.loss` is that same global objective and
`StepOutput.metrics` holds each term's global mean.

Context parallelism (``cp > 1``, `nanotrain.parallel.context`): the ``cp`` ranks of a
context-parallel group read the same samples and each keeps two chunks of every sequence
(`context_batch`, applied to every microbatch before anything counts or runs it). They hold
replicas of the weights: "dp" in the mesh is then the group of dp x cp weight replicas, over
which the loss counts are summed, the gradients averaged, ZeRO shards and the grad norm is
taken, exactly as for data-parallel ranks.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from nanotrain.parallel.data_parallel import GradBucketSets, backward_order
from nanotrain.parallel.grads import is_tp_sharded, sequence_parallel_params
from nanotrain.parallel.mesh import ParallelMesh, check_context, validate_layout
from nanotrain.parallel.schedules import SCHEDULES, splits_backward
from nanotrain.parallel.zero import ZeroOptimizer
from nanotrain.precision.master import MasterWeights
from nanotrain.strategies.base import (
    Strategy,
)
from nanotrain.strategies.megatron_collectives import MegatronCollectives
from nanotrain.strategies.megatron_environment import MegatronEnvironment
from nanotrain.strategies.megatron_evaluation import MegatronEvaluation
from nanotrain.strategies.megatron_grads import (
    MegatronGradNorms,
    build_grad_buckets,
    check_built_model,
    expert_param_ids,
)
from nanotrain.strategies.megatron_options import (
    check_context_module,
    check_model_layout,
    check_options,
)
from nanotrain.strategies.megatron_pipeline import (
    PipelineEngine,
)
from nanotrain.strategies.megatron_sharded import ShardedMethods
from nanotrain.strategies.megatron_step import MegatronStep
from nanotrain.strategies.megatron_zero3 import FullyShardedModel
from nanotrain.strategies.optimizers import OptimizerSetup

if TYPE_CHECKING:
    from nanotrain.module import NanoModule


class MegatronStrategy(
    MegatronEnvironment,
    MegatronEvaluation,
    MegatronStep,
    MegatronCollectives,
    ShardedMethods,
    MegatronGradNorms,
    Strategy,
):
    """Tensor, sequence, pipeline, expert and data parallelism with optional ZeRO-1/2, on an
    explicit mesh.

    Launch with torchrun (reads RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) or
    inside an already initialized process group (which is then left alone at teardown).
    Ranks are laid out tensor-fastest (see `nanotrain.parallel.mesh`); the ``tp`` ranks of one
    data-parallel replica read the same data. Expert parallelism is carved out of the
    data-parallel axis: the ``ep`` ranks of an expert-parallel group read different data and
    hold different routed experts (``dp_rank = ep_rank + ep * expert_dp_rank``).

    Args:
        tp: tensor-parallel size (must divide the world and the attention heads).
        pp: pipeline-parallel size (stages; the layers are split over pp × virtual_pp chunks).
        ep: expert-parallel size: the routed experts of every MoE layer are split over ``ep``
            ranks (must divide dp x cp and the model's number of routed experts).
        dp: data-parallel size (ranks reading different samples); None infers
            ``world_size // (tp * pp * cp)``.
        cp: context-parallel size: each sequence is cut into 2·cp chunks, rank i of a
            context-parallel group holding chunks i and 2·cp-1-i, and attention all-gathers
            the keys and values (MLA: its compressed latent) of the others
            (`nanotrain.parallel.context`). The sequence length must be a multiple of 2·cp
            (2·cp·tp with sequence parallelism). Not with capacity-limited MoE layers or
            overlap_forward_backward (refused, see docs/parallelism.md).
        zero_stage: 0 (replicated optimizer), 1 (optimizer state sharded over dp; expert
            state over expert-dp), 2 (also gradients reduce-scattered, each rank keeping
            its shard) or 3 (also parameters: torch's FSDP2 `fully_shard` per decoder layer,
            on routed experts over expert-dp, and on the root; see
            `nanotrain.parallel.fully_sharded`).
        sequence_parallel: shard norm/residual activations along the sequence over tp; the
            model must build its tensor-parallel layers with ``sequence_parallel=True``.
        bucket_size_mb: size of one gradient bucket (one collective) in MiB.
        backend: "nccl", "gloo" or None (NCCL when CUDA is available). One process started
            without torchrun needs no group and trains on GPU `LOCAL_RANK` (0) when CUDA is
            available, on the CPU with ``backend="gloo"`` or without CUDA.
        timeout_s: collective timeout in seconds for the groups this strategy creates (a
            pipeline transfer or collective that waits longer ends in a
            `CollectiveTimeoutError` naming it). None: the timeout of the default process
            group when this process is already in one, else 1800.
        virtual_pp: model chunks per pipeline rank (interleaved 1F1B when > 1; always 2
            under DualPipeV).
        schedule: "gpipe", "1f1b", "interleaved_1f1b", "zb_1f1b", "zb_interleaved_1f1b",
            "zb_h1" (these three: each backward split into its input and weight halves; ZB-H1
            also runs rank r's weight halves r microbatches late) or
            "dualpipev" (two chunks per rank in a V, forward and backward chunks paired;
            needs at least 2·pp microbatches); None picks 1F1B (interleaved when
            virtual_pp > 1). See `nanotrain.parallel.schedules`.
        pipeline_layout: layers per virtual stage, in model order (pp × virtual_pp numbers
            summing to the model's layers), e.g. fewer on the first and last stage; None
            splits evenly.
        overlap_forward_backward: where the schedule puts a forward of one chunk right
            before a backward of the other (DualPipeV's steady state; interleaved 1F1B's
            with two chunks), run the two side by side, so that one's expert all-to-alls
            wait while the other computes (`nanotrain.parallel.schedule_runner`). Needs two
            chunks per rank and tp=1; the second chunk's all-to-alls get groups of their own.
            CPU (gloo) only for now: refused at fit start on a GPU.
        ranks_per_node: processes per node, consecutive global ranks sharing a node; None:
            torchrun's LOCAL_WORLD_SIZE, else every rank on one node.
        node_limited_dispatch: send a token to another node once per node that holds one of
            its experts, forwarded inside the node to those experts (DeepSeek-V3's dispatch,
            `nanotrain.parallel.node_dispatch`), instead of once per expert. None: wherever an
            expert-parallel group spans several nodes (with equally many of its ranks on each)
            and the MoE layers are dropless; True: required (an error where it cannot apply);
            False: never. Every rank must see the same ranks_per_node.
        cpu_offload: ZeRO-3 only: keep parameter, gradient and optimizer-state shards in
            host memory (FSDP2's `CPUOffloadPolicy`; the optimizer steps on the CPU).
        reshard_after_forward: ZeRO-3 only: free each decoder layer's gathered parameters
            after its forward and gather them again in backward (True), or keep them from
            forward to backward (False: one all-gather fewer per layer, more memory).
        reduce_scatter_every_microbatch: ZeRO-3 with pp=1 only: reduce-scatter each
            microbatch's gradients into the shards (one reduce-scatter per microbatch)
            instead of accumulating whole rank-local gradients until the last microbatch
            (one reduce-scatter per step, but whole gradients in memory meanwhile).

    Raises:
        TypeError, ValueError: for invalid sizes or options, at construction (layouts that do
            not fit the world: in `setup_environment`, before any process group; layouts that
            do not fit the model, e.g. ep not dividing its experts: in `setup_module`, before
            the model is built).
    """

    def __init__(
        self,
        tp: int = 1,
        pp: int = 1,
        ep: int = 1,
        dp: int | None = None,
        zero_stage: int = 0,
        sequence_parallel: bool = False,
        bucket_size_mb: float = 25.0,
        backend: str | None = None,
        timeout_s: float | None = None,
        virtual_pp: int = 1,
        schedule: str | None = None,
        pipeline_layout: Sequence[int] | None = None,
        overlap_forward_backward: bool = False,
        ranks_per_node: int | None = None,
        node_limited_dispatch: bool | None = None,
        cpu_offload: bool = False,
        reshard_after_forward: bool = True,
        reduce_scatter_every_microbatch: bool = False,
        cp: int = 1,
    ) -> None:
        super().__init__()
        self.schedule, self.virtual_pp = check_options(
            tp=tp,
            pp=pp,
            ep=ep,
            dp=dp,
            cp=cp,
            zero_stage=zero_stage,
            bucket_size_mb=bucket_size_mb,
            virtual_pp=virtual_pp,
            schedule=schedule,
            pipeline_layout=pipeline_layout,
            overlap_forward_backward=overlap_forward_backward,
            ranks_per_node=ranks_per_node,
            node_limited_dispatch=node_limited_dispatch,
            cpu_offload=cpu_offload,
            reshard_after_forward=reshard_after_forward,
            reduce_scatter_every_microbatch=reduce_scatter_every_microbatch,
        )
        self.overlap_forward_backward = bool(overlap_forward_backward)
        self.pipeline_layout = None if pipeline_layout is None else list(pipeline_layout)
        self.ranks_per_node = ranks_per_node
        self.node_limited_dispatch = node_limited_dispatch
        self.reduce_scatter_every_microbatch = bool(reduce_scatter_every_microbatch)
        self.cpu_offload = bool(cpu_offload)
        self.reshard_after_forward = bool(reshard_after_forward)
        self._fsdp: FullyShardedModel | None = None
        self.tp, self.pp, self.ep, self.dp, self.cp = tp, pp, ep, dp, cp
        # the mesh's "dp" axis: weight replicas, context-parallel ranks included
        self.replicas = None if dp is None else dp * cp
        self.zero_stage = zero_stage
        self.sequence_parallel = bool(sequence_parallel)
        self.bucket_size_mb = bucket_size_mb
        self.backend = backend
        self.timeout_s = timeout_s
        self._mesh: ParallelMesh | None = None
        self._device: torch.device | None = None
        self._owns_process_group = False
        self._grads: GradBucketSets | None = None
        self._expert_sets: list[bool] = []  # per bucket set: holds routed-expert weights
        self._zero: ZeroOptimizer | None = None
        self._sharded: dict[int, bool] = {}
        self._sp_params: list[torch.nn.Parameter] = []
        self._pipeline: PipelineEngine | None = None

    # -- environment -----------------------------------------------------------------------------
    def validate_world(self, world_size: int) -> int:
        """Check the layout against ``world_size`` (no process needed); return the number of
        weight replicas (dp x cp: the mesh's "dp" axis).

        Raises:
            ValueError: naming the numbers and a valid alternative.
        """
        if self.cp > 1 and world_size % (self.tp * self.pp * self.cp) != 0:
            raise ValueError(
                f"tp*pp*cp={self.tp}*{self.pp}*{self.cp}={self.tp * self.pp * self.cp} does "
                f"not divide world_size={world_size}; pick a cp that does"
            )
        replicas = validate_layout(world_size, self.tp, self.pp, self.ep, self.replicas)
        check_context(replicas, self.cp)
        return replicas

    def validate_model(self, config: Any, world_size: int | None = None) -> None:
        """Check the layout against a model config's heads, experts and layers.

        Raises:
            ValueError: naming the numbers and a valid alternative.
        """
        check_model_layout(
            config,
            self.world_size if world_size is None else world_size,
            tp=self.tp,
            pp=self.pp,
            ep=self.ep,
            dp=self.replicas,
            virtual_pp=self.virtual_pp,
            pipeline_layout=self.pipeline_layout,
            node_limited_dispatch=self.node_limited_dispatch,
        )

    def check_step_microbatches(self, num_microbatches: int) -> None:
        """The schedule's own check (interleaving: a multiple of pp microbatches; DualPipeV:
        at least 2·pp), at fit start rather than at the first step."""
        if self.pp > 1:
            SCHEDULES[self.schedule](num_microbatches, self.pp, 0, self.virtual_pp)

    @property
    def root_device(self) -> torch.device:
        if self._device is None:
            raise RuntimeError("MegatronStrategy.setup_environment() has not run yet")
        return self._device

    @property
    def mesh(self) -> ParallelMesh:
        """The `ParallelMesh` the model is built against (after `setup_environment`)."""
        if self._mesh is None:
            raise RuntimeError("MegatronStrategy.setup_environment() has not run yet")
        return self._mesh

    # -- model and optimizer ----------------------------------------------------------------------
    def setup_module(self, module: NanoModule) -> None:
        """Validate the layout against ``module.config`` (if any), build the model, then set up
        gradient buckets (and, under ZeRO, flat parameters).

        Under ZeRO-3 a module this strategy has already wrapped (a `validate`/`test` after
        `fit`) is kept as it is: FSDP2 wraps a module once, and its shards are the trained
        parameters."""
        if self._fsdp is not None and self._fsdp.module is module:
            self.module = module
            return
        config = getattr(module, "config", None)
        if config is not None:
            self.validate_model(config)
        sequence_tp = self.tp if self.sequence_parallel else 1
        if self.cp > 1:  # what is known before the model is built ...
            check_context_module(module, self.cp, sequence_tp)
        super().setup_module(module)
        if self.cp > 1:  # ... and the config and sequence length it was built for
            check_context_module(module, self.cp, sequence_tp)
        params = backward_order(module)
        check_built_model(module, params, self.mesh, self.sequence_parallel)
        precision = self.precision
        if self.zero_stage == 3:
            self._fsdp = FullyShardedModel(
                module,
                self.mesh,
                precision,
                self.root_device,
                reshard_after_forward=self.reshard_after_forward,
                cpu_offload=self.cpu_offload,
                sequence_parallel=self.sequence_parallel,
                keep_gathered_in_backward=splits_backward(self.schedule, self.pp),
            )
            return
        self._grads, self._expert_sets = build_grad_buckets(
            params,
            expert_param_ids(module),
            self.mesh,
            self.bucket_size_mb,
            self.zero_stage,
            grad_dtype=torch.float32 if precision.master_weights else None,
            reduce_dtype=precision.reduce_dtype if precision.name != "32-true" else None,
        )
        self._sharded = is_tp_sharded(module)
        if self.sequence_parallel and self.mesh.tp_size > 1:
            self._sp_params = sequence_parallel_params(module)

    def setup_optimizers(self, module: NanoModule) -> OptimizerSetup:
        """Parse `configure_optimizers`; under ZeRO shard that optimizer in place (its LR
        scheduler keeps driving it: see `nanotrain.parallel.zero`)."""
        setup = super().setup_optimizers(module)
        masters = self.precision.master_weights
        if self._fsdp is not None:
            if masters and not self._fsdp.distributed:  # one process: plain fp32 masters
                self._master_holder = MasterWeights(setup.optimizer)
            return setup  # else FSDP2's fp32 shards are the master weights
        if self.zero_stage > 0:
            assert self._grads is not None, "setup_module() must run before setup_optimizers()"
            self._zero = ZeroOptimizer(
                setup.optimizer,
                self._grads,
                self.zero_stage,
                master_dtype=torch.float32 if masters else None,
            )
            self._master_holder = self._zero if masters else None
        elif masters:
            self._master_holder = MasterWeights(setup.optimizer)
        return setup

    # -- teardown --------------------------------------------------------------------------------
    def teardown(self) -> None:
        """Drop hooks and buffers; destroy the groups this strategy created, unless a
        distributed ZeRO-3 model still lives on them (kept until the process exits, so that
        `validate`/`test`/`predict` after `fit` run on the trained shards)."""
        if self._grads is not None:
            self._grads.remove_hooks()
        self._grads = self._zero = self._master_holder = None
        # the ZeRO-3 model stays wrapped: full_tensor still gathers its shards after fit
        self._expert_sets, self._sp_params = [], []
        # a distributed ZeRO-3 model's parameters are shards on this group's mesh, and FSDP2
        # wraps a module once: keep the group (and mesh) for validate/test/predict after fit
        keeps_shards = self._fsdp is not None and self._fsdp.distributed
        if self._owns_process_group and dist.is_initialized() and not keeps_shards:
            dist.destroy_process_group()
            self._owns_process_group = False
            self._mesh = None  # its groups died with the process group
            self._fsdp = None
            self._pipeline = None
