"""The pipeline-parallel half of MegatronStrategy: one optimizer step's schedule, forward-only
validation through the stages, and the cross-stage sums (loss terms, shared embedding grads,
grad norms).

How losses travel. Every chunk's forward returns its own share of the loss terms: the MoE
sequence-wise balance losses of its layers, and on the last stage also the LM loss and the MTP
losses. Each term is backpropagated on the stage that computed it, weighed by the strategy's
`LossAccumulator` (the microbatch's share of each term's global count), so the gradients are
those of the whole objective; the weighed sums are added over the pipeline group after the
schedule (then over dp by the strategy), which makes `StepOutput.loss` and the logged term
means global on every rank. For modules that log inside ``training_step``, the terms' values
(total, lm, aux, mtp, tokens per microbatch) are also summed over the pipeline group and
``training_step`` is *replayed* on every stage with them (`PipelineStage.replay`).
Validation replays ``validation_step`` the same way after a forward-only schedule.
"""

from __future__ import annotations

import datetime
import functools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor

from nanotrain.models.stages import PipelineStage
from nanotrain.models.transformer import ModelOutput
from nanotrain.parallel.fully_sharded import local_tensor
from nanotrain.parallel.grads import all_reduce_coalesced
from nanotrain.parallel.pipeline import PipelineComm, open_channels
from nanotrain.parallel.schedule_runner import ScheduleStats, run_schedule
from nanotrain.parallel.schedules import (
    ONE_CHUNK_SCHEDULES,
    SCHEDULES,
    V_SHAPED_SCHEDULES,
    forward_only,
)
from nanotrain.precision.base import Precision
from nanotrain.precision.master import grad_of
from nanotrain.runtime.host_copy import host_to_device
from nanotrain.runtime.profiling import named_range

if TYPE_CHECKING:
    from nanotrain.module import NanoModule
    from nanotrain.parallel.data_parallel import GradBucketSets
    from nanotrain.parallel.mesh import ParallelMesh
    from nanotrain.strategies.weighting import LossAccumulator

__all__ = [
    "PipelineEngine",
    "check_pairing",
    "check_pairing_device",
    "chunks_per_rank",
    "embedding_groups",
    "pick_schedule",
]

# columns of the per-microbatch loss-term table
_TOTAL, _LM, _AUX, _MTP, _HAS_MTP, _COUNT = range(6)


def pick_schedule(schedule: str | None, virtual_pp: int) -> str:
    """The schedule name to use: ``schedule`` checked, or 1F1B / interleaved 1F1B by default.

    Raises:
        ValueError: for an unknown name, or a one-chunk schedule (1f1b, zb_1f1b) with
            virtual_pp > 1.
    """
    if schedule is None:
        return "interleaved_1f1b" if virtual_pp > 1 else "1f1b"
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {sorted(SCHEDULES)}, got {schedule!r}")
    if schedule in ONE_CHUNK_SCHEDULES and virtual_pp > 1:
        raise ValueError(
            f"schedule={schedule!r} runs one chunk per rank but virtual_pp={virtual_pp}; use "
            "schedule='interleaved_1f1b' (or virtual_pp=1)"
        )
    if schedule in V_SHAPED_SCHEDULES and virtual_pp not in (1, 2):
        raise ValueError(
            f"schedule={schedule!r} runs two chunks per rank (a V) but virtual_pp={virtual_pp}; "
            "leave virtual_pp at 1 or 2"
        )
    return schedule


def check_pairing(pp: int, tp: int, chunks: int, schedule: str) -> None:
    """Refuse ``overlap_forward_backward`` where it cannot run: without pipelining, with other
    than two chunks per rank, or with tensor parallelism (every layer's tensor-parallel
    collectives, and the embedding's and the head's, would share one tp group between the
    two chunks, so their orders could cross).

    Raises:
        ValueError: naming the setting and the fix.
    """
    if pp == 1 or chunks != 2:
        raise ValueError(
            "overlap_forward_backward pairs a forward of one chunk with a backward of the "
            f"other: it needs pp > 1 and two chunks per rank, got pp={pp} and "
            f"{chunks} chunk(s) under schedule={schedule!r}; use schedule='dualpipev' (or "
            "virtual_pp=2), or overlap_forward_backward=False"
        )
    if tp > 1:
        raise ValueError(
            f"overlap_forward_backward needs tp=1, got tp={tp} (the two chunks' tensor-parallel "
            "collectives would share one group, in orders that can cross); use tp=1 as "
            "DeepSeek-V3 does, or overlap_forward_backward=False"
        )


