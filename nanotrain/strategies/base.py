"""The Strategy interface: everything that depends on how a job is laid out across processes.

The Trainer calls these methods in a fixed order and never asks what kind of parallelism is in
use. A strategy owns the process groups, wraps the model, runs the microbatch loop of one
optimizer step (`forward_backward`), reduces gradients and metrics, clips, steps the optimizer,
and produces the state that checkpoints hold.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from nanotrain.parallel.grads import clip_grads_
from nanotrain.precision.base import Precision
from nanotrain.precision.master import grad_of, load_into
from nanotrain.runtime.profiling import named_range
from nanotrain.strategies.optimizers import (
    OptimizerSetup,
    parse_manual_config,
    parse_optimizer_config,
)
from nanotrain.strategies.weighting import (  # noqa: F401  (re-exported: strategies use them)
    LossAccumulator,
    MicrobatchWeights,
    extract_loss,
    weigh_microbatches,
)

if TYPE_CHECKING:
    from nanotrain.module import NanoModule


@dataclass(frozen=True)
class DataShard:
    """Which slice of every global batch this process reads.

    `index` in `[0, count)`; processes that must see the same samples (tensor- or
    pipeline-parallel peers) share an index. `count` is the number of distinct slices.
    """

    index: int = 0
    count: int = 1


@dataclass
class StepOutput:
    """What one optimizer step produced, identical on every rank.

    Attributes:
        loss: scalar tensor, the training objective over the whole global batch (every
            microbatch of every data-parallel rank; with loss terms, the weighted sum of each
            term's global mean), on every rank.
        num_tokens: tokens in the global batch, as counted by `NanoModule.count_tokens`: a
            0-dim float64 tensor on the root device (whole numbers). It stays on the device
            so that a step needs no host read; `trainer.state.consumed_tokens` is the
            running total as a Python int.
        num_samples: samples in the global batch, the same kind of tensor
            (`trainer.state.consumed_samples`: the running total).
        grad_norm: global L2 norm of the gradients before clipping, set by
            `Strategy.clip_grad_norm_` (None until then).
        metrics: extra scalar tensors a strategy reports, logged by the Trainer: the global
            mean of each loss term under its name (e.g. "train/lm_loss"; see
            `nanotrain.loss_terms`).
        skipped: True when the update was discarded: by the precision plugin (an fp16
            overflow on any rank, known when `forward_backward` returns) or at a callback's
            request (`Trainer.request_skip_step()`).
        skip_flag: a 0-dim bool device tensor when a callback asked to skip the update
            only where a device-side condition holds (`Trainer.request_skip_step(when)`);
            True where the update was discarded. None otherwise.
    """

    loss: Tensor
    num_tokens: Tensor
    num_samples: Tensor
    grad_norm: Tensor | None = None
    metrics: dict[str, Tensor] = field(default_factory=dict)
    skipped: bool = False
    skip_flag: Tensor | None = None


def skip_on_device(
    optimizer: torch.optim.Optimizer, skip_if: Tensor | None
) -> contextlib.AbstractContextManager:
    """Within the block, `optimizer.step()` is a no-op where `skip_if` (0-dim bool tensor) is
    True, with no host read: torch's fused optimizers take the flag GradScaler hands them
    (`found_inf`) and skip the update and the step count on the device. A no-op context
    for `skip_if=None`."""
    return _NO_SKIP if skip_if is None else _skip_on_device(optimizer, skip_if)


_NO_SKIP = contextlib.nullcontext()


@contextlib.contextmanager
def _skip_on_device(optimizer: torch.optim.Optimizer, skip_if: Tensor) -> Iterator[None]:
    if not getattr(optimizer, "_step_supports_amp_scaling", False):
        raise ValueError(
            f"{type(optimizer).__name__} cannot skip an update on the device; use a fused "
            "optimizer (e.g. AdamW(fused=True), LanguageModelModule(optimizer_impl='fused')) "
            "or request the skip on the host (Trainer.request_skip_step())"
        )
    optimizer.found_inf = skip_if.float().reshape(())  # type: ignore[attr-defined]
    try:
        yield
    finally:
        del optimizer.found_inf  # type: ignore[attr-defined]


@dataclass
class MicrobatchHooks:
    """What `forward_backward` runs around each microbatch `i` of a step (Lightning's
    per-batch hooks; only where `supports_microbatch_hooks`):

    - `start(i, microbatch)` before its forward;
    - `before(i, objective)` between its forward and its backward, with the (unscaled)
      scalar backward is called on;
    - `after()` once its gradients are in `.grad` (for the last microbatch: reduced across
      replicas, as under Lightning's DDP);
    - `end(i, output, objective)` after that, with its `training_step` output.
    """

    start: Callable[[int, Any], None]
    before: Callable[[int, Tensor], None]
    after: Callable[[], None]
    end: Callable[[int, Any, Tensor], None]


class Strategy(ABC):
    """Base class of every strategy; subclasses implement the layout-specific parts.

    Lifecycle (called by the Trainer, in this order): `setup_environment()`,
    `setup_module(module)`, `setup_optimizers(module)`, then per step `forward_backward`,
    `clip_grad_norm_`, `optimizer_step`; `validation_step` during validation; `teardown()`.
    """

    def __init__(self) -> None:
        self.module: NanoModule | None = None
        self.optimizer_setup: OptimizerSetup | None = None
        #: the precision plugin this strategy applies (`nanotrain.precision`; fp32 default)
        self.precision: Precision = Precision()
        #: what holds fp32 master weights when the precision keeps parameters low (an object
        #: with ``masters`` (list of tensors) that checkpoints save), else None
        self._master_holder: Any = None

    # -- environment -------------------------------------------------------------------------
    @abstractmethod
    def setup_environment(self) -> None:
        """Initialize process groups and pick the device. Idempotent."""

    @property
    @abstractmethod
    def root_device(self) -> torch.device:
        """The device this process computes on."""

    @property
    def global_rank(self) -> int:
        """Rank of this process in the whole job (0 for one process)."""
        return 0

    @property
    def local_rank(self) -> int:
        """Rank of this process on its node (0 for one process)."""
        return 0

    @property
    def world_size(self) -> int:
        """Number of processes in the job."""
        return 1

    @property
    def is_global_zero(self) -> bool:
        """True on the one process that writes logs, configs and pointers."""
        return self.global_rank == 0

    def data_shard(self) -> DataShard:
        """Which slice of each global batch this process reads (see `DataShard`)."""
        return DataShard()

    @property
    def gradient_replicas(self) -> int:
        """Ranks that each hold a replica of the weights and a distinct part of the global
        batch, over which `reduce` sums the loss counts and the gradient reduction averages:
        ``data_shard().count``, times the context-parallel size where ranks hold parts of
        the same samples (`MegatronStrategy`)."""
        return self.data_shard().count

    def check_step_microbatches(self, num_microbatches: int) -> None:
        """Raise ValueError, at fit start, when this strategy cannot run `num_microbatches`
        microbatches per optimizer step (a pipeline schedule's own rule); any number runs
        here."""

    def cuda_graphs_refusal(self) -> str | None:
        """Why a model compiled with CUDA graphs (torch.compile mode "reduce-overhead") cannot
        train under this strategy, or None when it can: one process on one CUDA device, no
        collective or gradient hook of a wrapper inside the captured graphs. Asked once the
        environment is set up."""
        if self.root_device.type != "cuda":
            return (
                f"CUDA graphs need a CUDA device, but this run trains on {self.root_device}; "
                "drop mode='reduce-overhead' (compile_model=True compiles without graphs)"
            )
        if self.world_size > 1:
            return (
                f"CUDA graphs under the Trainer run on one GPU, but this run has "
                f"{self.world_size} processes ({type(self).__name__}); compile without graphs "
                "(compile_model=True) for multi-GPU runs"
            )
        return None

    @property
    def metric_process_group(self) -> Any:
        """Process group over which logged metrics with `sync_dist=True` are averaged."""
        return None

    def barrier(self, name: str | None = None) -> None:
        """Wait for every process (no-op for one process); `name` is Lightning's label of the
        barrier, accepted and unused."""

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """Return rank `src`'s `obj` on every process (identity for one process)."""
        return obj

    def gather_from_stages(self, obj: Any) -> list[Any]:
        """Every pipeline stage's `obj` (a small picklable value, e.g. per-layer statistics of
        the layers that stage holds), in stage order, on every rank: ``[obj]`` when this rank
        holds every layer. A collective: every rank must call it at the same points."""
        return [obj]

    def reduce(self, tensor: Tensor, op: str = "mean") -> Tensor:
        """Reduce `tensor` over the data-parallel replicas; `op` is "mean", "sum" or "max".

        Returns a new tensor; the input is not modified. Identity for one process.
        """
        return tensor.clone()

    @property
    def mesh(self) -> Any:
        """The `ParallelMesh` (process groups) models are built against; None when every rank
        holds the whole model (one process, DDP)."""
        return None

    # -- model and optimizer -----------------------------------------------------------------
    def model_init_context(self) -> contextlib.AbstractContextManager:
        """Context under which `configure_model` runs (device placement, meta init)."""
        return contextlib.nullcontext()

    def setup_module(self, module: NanoModule) -> None:
        """Build this rank's share of the model (`module.configure_model()`) and place it."""
        self.module = module
        with self.model_init_context():
            module.configure_model()
        module.to(self.root_device)
        self._apply_precision(module)

    def _apply_precision(self, module: NanoModule) -> None:
        """Let the precision plugin cast/wrap the built model and print its policy."""
        self.precision.setup_module(module, self.root_device, self.is_global_zero)

    def setup_optimizers(self, module: NanoModule) -> OptimizerSetup:
        """Call `configure_optimizers` and parse its result (Lightning's accepted forms; with
        manual optimization several optimizers and schedulers too)."""
        config = module.configure_optimizers()
        if getattr(module, "automatic_optimization", True):
            self.optimizer_setup = parse_optimizer_config(config)
        else:
            self.optimizer_setup = parse_manual_config(config)
        return self.optimizer_setup

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The optimizer returned by `configure_optimizers`."""
        if self.optimizer_setup is None:
            raise RuntimeError("setup_optimizers() has not run yet")
        return self.optimizer_setup.optimizer

    def parameters(self) -> Iterator[nn.Parameter]:
        """This rank's trainable parameters."""
        assert self.module is not None
        return (p for p in self.module.parameters() if p.requires_grad)

    def batch_to_device(self, batch: Any) -> Any:
        """Move every tensor in a (nested) batch to `root_device`; under a precision with
        low-precision parameters ("bf16-true") its floating-point tensors are cast to that
        dtype, as Lightning's `convert_input` does (integer tensors, e.g. token ids, stay)."""
        device = self.root_device
        dtype = self.precision.param_dtype
        # the common shapes of a batch (a tensor, or a flat tuple/list/dict of tensors) directly:
        # Lightning's general walk costs tens of microseconds a step on a small model
        non_blocking = device.type not in ("cpu", "mps")  # as Lightning: async to a GPU
        if dtype is None:
            if isinstance(batch, Tensor):
                return batch.to(device, non_blocking=non_blocking)
            if type(batch) in (tuple, list) and all(isinstance(v, Tensor) for v in batch):
                return type(batch)(v.to(device, non_blocking=non_blocking) for v in batch)
            if type(batch) is dict and all(isinstance(v, Tensor) for v in batch.values()):
                return {k: v.to(device, non_blocking=non_blocking) for k, v in batch.items()}
        from lightning.fabric.utilities.apply_func import move_data_to_device

        moved = move_data_to_device(batch, device)
        if dtype is None:
            return moved
        from lightning.fabric.utilities.apply_func import apply_to_collection

        return apply_to_collection(
            moved, Tensor, lambda t: t.to(dtype) if t.is_floating_point() else t
        )

    # -- one optimizer step ------------------------------------------------------------------
    @abstractmethod
    def forward_backward(
        self,
        module: NanoModule,
        microbatches: Sequence[Any],
        batch_idx: int,
        hooks: MicrobatchHooks | None = None,
    ) -> StepOutput:
        """Run forward and backward over this rank's microbatches of one optimizer step.

        Gradients are added to `.grad` (zeroed by `zero_grad` before the step, or by
        `hooks.before` of the first microbatch), reduced across replicas and scaled so that
        they are the gradient of the global mean loss. `batch_idx` is the index of the first
        microbatch in the epoch; microbatch `i`'s `training_step` gets `batch_idx + i` (as
        Lightning counts batches). `hooks` run around each microbatch (Lightning's per-batch
        hooks; only where `supports_microbatch_hooks`). Returns the step's `StepOutput` (no
        grad norm yet).
        """

    @property
    def supports_microbatch_hooks(self) -> bool:
        """Whether `forward_backward` can run `MicrobatchHooks` around each microbatch (not
        inside a pipeline schedule, where forward and backward run per model chunk)."""
        return True

    @property
    def supports_backward_hooks(self) -> bool:
        """Whether `.grad` holds this rank's whole gradients in `on_before_backward` /
        `on_after_backward` (not where they live in ZeRO-2 shards)."""
        return self.supports_microbatch_hooks

    @abstractmethod
    def grads_for_clipping(self) -> list[Tensor]:
        """The gradients the optimizer reads on this rank (whole ones, or shards: what a
        clip must scale in place)."""

    @abstractmethod
    def clip_grad_norm_(self, max_norm: float | None) -> Tensor:
        """Return the global grad norm (before clipping); clip to `max_norm` unless None."""

    def clip_grads_(
        self,
        total_norm: Tensor,
        max_norm: float | None = None,
        clip_value: float | None = None,
    ) -> None:
        """Clip the gradients in place: scale them by ``min(1, max_norm / (total_norm +
        1e-6))`` (torch's rule; `total_norm` from `clip_grad_norm_(None)`, the global norm),
        and/or clamp every element to ``[-clip_value, clip_value]``."""
        grads = [g for g in self.grads_for_clipping() if g is not None]
        if max_norm is not None:
            clip_grads_(grads, total_norm, max_norm)
        if clip_value is not None:
            torch._foreach_clamp_min_(grads, -clip_value)
            torch._foreach_clamp_max_(grads, clip_value)

    def generation_refusal(self) -> str | None:
        """Why a module's whole-sequence `generate` cannot run under this strategy's layout
        (callbacks that sample, e.g. `TextSampler`, refuse at fit start with it); None: it
        can."""
        return None

    @property
    def can_skip_on_device(self) -> bool:
        """Whether `optimizer_step(skip_if=...)` can drop an update without a host read: the
        optimizer takes a device-side "found inf" flag (torch's fused optimizers, e.g.
        ``AdamW(fused=True)``, which `optimizer_impl="auto"` picks on CUDA) and no loss
        scaler decides skips on the host."""
        optimizer = self.optimizer_setup.optimizer if self.optimizer_setup else None
        return (
            optimizer is not None
            and bool(getattr(optimizer, "_step_supports_amp_scaling", False))
            and not self.precision.uses_loss_scaling
        )

    def optimizer_step(
        self, skip_if: Tensor | None = None, closure: Callable[[], Any] | None = None
    ) -> Any:
        """Apply the optimizer update (on fp32 masters when the precision keeps them; skipped
        after an fp16 overflow). The gradients stay until `zero_grad` (the Trainer zeroes them
        at the start of the next step, where Lightning does).

        Args:
            skip_if: a 0-dim bool device tensor; where it is True the optimizer leaves the
                weights and its state as they were, decided on the device (needs
                `can_skip_on_device`).
            closure: for an optimizer whose `step` needs one (LBFGS), passed to it; the
                Trainer allows it only where the optimizer steps the parameters themselves.

        Returns: what the optimizer's `step` returned (the closure's first loss, for LBFGS).
        """
        result = None
        if not self.precision.skip_step:
            with named_range("nanotrain/optimizer_step"), skip_on_device(self.optimizer, skip_if):
                updater = self._updater()
                result = updater.step() if closure is None else updater.step(closure)
        self.precision.after_step()
        return result

    def _updater(self) -> Any:
        """What `optimizer_step` steps: the fp32 master weights when the precision keeps them
        (they step the optimizer and copy back into the low-precision parameters), else the
        optimizer itself."""
        return self._master_holder if self._master_holder is not None else self.optimizer

    def zero_grad(self) -> None:
        """Drop the gradients (before a step accumulates new ones)."""
        self.optimizer.zero_grad(set_to_none=True)

    def skip_step(self) -> None:
        """Skip this step's update at a callback's request: let the precision plugin close the
        step (a dynamic loss scale moves as after any step); the gradients go at the next
        `zero_grad`."""
        self.precision.after_step()

    def validation_step(
        self, module: NanoModule, batch: Any, batch_idx: int, step_name: str = "validation_step"
    ) -> Any:
        """Run `module.<step_name>` ("validation_step" or "test_step") forward-only and return
        its output."""
        with torch.no_grad(), self.precision.forward_context():
            return getattr(module, step_name)(batch, batch_idx)

    def predict_step(self, module: NanoModule, batch: Any, batch_idx: int) -> Any:
        """Run `module.predict_step` forward-only and return its output (`Trainer.predict`).

        Raises:
            ValueError: the strategy's layout cannot return whole predictions.
        """
        with torch.no_grad(), self.precision.forward_context():
            return module.predict_step(batch, batch_idx)

    # -- inspection (for callbacks: numbers that need a cross-rank view) ---------------------
    def named_grad_norms(self) -> dict[str, Tensor]:
        """L2 norm of each trainable parameter's full gradient, by parameter name.

        Norms are those of the whole (unsharded) gradient after the cross-replica reduction,
        identical on every rank; parameters without a gradient are left out. Replicated
        layouts hold every gradient whole, so the local norm is the global one.
        """
        assert self.module is not None
        return {
            name: grad_of(p).detach().float().norm(2)
            for name, p in self.module.named_parameters()
            if p.requires_grad and grad_of(p) is not None
        }

    def full_tensor(self, name: str, tensor: Tensor) -> Tensor:
        """The whole value of parameter `name` (or of its gradient) given this rank's `tensor`.

        Layouts that shard parameters gather the pieces; replicated layouts return `tensor`.
        """
        return tensor

    # -- state -------------------------------------------------------------------------------
    def model_state_dict(self) -> dict[str, Tensor]:
        """This rank's model weights (and persistent buffers)."""
        assert self.module is not None
        return self.module.state_dict()

    def load_model_state_dict(self, state: dict[str, Tensor]) -> None:
        """Load weights produced by `model_state_dict` (strict)."""
        assert self.module is not None
        self.module.load_state_dict(state, strict=True)

    def optimizer_state_dict(self) -> dict[str, Any]:
        """This rank's optimizer state, plus under key "precision" the precision plugin's
        plain state (e.g. ``{"name": "16-mixed", "scaler": {"scale": ..., ...}}``) and, when
        it keeps fp32 masters, ``"master_weights"``: this rank's master tensors in optimizer
        order (its 1/dp shard under ZeRO)."""
        state = dict(self.optimizer.state_dict())
        extra: dict[str, Any] = dict(self.precision.state_dict())
        if self._master_holder is not None:
            extra["master_weights"] = [m.detach().clone() for m in self._master_holder.masters]
        state["precision"] = extra
        return state

    def load_optimizer_state_dict(self, state: dict[str, Any]) -> None:
        """Load optimizer state produced by `optimizer_state_dict` (and the precision state)."""
        state = dict(state)
        extra = state.pop("precision", None)
        self.optimizer.load_state_dict(state)
        if extra is not None:
            self.precision.load_state_dict(extra)
            masters = extra.get("master_weights")
            if masters is not None and self._master_holder is not None:
                load_into(self._master_holder.masters, masters)
                return
        if self._master_holder is not None:
            # a checkpoint without masters (e.g. saved in fp32): start them from the weights
            self._master_holder.refresh_from_params()

    def teardown(self) -> None:
        """Release wrappers and process groups created by `setup_environment`."""
