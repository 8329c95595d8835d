"""Lightning's manual optimization (`automatic_optimization = False`) under nanotrain.Trainer.

The module's `training_step` drives the update itself, as under `lightning.Trainer`:
`self.optimizers()` gives one `ManualOptimizer` per optimizer (Lightning's LightningOptimizer:
`step(closure=None)` runs the closure, then `on_before_optimizer_step`, then the update, and
counts one `global_step`), `self.manual_backward(loss)` runs `on_before_backward`, backward, the
data-parallel gradient average and `on_after_backward`, and `self.lr_schedulers()` gives the
schedulers, which only the module steps. `toggle_optimizer` / `untoggle_optimizer` are
Lightning's own methods, reading `trainer.optimizers`.

Data parallelism: every `manual_backward` averages the gradients over the replicas
(`DDPStrategy.average_grads_`, `MegatronStrategy.average_grads_` over its dp group), as DDP's
reducer does during Lightning's backward, so each replica updates with the gradient of the
global batch's mean loss: the run is the same under any number of replicas. Layouts whose
strategy owns backward and the update (MegatronStrategy's pipeline stages, ZeRO / the
distributed optimizer, tensor or expert parallelism; FSDPStrategy),
precisions that keep fp32 master weights or scale the loss, gradient accumulation and the
Trainer's gradient clipping (both refused by Lightning too) are refused at fit start.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from nanotrain.strategies.base import StepOutput
from nanotrain.strategies.weighting import weigh_microbatches

if TYPE_CHECKING:
    from nanotrain.trainer import Trainer

#: precisions under which a manual step is the plain forward, backward and update
MANUAL_PRECISIONS = ("32-true", "bf16-mixed")


class ManualOptimizer:
    """What `self.optimizers()` returns in manual optimization (Lightning's
    `LightningOptimizer`): the optimizer's attributes (`param_groups`, `state`, ...) plus a
    `step` that runs Lightning's hooks and counts the step.

    Args:
        optimizer: the torch optimizer `configure_optimizers` returned.
        trainer: the running nanotrain Trainer.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, trainer: Trainer) -> None:
        self._optimizer = optimizer
        self._trainer = trainer

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The wrapped torch optimizer (Lightning's `LightningOptimizer.optimizer`)."""
        return self._optimizer

    def __getattr__(self, name: str) -> Any:
        return getattr(self._optimizer, name)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The optimizer's `zero_grad`."""
        self._optimizer.zero_grad(set_to_none=set_to_none)

    def step(self, closure: Any = None, **kwargs: Any) -> Any:
        """As `LightningOptimizer.step`: the optimizer's step with a closure that runs
        `closure` (when given), then `on_before_optimizer_step`; `trainer.global_step` counts
        it. Returns what the optimizer's step returns."""
        trainer = self._trainer

        def wrapped() -> Any:
            result = closure() if closure is not None else None
            trainer._call("on_before_optimizer_step", self._optimizer)
            return result

        out = self._optimizer.step(closure=wrapped, **kwargs)
        trainer.state.global_step += 1
        return out


def manual_refusal(trainer: Trainer) -> str | None:
    """Why `trainer` cannot run the manual optimization of its module, or None."""
    from nanotrain.strategies.megatron import MegatronStrategy
    from nanotrain.strategies.replicated import ReplicatedStrategy

    strategy, s = trainer.strategy, trainer.settings
    if isinstance(strategy, MegatronStrategy):
        reason = _megatron_refusal(strategy)
        if reason is not None:
            return reason
    elif not isinstance(strategy, ReplicatedStrategy):
        return (
            f"{type(strategy).__name__} keeps parameters, gradients and optimizer state in "
            "shards and runs backward and the update itself, so training_step cannot call "
            "manual_backward and optimizer.step; train with SingleDeviceStrategy, DDPStrategy "
            "or MegatronStrategy with data parallelism alone, or return the loss from "
            "training_step (automatic optimization)"
        )
    if strategy.precision.name not in MANUAL_PRECISIONS:
        return (
            f"precision {strategy.precision.name!r} keeps fp32 master weights or scales the "
            "loss inside nanotrain's own update; manual optimization runs under "
            f"{' or '.join(MANUAL_PRECISIONS)}"
        )
    if trainer.num_microbatches != 1:
        return (
            f"accumulate_grad_batches={trainer.num_microbatches}: as Lightning, automatic "
            "gradient accumulation is not supported for manual optimization; accumulate in "
            "training_step (step the optimizer every N batches)"
        )
    if s.gradient_clip_val is not None:
        return (
            f"gradient_clip_val={s.gradient_clip_val}: as Lightning, automatic gradient "
            "clipping is not supported for manual optimization; call self.clip_gradients("
            "opt, gradient_clip_val=..., gradient_clip_algorithm=...) in training_step"
        )
    return None


def _megatron_refusal(strategy: Any) -> str | None:
    """Why MegatronStrategy's layout cannot run manual optimization (None: data parallelism
    alone, whose replicas hold whole parameters, gradients and optimizer states)."""
    splits = [
        (strategy.tp > 1, f"tp={strategy.tp} splits the weights over tensor-parallel ranks"),
        (strategy.pp > 1, f"pp={strategy.pp} runs backward inside the pipeline schedule"),
        (strategy.ep > 1, f"ep={strategy.ep} splits the routed experts over ranks"),
        (
            strategy.zero_stage > 0,
            f"zero_stage={strategy.zero_stage} keeps optimizer state (and gradients or "
            "parameters) in shards that its own update steps",
        ),
    ]
    reasons = [why for applies, why in splits if applies]
    if not reasons:
        return None
    return (
        f"{type(strategy).__name__} owns backward and the optimizer update here "
        f"({'; '.join(reasons)}), "
        "so training_step cannot call manual_backward and optimizer.step; use "
        "MegatronStrategy(tp=1, pp=1, ep=1, zero_stage=0) (data parallelism alone), "
        "DDPStrategy or SingleDeviceStrategy, or return the loss from training_step "
        "(automatic optimization)"
    )


def check_manual(trainer: Trainer) -> None:
    """Raise ValueError at fit start when `trainer` cannot run its module's manual
    optimization (see `manual_refusal`)."""
    reason = manual_refusal(trainer)
    if reason is not None:
        raise ValueError(
            f"{type(trainer.module).__name__} sets automatic_optimization=False, which this "
            f"run cannot honour: {reason}"
        )


def manual_backward(trainer: Trainer, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
    """Lightning's `manual_backward`: `on_before_backward`, backward, the gradients averaged
    over the data-parallel replicas (as DDP's reducer in Lightning's backward), then
    `on_after_backward`."""
    trainer._call("on_before_backward", loss)
    loss.backward(*args, **kwargs)
    trainer.strategy.average_grads_()
    trainer._call("on_after_backward")


def clip_manual(
    trainer: Trainer, optimizer: Any, gradient_clip_val: float | None, algorithm: str | None
) -> None:
    """Lightning's `clip_gradients` in manual optimization: the gradients of `optimizer`'s
    parameters (averaged over the replicas already, so every replica clips alike), by their
    norm (the default) or by value.

    Raises:
        ValueError: an unknown algorithm.
    """
    algorithm = algorithm or "norm"
    if algorithm not in ("norm", "value"):
        raise ValueError(f"gradient_clip_algorithm must be 'norm' or 'value', got {algorithm!r}")
    if not gradient_clip_val:
        return
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if algorithm == "norm":
        torch.nn.utils.clip_grad_norm_(params, gradient_clip_val)
    else:
        torch.nn.utils.clip_grad_value_(params, gradient_clip_val)


def manual_outputs(output: Any) -> dict[str, Any]:
    """What Lightning's `on_train_batch_end` gets in manual optimization: a dict output as
    returned, a tensor as {"loss": it}, None as {} (its "loss" detached).

    Raises:
        TypeError: any other return value (Lightning refuses it too).
    """
    if isinstance(output, Mapping):
        extra = dict(output)
    elif isinstance(output, torch.Tensor):
        extra = {"loss": output}
    elif output is None:
        extra = {}
    else:
        raise TypeError(
            "in manual optimization, training_step must return a tensor, a dict or None, got "
            f"{type(output).__name__}"
        )
    if isinstance(extra.get("loss"), torch.Tensor):
        extra["loss"] = extra["loss"].detach()
    return extra


def manual_step(trainer: Trainer, batch: Any) -> None:
    """One training batch of a module that optimizes itself: Lightning's batch hooks around
    its `training_step` (which calls `manual_backward` and the optimizers' `step`), then the
    Trainer's bookkeeping of a step (samples, logs, `on_train_step_end`, validation when due).
    `global_step` counts the optimizer steps the module took (two per batch for a GAN)."""
    st, s = trainer.state, trainer.settings
    strategy, module = trainer.strategy, trainer.module
    batch_idx = st.steps_in_epoch
    trainer._step_taken = False
    trainer._call("on_train_step_start", [batch], batch_idx)
    trainer._is_last_batch = batch_idx + 1 == st.steps_per_epoch
    trainer._call("on_train_batch_start", batch, batch_idx)
    trainer.step_output = None  # nanotrain's step values exist once the batch is done
    weighed = weigh_microbatches(strategy, module, [batch])
    with strategy.precision.forward_context():
        output = module.training_step(batch, batch_idx)
    outputs = manual_outputs(output)
    loss = outputs.get("loss")
    loss = strategy.reduce(loss.float()) if isinstance(loss, torch.Tensor) else None
    out = StepOutput(loss=loss, num_tokens=weighed.tokens, num_samples=weighed.samples)
    trainer.step_output = out
    trainer._step_taken = True
    st.steps_in_epoch += 1
    st.batches_stepped += 1
    st.add_consumed(out.num_samples, out.num_tokens)
    trainer._train_sampler.advance(s.micro_batch_size)
    trainer._publish_step_values()
    trainer._call("on_train_batch_end", outputs, batch, batch_idx)
    # as Lightning's cadence in manual optimization: every log_every_n_steps batches
    log_step = st.batches_stepped % s.log_every_n_steps == 0 or trainer._done()
    trainer.is_log_step = log_step
    if log_step:
        trainer._log_train(out)
    else:
        trainer.metric_book.clear()
    trainer._call("on_train_step_end", out, [batch], batch_idx)
    if log_step:
        logged_in_hook = trainer.metric_book.close_step().logger
        if logged_in_hook:
            trainer.log_metrics(logged_in_hook)
    else:
        trainer.metric_book.clear()
    if trainer._val_loader is not None and trainer._val_check_due():
        trainer._run_validation()


class ManualMethods:
    """What a module's `optimizers()`, `manual_backward` and `clip_gradients` ask of the
    Trainer in manual optimization (Trainer methods, so the module needs no import of it)."""

    def _manual_optimizers(self: Trainer, use_pl_optimizer: bool) -> Any:
        """Lightning's `self.optimizers()`: one optimizer alone or a list of several, each
        wrapped in a `ManualOptimizer` (the same wrappers for the whole fit) unless
        `use_pl_optimizer` is False."""
        raw = self.strategy.optimizer_setup.manual_optimizers
        wrapped = getattr(self, "_manual_wrappers", None)
        if wrapped is None or [w.optimizer for w in wrapped] != raw:
            wrapped = self._manual_wrappers = [ManualOptimizer(o, self) for o in raw]
        chosen = wrapped if use_pl_optimizer else raw
        return chosen[0] if len(chosen) == 1 else list(chosen)

    def _manual_backward(self: Trainer, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        """See `manual_backward`."""
        manual_backward(self, loss, *args, **kwargs)

    def _manual_clip(
        self: Trainer, optimizer: Any, gradient_clip_val: Any, algorithm: str | None
    ) -> None:
        """See `clip_manual`."""
        clip_manual(self, optimizer, gradient_clip_val, algorithm)
