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
from torch import Tensor

from nanotrain.parallel.context import context_batch
from nanotrain.parallel.data_parallel import GradBucketSets, backward_order
from nanotrain.parallel.grads import is_tp_sharded, sequence_parallel_params
from nanotrain.parallel.mesh import ParallelMesh, check_context, validate_layout
from nanotrain.parallel.schedules import SCHEDULES, splits_backward
from nanotrain.parallel.zero import ZeroOptimizer
from nanotrain.precision.master import MasterWeights
from nanotrain.runtime.profiling import named_range
from nanotrain.strategies.base import (
    DataShard,
    MicrobatchHooks,
    StepOutput,
    Strategy,
)
from nanotrain.strategies.megatron_environment import MegatronEnvironment
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
from nanotrain.strategies.megatron_zero3 import FullyShardedModel
from nanotrain.strategies.optimizers import OptimizerSetup
from nanotrain.strategies.rendezvous import (
    launched_local_rank,
    launched_rank,
    launched_world_size,
)
from nanotrain.strategies.weighting import LossAccumulator, weigh_microbatches

if TYPE_CHECKING:
    from nanotrain.module import NanoModule

_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "mean": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}


class MegatronStrategy(MegatronEnvironment, ShardedMethods, MegatronGradNorms, Strategy):
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

    @property
    def global_rank(self) -> int:
        return launched_rank()

    @property
    def local_rank(self) -> int:
        return launched_local_rank()

    @property
    def world_size(self) -> int:
        return launched_world_size()

    def data_shard(self) -> DataShard:
        """``(data_rank, dp // cp)``: tensor- and context-parallel peers read the same
        samples (context-parallel ones then keep different chunks of them)."""
        return DataShard(self.mesh.data_rank, self.mesh.data_size)

    @property
    def gradient_replicas(self) -> int:
        """Weight replicas: the mesh's dp group (data x context parallel ranks)."""
        return self.mesh.dp_size

    @property
    def metric_process_group(self) -> Any:
        return self.mesh.dp_group

    def barrier(self, name: str | None = None) -> None:
        if dist.is_initialized():
            dist.barrier()

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        if not dist.is_initialized():
            return obj
        holder = [obj]
        dist.broadcast_object_list(holder, src=src)
        return holder[0]

    def gather_from_stages(self, obj: Any) -> list[Any]:
        """Every pipeline stage's ``obj`` in stage order (an object all-gather over this
        rank's pipeline group); ``[obj]`` without pipelining."""
        if self.mesh.pp_size == 1:
            return [obj]
        parts: list[Any] = [None] * self.mesh.pp_size
        dist.all_gather_object(parts, obj, group=self.mesh.pp_group)
        return parts

    def reduce(self, tensor: Tensor, op: str = "mean") -> Tensor:
        """Reduce over the data-parallel group (tp peers already hold the same values)."""
        if op not in _REDUCE_OPS:
            raise ValueError(f"reduce op must be one of {sorted(_REDUCE_OPS)}, got {op!r}")
        out = tensor.detach().clone()
        if self.mesh.dp_size > 1:
            dist.all_reduce(out, op=_REDUCE_OPS[op], group=self.mesh.dp_group)
        if op == "mean":
            out = out / self.mesh.dp_size
        return out

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

    # -- one optimizer step ------------------------------------------------------------------------
    def forward_backward(
        self,
        module: NanoModule,
        microbatches: Sequence[Any],
        batch_idx: int,
        hooks: MicrobatchHooks | None = None,
    ) -> StepOutput:
        """Accumulate the gradient of the mean loss over the global batch's tokens; reduce it
        over dp (and tp under SP). `hooks` need `supports_microbatch_hooks`."""
        if self.cp > 1:  # this rank's two chunks of every sequence
            microbatches = [context_batch(mb, self.mesh.cp_group) for mb in microbatches]
        if self._fsdp is not None:
            return self._forward_backward_sharded(module, microbatches, batch_idx, hooks)
        grads = self._grads
        assert grads is not None, "setup_module() must run before forward_backward()"
        weighed = weigh_microbatches(self, module, microbatches)
        accumulator = LossAccumulator(weighed)
        grads.attach()
        last: tuple[Any, Tensor] | None = None  # the last microbatch's output and objective
        if self._pipeline is not None:
            sums = self._pipeline.train_step(
                module, microbatches, accumulator, batch_idx, grads, self.precision
            )
        else:
            sums, last = self._accumulate(
                module, microbatches, accumulator, batch_idx, grads, hooks
            )
        self._reduce_sequence_parallel_grads()
        if hooks is not None and last is not None:  # its gradients are reduced by now
            hooks.after()
            hooks.end(len(microbatches) - 1, *last)
        if self.zero_stage == 2:
            grads.release()
        if self.precision.uses_loss_scaling:
            self._unscale_grads()
        return self._step_output(accumulator, sums, weighed)

    def _step_output(self, accumulator: LossAccumulator, sums: Tensor, weighed: Any) -> StepOutput:
        """The step's global loss terms (reduced from the accumulator's local `sums`) with its
        token and sample counts and the precision's metrics."""
        loss, terms = accumulator.finish(self, sums)
        return StepOutput(
            loss=loss,
            num_tokens=weighed.tokens,
            num_samples=weighed.samples,
            metrics={**terms, **self.precision.step_metrics()},
            skipped=self.precision.skip_step,
        )

    def _accumulate(
        self,
        module: NanoModule,
        microbatches: Sequence[Any],
        accumulator: LossAccumulator,
        batch_idx: int,
        grads: GradBucketSets,
        hooks: MicrobatchHooks | None = None,
    ) -> tuple[Tensor, tuple[Any, Tensor]]:
        """Forward and backward of each microbatch in turn; dp reduction on the last one.
        Returns the accumulator's local sums of the (weighed) loss terms, and the last
        microbatch's `training_step` output and objective (for its end hook)."""
        num_micro = len(microbatches)
        for i, microbatch in enumerate(microbatches):
            grads.set_sync(i == num_micro - 1)
            if hooks is not None:
                hooks.start(i, microbatch)
            with named_range("nanotrain/forward"), self.precision.forward_context():
                output = module.training_step(microbatch, batch_idx + i)
            objective = accumulator.objective(i, output)
            if hooks is not None:
                hooks.before(i, objective)
            with named_range("nanotrain/backward"):
                self.precision.scale_loss(objective).backward()
            if hooks is not None and i < num_micro - 1:
                hooks.after()
                hooks.end(i, output, objective)
        with named_range("nanotrain/grad_reduction"):
            grads.finish()
        return accumulator.sums, (output, objective)

    def validation_step(
        self, module: NanoModule, batch: Any, batch_idx: int, step_name: str = "validation_step"
    ) -> Any:
        """Forward only: through the pipeline stages under pp > 1 (every stage logs the
        global values), else `module.<step_name>` ("validation_step" or "test_step").
        Under context parallelism each rank runs its chunks of the whole sequences, and the
        logged means reduce over the dp x cp ranks (`metric_process_group`)."""
        if self.cp > 1:
            batch = context_batch(batch, self.mesh.cp_group)
        if self._pipeline is not None:
            run = None if self._fsdp is None else self._fsdp.run
            return self._pipeline.validation_step(
                module, batch, batch_idx, self.precision, step_name, run=run
            )
        if self._fsdp is not None:
            with torch.no_grad(), self.precision.forward_context():
                return self._fsdp.run(getattr(module, step_name), batch, batch_idx)
        return super().validation_step(module, batch, batch_idx, step_name)

    def predict_step(self, module: NanoModule, batch: Any, batch_idx: int) -> Any:
        """`module.predict_step` forward-only; refused under pp > 1, where no stage holds a
        whole model to return predictions from."""
        if self.cp > 1:
            raise ValueError(
                "Trainer.predict is not supported under context parallelism (cp > 1): each "
                "rank holds only chunks of the sequences; predict with cp=1"
            )
        if self._pipeline is not None:
            raise ValueError(
                "Trainer.predict is not supported under pipeline parallelism (pp > 1): no "
                "stage holds the whole model; predict with pp=1 (tp/ep/dp are fine), or export "
                "the checkpoint with `nanotrain export` and predict from that"
            )
        if self._fsdp is not None:
            with torch.no_grad(), self.precision.forward_context():
                return self._fsdp.run(module.predict_step, batch, batch_idx)
        return super().predict_step(module, batch, batch_idx)

    def generation_refusal(self) -> str | None:
        """Under pp > 1 each rank holds some of the layers, under cp > 1 each rank's model
        runs chunks of every sequence: neither runs a whole-sequence `generate`."""
        if self.pp > 1:
            return "pipeline parallelism (pp > 1) splits the model's layers over ranks"
        if self.cp > 1:
            return "context parallelism (cp > 1) splits every sequence over ranks"
        return None

    @property
    def supports_microbatch_hooks(self) -> bool:
        """Not under pp > 1 (forward and backward run per model chunk inside the schedule)."""
        return self.pp == 1

    @property
    def supports_backward_hooks(self) -> bool:
        """Not under pp > 1 nor ZeRO-2/3 (the reduced gradients live in this rank's shards,
        not whole in `.grad`)."""
        return self.pp == 1 and self.zero_stage < 2

    def _updater(self) -> Any:
        """Under ZeRO the sharded optimizer (it updates this rank's shard, on fp32 masters when
        the precision keeps them, then all-gathers the parameters); else as every strategy."""
        return self._zero if self._zero is not None else super()._updater()

    def average_grads_(self) -> None:
        """Average every parameter's `.grad` over the data-parallel group, in place (manual
        optimization's `manual_backward`, which runs only under data parallelism alone: tp,
        pp, ep and ZeRO are refused at fit start). One flat all-reduce per dtype, as
        `DDPStrategy.average_grads_`; gradients already equal on every replica stay so."""
        assert self.module is not None
        if self.mesh.dp_size == 1:
            return
        by_dtype: dict[torch.dtype, list[Tensor]] = {}
        for p in self.module.parameters():
            if p.grad is not None:
                by_dtype.setdefault(p.grad.dtype, []).append(p.grad)
        for same in by_dtype.values():
            flat = torch.cat([g.reshape(-1) for g in same])
            dist.all_reduce(flat, group=self.mesh.dp_group)
            flat /= self.mesh.dp_size
            for g, piece in zip(same, flat.split([g.numel() for g in same]), strict=True):
                g.copy_(piece.view_as(g))

    def zero_grad(self) -> None:
        """Zero the gradient buffers (the grads stay views of them); under ZeRO-3 drop the
        gradient shards."""
        if self._fsdp is not None:
            self.optimizer.zero_grad(set_to_none=True)
            return
        assert self._grads is not None
        self._grads.zero_()

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