def check_pairing_device(device: torch.device) -> None:
    """Refuse ``overlap_forward_backward`` off the CPU.

    Raises:
        ValueError: on a GPU, where the two threads would queue both chunks' all-to-alls on one
            CUDA stream, in an order that can differ between ranks and deadlock NCCL.
    """
    if device.type != "cpu":
        raise ValueError(
            "overlap_forward_backward runs on CPU (gloo) only for now: on a GPU the two "
            "threads would queue both chunks' all-to-alls on one CUDA stream, in an order "
            "that can differ between ranks and deadlock NCCL (a stream per chunk is not "
            "built yet); use overlap_forward_backward=False"
        )


def chunks_per_rank(schedule: str, virtual_pp: int, pp: int) -> int:
    """Model chunks each pipeline rank holds under `schedule` (checked by `pick_schedule`):
    two for DualPipeV's V whatever ``virtual_pp`` says (1 or 2), else ``virtual_pp``.

    Raises:
        ValueError: a V-shaped schedule without pipelining (pp = 1).
    """
    if schedule not in V_SHAPED_SCHEDULES:
        return virtual_pp
    if pp == 1:
        raise ValueError(f"schedule={schedule!r} needs pp > 1 (it places two chunks a rank)")
    return 2


def embedding_groups(mesh: ParallelMesh, timeout: datetime.timedelta | None) -> Any:
    """Create the {first stage, last stage} group of every pipeline (collective over the world:
    every rank creates every group in the same order) and return this rank's, or None."""
    mine = None
    for ranks in mesh.layout.groups("pp"):
        pair = sorted({ranks[0], ranks[-1]})
        group = dist.new_group(pair, timeout=timeout)
        if mesh.rank in pair:
            mine = group
    return mine


def _input_ids(batch: Any) -> Tensor:
    if isinstance(batch, dict) and "input_ids" in batch:
        return batch["input_ids"]
    if isinstance(batch, (list, tuple)) and batch and isinstance(batch[0], Tensor):
        return batch[0]
    if isinstance(batch, Tensor):
        return batch
    raise TypeError(
        "pipeline parallelism needs token batches (a dict with 'input_ids' or a tensor first), "
        f"got {type(batch).__name__}"
    )


class PipelineEngine:
    """Runs schedules for one rank of a pipeline.

    Args:
        mesh: the strategy's mesh (pp group and coordinates).
        schedule: a name from `nanotrain.parallel.schedules.SCHEDULES`.
        virtual_pp: chunks per rank.
        device: the rank's device.
        embedding_group: this rank's {first, last} stage group (or None).
        overlap: run paired forward and backward chunks side by side
            (`nanotrain.parallel.schedule_runner.run_schedule`'s ``overlap``).
    """

    def __init__(
        self,
        mesh: ParallelMesh,
        schedule: str,
        virtual_pp: int,
        device: torch.device,
        embedding_group: Any,
        overlap: bool = False,
    ) -> None:
        self.mesh, self.schedule, self.virtual_pp = mesh, schedule, virtual_pp
        self.overlap = overlap
        self.device, self.embedding_group = device, embedding_group
        self.last_stats: ScheduleStats | None = None
        self.v_shape = schedule in V_SHAPED_SCHEDULES
        order = mesh.layout.pipeline_channels(self.v_shape)
        open_channels(order, mesh.pp_channels, mesh.rank, device)

    @staticmethod
    def stage_of(module: NanoModule) -> PipelineStage:
        """The module's `PipelineStage` (built by its ``configure_model`` on a pp mesh).

        Raises:
            TypeError: when the module built no pipeline stage.
        """
        for sub in module.modules():
            if isinstance(sub, PipelineStage):
                return sub
        raise TypeError(
            "pp > 1 needs a module whose configure_model builds a PipelineStage "
            "(nanotrain.models.stages.build_pipeline_stage), as LanguageModelModule does"
        )

    def shared_params(self, module: NanoModule) -> list[torch.nn.Parameter]:
        """Parameters this stage shares with another (the embedding copy), each once."""
        stage = self.stage_of(module)
        named = dict(stage.named_parameters())
        return [named[n] for n in stage.shared_parameter_names() if named[n].requires_grad]

    def _comm(self, stage: PipelineStage, batch: Any, dtype: torch.dtype) -> PipelineComm:
        shape = stage.activation_shape(_input_ids(batch).shape)
        ranks = self.mesh.group_ranks("pp")
        return PipelineComm(
            ranks,
            self.mesh.pp_rank,
            self.virtual_pp,
            shape,
            dtype,
            self.device,
            channels=self.mesh.pp_channels,
            v_shape=self.v_shape,
        )

    def _forward_step(self, stage, step_fn, batches, terms: Tensor, objective=None):
        def forward_step(m: int, chunk: int, inp: Tensor | None):
            stage.select(chunk, inp)
            result = step_fn(batches[m])
            out = result.get("stage_output") if isinstance(result, dict) else None
            if out is None:
                raise TypeError(
                    "under pp > 1 the step must return {'loss': ..., 'stage_output': "
                    "StageOutput} for a pipeline chunk (see LanguageModelModule.training_step)"
                )
            row = terms[m]
            for col, value in ((_TOTAL, out.total_loss), (_LM, out.loss), (_AUX, out.aux_loss)):
                if value is not None:
                    row[col] += value.detach().double()
            if out.mtp_loss is not None:
                row[_MTP] += out.mtp_loss.detach().double()
                row[_HAS_MTP] = 1.0
            if out.num_tokens is not None:
                row[_COUNT] += out.num_tokens.double()
            loss = out.total_loss if objective is None else objective(m, result)
            return out.hidden, loss

        return forward_step

    def _global_terms(self, terms: Tensor, over_dp: bool) -> Tensor:
        """Sum each microbatch's terms over the stages; with ``over_dp`` also average them over
        data-parallel replicas (training logs are then global; validation syncs its own)."""
        if self.mesh.pp_size > 1:
            dist.all_reduce(terms, group=self.mesh.pp_group)
        if over_dp and self.mesh.dp_size > 1:
            dist.all_reduce(terms, group=self.mesh.dp_group)
            terms /= self.mesh.dp_size
        return terms

    @staticmethod
    def _replayed(row: Tensor, has_mtp: bool) -> ModelOutput:
        def f(col: int) -> Tensor:
            return row[col].float()

        # whether there is an MTP loss is the model's (static) config: reading the row's
        # flag would wait for the device
        mtp = f(_MTP) if has_mtp else None
        count = row[_COUNT].long()
        return ModelOutput(None, f(_LM), f(_AUX), mtp, f(_TOTAL), count)

    def train_step(
        self,
        module: NanoModule,
        microbatches: Sequence[Any],
        accumulator: LossAccumulator,
        batch_idx: int,
        grads: GradBucketSets,
        precision: Precision | None = None,
        run: Callable[..., Any] | None = None,
    ) -> Tensor:
        """Run the schedule (forward and backward of every microbatch, each chunk's loss
        terms weighed by ``accumulator.objective``), sum the shared embedding grads, reduce
        every grad over dp, and replay ``training_step`` with the global loss terms. Returns
        the accumulator's weighed term sums of this data-parallel replica, summed over stages
        (the strategy reduces them over dp). ``precision``: its forward context wraps every
        forward and its loss scale multiplies every backward. ``run``: calls each
        ``training_step`` (ZeRO-3: inside FSDP2's root hooks, `megatron_zero3`); under it
        ``grads`` reduce-scatter in ``finish`` after the whole schedule, before the shared
        embedding's sum (which then adds the two stages' equal shards)."""
        precision = precision or Precision()
        stage = self.stage_of(module)
        num_micro = len(microbatches)
        actions = SCHEDULES[self.schedule](
            num_micro, self.mesh.pp_size, self.mesh.pp_rank, self.virtual_pp
        )
        dtype = activation_dtype(stage, precision)
        terms = torch.zeros(num_micro, 6, dtype=torch.float64, device=self.device)

        def training_step(batch: Any) -> Any:
            with precision.forward_context():
                if run is not None:
                    return run(module.training_step, batch, batch_idx)
                return module.training_step(batch, batch_idx)

        step = self._forward_step(stage, training_step, microbatches, terms, accumulator.objective)
        params: Any = list(stage.parameters())
        if run is not None:  # ZeRO-3: the weight half differentiates the gathered copies
            params = functools.partial(grads.gathered_params, params)
        shared = self.shared_params(module)
        # With a shared embedding the dp reduction must wait for the cross-stage sum below;
        # otherwise it overlaps the last backward as without pipelining.
        before_last = None if shared or run is not None else (lambda: grads.set_sync(True))
        grads.set_sync(False)
        self.last_stats = run_schedule(
            actions,
            self._comm(stage, microbatches[0], dtype),
            step,
            loss_scales=[precision.loss_scale] * num_micro,
            before_last_backward=before_last,
            params=params,
            overlap=self.overlap,
        )
        if run is not None:
            with named_range("nanotrain/grad_reduction"):
                grads.finish()
        if shared:
            pieces = [local_tensor(grad_of(p)) for p in shared if grad_of(p) is not None]
            all_reduce_coalesced(pieces, self.embedding_group)
        if run is None:
            with named_range("nanotrain/grad_reduction"):
                grads.finish()
        terms = self._global_terms(terms, over_dp=True)
        has_mtp = _has_mtp(stage)
        with torch.no_grad():
            for m, batch in enumerate(microbatches):
                stage.replay(self._replayed(terms[m], has_mtp))
                module.training_step(batch, batch_idx)
        return self.sum_over_stages(accumulator.sums)

    def validation_step(
        self,
        module: NanoModule,
        batch: Any,
        batch_idx: int,
        precision: Precision | None = None,
        step_name: str = "validation_step",
        run: Callable[..., Any] | None = None,
    ) -> Any:
        """Forward-only through the stages (inside ``precision``'s forward context), then
        ``module.<step_name>`` ("validation_step" or "test_step") replayed with the global
        loss terms on every stage; returns what that replay returns."""
        eval_step = getattr(module, step_name)
        precision = precision or Precision()
        stage = self.stage_of(module)
        dtype = activation_dtype(stage, precision)
        terms = torch.zeros(1, 6, dtype=torch.float64, device=self.device)

        def validation_step(b: Any) -> Any:
            with precision.forward_context():
                return eval_step(b, batch_idx) if run is None else run(eval_step, b, batch_idx)

        step = self._forward_step(stage, validation_step, [batch], terms)
        actions = forward_only(1, self.mesh.pp_size, self.mesh.pp_rank, self.virtual_pp)
        run_schedule(actions, self._comm(stage, batch, dtype), step, forward_only=True)
        terms = self._global_terms(terms, over_dp=False)
        stage.replay(self._replayed(terms[0], _has_mtp(stage)))
        with torch.no_grad():
            return eval_step(batch, batch_idx)

    def square_norm_mask(self, module: NanoModule, params: Sequence[Tensor]) -> Tensor:
        """Per parameter, 1 where this stage counts it in the global norm, 0 for an embedding
        copy counted on the first stage instead."""
        shared = {id(p) for p in self.shared_params(module)}
        skip = not self.mesh.is_first_stage
        return host_to_device(
            [0.0 if skip and id(p) in shared else 1.0 for p in params], self.device
        )

    def sum_over_stages(self, value: Tensor) -> Tensor:
        """All-reduce (sum) ``value`` over the pipeline group, in place; returns it."""
        if self.mesh.pp_size > 1:
            dist.all_reduce(value, group=self.mesh.pp_group)
        return value

    def gather_over_stages(self, named: dict[str, float]) -> dict[str, float]:
        """Merge every stage's ``{name: value}`` (names of one stage's parameters)."""
        if self.mesh.pp_size == 1:
            return named
        parts: list[dict[str, float]] = [{} for _ in range(self.mesh.pp_size)]
        dist.all_gather_object(parts, named, group=self.mesh.pp_group)
        merged: dict[str, float] = {}
        for part in parts:
            for name, value in part.items():
                merged.setdefault(name, value)
        return merged


def _has_mtp(stage: PipelineStage) -> bool:
    """Whether the pipelined model computes an MTP loss (on its last stage, in training)."""
    return stage.training and getattr(stage.config, "mtp_depth", 0) > 0


def activation_dtype(stage: PipelineStage, precision: Precision) -> torch.dtype:
    """The dtype of the activations (and their gradients) the stages send each other: the
    dtype the parameters compute in. A precision with fp32 master weights ("bf16-true")
    computes in its ``param_dtype`` even where the parameters are fp32 (ZeRO-3's shards,
    gathered in ``param_dtype`` by FSDP2); else the parameters' own dtype."""
    if precision.master_weights:
        return precision.param_dtype
    return next(p.dtype for p in stage.parameters())
