"""NanoModule: a LightningModule that also runs under the nanotrain Trainer."""

from __future__ import annotations

import copyreg
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from torch import Tensor


def _first_tensor(batch: Any) -> Tensor | None:
    if isinstance(batch, Tensor):
        return batch
    if isinstance(batch, dict):
        batch = list(batch.values())
    if isinstance(batch, (list, tuple)):
        for item in batch:
            found = _first_tensor(item)
            if found is not None:
                return found
    return None


class NanoModule(pl.LightningModule):
    """Subclass this and implement the Lightning hooks you need.

    - `configure_model()`: build the model (`self.model = ...`). Under nanotrain it runs once
      per process after the process groups exist, so it can build only this rank's share.
    - `training_step(batch, batch_idx)`: the loss of ONE microbatch (a scalar tensor, or a
      dict with "loss"). The Trainer/strategy accumulates microbatches into a step.
    - `validation_step(batch, batch_idx)`: forward only; log metrics with `self.log`.
    - `configure_optimizers()`: one optimizer and optionally an LR scheduler, in any form
      Lightning accepts.
    - `count_tokens(batch)`: tokens in a microbatch; override for token data so that
      `max_tokens` and throughput work (the default 0 means "not token data").
    - `loss_counts(batch)`: optional; when the objective is several means over different
      counts (tokens, MTP targets, sequences), the count of each term, so that every term is
      averaged over the global batch whatever the layout (see `nanotrain.loss_terms`).

    The same class runs unchanged under `lightning.Trainer`.
    """

    def count_tokens(self, batch: Any) -> int | Tensor:
        """Number of tokens in one microbatch (an int, or a 0-dim integer tensor so that
        counting needs no host sync); 0 means the data is not token-based."""
        return 0

    def loss_counts(self, batch: Any) -> Tensor | None:
        """Per loss term, how many items of one microbatch its mean runs over: [K] (an int
        or float tensor, may live on the device; read without a host sync).

        Return None (the default) to have the step weigh `training_step`'s whole loss by
        `count_tokens`. Otherwise `training_step` must return ``{"loss": ..., "loss_terms":
        LossTerms(...)}`` with K terms, term k the mean over this microbatch's count k; the
        strategy then averages each term over its global count (`nanotrain.loss_terms`).
        """
        return None

    def count_samples(self, batch: Any) -> int:
        """Number of samples in one microbatch: the leading dim of its first tensor."""
        tensor = _first_tensor(batch)
        return int(tensor.shape[0]) if tensor is not None and tensor.dim() > 0 else 1

    @property
    def mesh(self) -> Any:
        """The strategy's `ParallelMesh`, for building a sharded model in `configure_model`;
        None for one process, for DDP and outside the nanotrain Trainer."""
        trainer = self._nano_trainer
        return None if trainer is None else trainer.strategy.mesh

    def flops_per_token(self) -> float | None:
        """Training FLOPs (forward + backward) per token, for MFU; None when unknown."""
        return None

    @property
    def _nano_trainer(self) -> Any:
        trainer = getattr(self, "_trainer", None)
        return trainer if getattr(trainer, "is_nanotrain", False) else None

    def log(  # noqa: D417 - same arguments as LightningModule.log
        self,
        name: str,
        value: Any,
        prog_bar: bool = False,
        logger: bool | None = None,
        on_step: bool | None = None,
        on_epoch: bool | None = None,
        reduce_fx: str = "mean",
        enable_graph: bool = False,
        sync_dist: bool = False,
        sync_dist_group: Any = None,
        add_dataloader_idx: bool = True,
        batch_size: int | None = None,
        metric_attribute: str | None = None,
        rank_zero_only: bool = False,
    ) -> None:
        """Log a value, as `LightningModule.log`.

        Under the nanotrain Trainer, with Lightning's semantics (see docs/lightning.md):
        `value` is a number, a one-element tensor or a torchmetrics `Metric` (computed at the
        end of the epoch, synchronized over data-parallel replicas, then reset). `on_step` /
        `on_epoch` default as in Lightning: per step in `training_step` and the training batch
        hooks, per epoch (training epoch or validation/test run) everywhere else, including the
        epoch-end hooks. Step values are averaged over the step's microbatches and written
        every `log_every_n_steps`; epoch values are reduced with `reduce_fx` ("mean"
        weighted by `batch_size`, or in validation / test by the batch's size as Lightning
        infers it) and written at the epoch's end; `logger=False` values reach
        `trainer.callback_metrics` only. `sync_dist=True` also reduces
        over data-parallel replicas. Both flags: written as `<name>_step` and `<name>_epoch`.

        Raises:
            ValueError: an unknown `reduce_fx`, a non-scalar tensor, or on_step=on_epoch=False.
        """
        trainer = self._nano_trainer
        if trainer is None:
            return super().log(
                name,
                value,
                prog_bar=prog_bar,
                logger=logger,
                on_step=on_step,
                on_epoch=on_epoch,
                reduce_fx=reduce_fx,
                enable_graph=enable_graph,
                sync_dist=sync_dist,
                sync_dist_group=sync_dist_group,
                add_dataloader_idx=add_dataloader_idx,
                batch_size=batch_size,
                metric_attribute=metric_attribute,
                rank_zero_only=rank_zero_only,
            )
        step_default = trainer.logs_per_step_by_default()
        trainer.metric_book.log(
            name,
            value,
            prog_bar=prog_bar,
            logger=logger is not False,
            sync_dist=sync_dist,
            reduce_fx=reduce_fx,
            batch_size=batch_size,
            on_step=step_default if on_step is None else on_step,
            on_epoch=(not step_default) if on_epoch is None else on_epoch,
        )

    def log_dict(self, dictionary: dict[str, Any], **kwargs: Any) -> None:
        """Log every entry of `dictionary` with the same options (see `log`)."""
        for name, value in dictionary.items():
            self.log(name, value, **kwargs)

    def print(self, *args: Any, **kwargs: Any) -> None:
        """`print` on global rank 0 only (as `LightningModule.print`)."""
        trainer = self._nano_trainer
        if trainer is None:
            return super().print(*args, **kwargs)
        if trainer.is_global_zero:
            print(*args, **kwargs)

    def all_gather(self, data: Any, group: Any = None, sync_grads: bool = False) -> Any:
        """Lightning's `all_gather` under the nanotrain Trainer: every tensor in `data` (a
        tensor or a collection of them) gathered over the data-parallel ranks (or `group`),
        stacked on a new first dimension of that size; unchanged without a process group.
        `sync_grads=True` lets gradients flow back through the gather."""
        import torch
        import torch.distributed as dist
        from lightning.fabric.utilities.apply_func import apply_to_collection

        trainer = self._nano_trainer
        if trainer is None:
            return super().all_gather(data, group=group, sync_grads=sync_grads)
        if not dist.is_initialized():
            return data
        group = group if group is not None else trainer.strategy.metric_process_group

        def gather(tensor: Tensor) -> Tensor:
            tensor = tensor.contiguous()
            if sync_grads:
                import torch.distributed.nn.functional as dist_nn

                return torch.stack(dist_nn.all_gather(tensor, group=group))
            parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
            dist.all_gather(parts, tensor, group=group)
            return torch.stack(parts)

        return apply_to_collection(data, Tensor, gather)

    def optimizers(self, use_pl_optimizer: bool = True) -> Any:
        """The optimizer (under nanotrain: the raw `torch.optim.Optimizer`). In manual
        optimization, as Lightning: each optimizer wrapped to run Lightning's hooks in `step`
        (`nanotrain.trainer.manual.ManualOptimizer`; the raw ones with
        `use_pl_optimizer=False`), one alone or a list of several."""
        trainer = self._nano_trainer
        if trainer is None:
            return super().optimizers(use_pl_optimizer)
        setup = trainer.strategy.optimizer_setup
        if setup is None or setup.manual_optimizers is None:
            return trainer.strategy.optimizer
        return trainer._manual_optimizers(use_pl_optimizer)

    def manual_backward(self, loss: Tensor, *args: Any, **kwargs: Any) -> None:
        """As Lightning's: `on_before_backward`, `loss.backward(*args, **kwargs)`, then
        `on_after_backward`; under the nanotrain Trainer the gradients are averaged over the
        data-parallel replicas in between (as DDP's reducer in Lightning's backward).

        Raises:
            RuntimeError: called with automatic optimization (as Lightning).
        """
        trainer = self._nano_trainer
        if trainer is None:
            return super().manual_backward(loss, *args, **kwargs)
        if self.automatic_optimization:
            raise RuntimeError(
                "to use manual_backward, set automatic_optimization = False in your "
                "LightningModule's __init__ (as Lightning)"
            )
        trainer._manual_backward(loss, *args, **kwargs)
        return None

    @classmethod
    def load_from_checkpoint(  # noqa: D417 - Lightning's arguments
        cls,
        checkpoint_path: Any,
        map_location: Any = None,
        hparams_file: Any = None,
        strict: bool | None = None,
        **kwargs: Any,
    ) -> Any:
        """The module rebuilt from a checkpoint, as Lightning's `load_from_checkpoint`: a
        nanotrain checkpoint (a checkpoint directory, a folder of checkpoints or its `last`
        file; saved under any layout) gives the module built with its recorded
        hyperparameters (`kwargs` override them) and its weights, on the CPU, in eval mode
        (`nanotrain.checkpoint.module_load.load_module`). Any other path (a Lightning `.ckpt`
        file) is Lightning's own `load_from_checkpoint`, after nanotrain has checked that the
        file loads with `weights_only=True`.

        Raises:
            ValueError: a file that needs unpickling code (`UnsafeCheckpointError`)."""
        from nanotrain.checkpoint.module_load import load_module

        path = Path(checkpoint_path) if isinstance(checkpoint_path, str | Path) else None
        if path is not None and (path.is_dir() or path.name == "last"):
            if hparams_file is not None:
                raise ValueError(
                    "hparams_file is for Lightning .ckpt files; a nanotrain checkpoint records "
                    "its hyperparameters: pass overrides as keyword arguments"
                )
            return load_module(cls, path, strict=strict is not False, **kwargs)
        if path is not None and path.is_file():
            from nanotrain.checkpoint.files import read_torch

            read_torch(path)  # refuses, with the reason, a file that needs unpickling code
        return super().load_from_checkpoint(
            checkpoint_path, map_location, hparams_file, strict, **kwargs
        )

    def clip_gradients(
        self,
        optimizer: Any,
        gradient_clip_val: float | None = None,
        gradient_clip_algorithm: str | None = None,
    ) -> None:
        """Clip the step's gradients (as `LightningModule.clip_gradients`; call it from
        `configure_gradient_clipping`). Under nanotrain "norm" clips the global norm over every
        shard and replica, so the result does not depend on the layout; "value" clamps each
        element."""
        trainer = self._nano_trainer
        if trainer is None:
            return super().clip_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm)
        if not self.automatic_optimization:  # the given optimizer's parameters, as Lightning
            return trainer._manual_clip(optimizer, gradient_clip_val, gradient_clip_algorithm)
        trainer.clip_gradients(gradient_clip_val, gradient_clip_algorithm)

    def lr_schedulers(self) -> Any:
        """The LR scheduler, or None (in manual optimization, as Lightning: one alone or a
        list of several)."""
        trainer = self._nano_trainer
        if trainer is None:
            return super().lr_schedulers()
        setup = trainer.strategy.optimizer_setup
        if setup is not None and setup.manual_schedulers is not None:
            found = setup.manual_schedulers
            return None if not found else found[0] if len(found) == 1 else list(found)
        return setup.scheduler.scheduler if setup and setup.scheduler else None


def adopt_lightning_module(module: Any) -> NanoModule:
    """Let a plain `lightning.pytorch.LightningModule` run under the nanotrain Trainer.

    The instance's class is swapped for a subclass of (its class, NanoModule): every method
    the user wrote still wins, and `log`, `print`, `optimizers`, `lr_schedulers`,
    `manual_backward` come from NanoModule, which speak to the nanotrain Trainer (and fall back to Lightning's otherwise).
    A NanoModule is returned unchanged. The module pickles and deep-copies as an instance of
    its own class.

    Raises:
        TypeError: `module` is not a LightningModule.
    """
    if isinstance(module, NanoModule):
        return module
    if not isinstance(module, pl.LightningModule):
        raise TypeError(
            "the Trainer trains a LightningModule (nanotrain.NanoModule or "
            f"lightning.pytorch.LightningModule), got {type(module).__name__}"
        )
    cls = type(module)
    adopted = _ADOPTED.get(cls)
    if adopted is None:
        adopted = type(
            cls.__name__,
            (cls, NanoModule),
            {"__module__": cls.__module__, "__reduce_ex__": _reduce_as(cls)},
        )
        _ADOPTED[cls] = adopted
    module.__class__ = adopted
    return module


_ADOPTED: dict[type, type] = {}


def _reduce_as(original: type) -> Any:
    """The adopted class's `__reduce_ex__`: pickle and `copy.deepcopy` the module as an
    instance of `original` (the adopted class is made at run time, so pickle cannot name it),
    with the same state; a copy is adopted again when a Trainer runs it."""

    def __reduce_ex__(self: Any, protocol: Any) -> Any:
        reduced = original.__reduce_ex__(self, protocol)
        if not isinstance(reduced, tuple) or len(reduced) < 2:
            return reduced
        args = tuple(original if a is type(self) else a for a in reduced[1])
        # pickle checks that copyreg.__newobj__ makes the object's own class; this makes
        # the original class's instance the same way
        make = _new_instance if reduced[0] is copyreg.__newobj__ else reduced[0]
        return (make, args, *reduced[2:])

    return __reduce_ex__


def _new_instance(cls: type, *args: Any) -> Any:
    """`cls.__new__(cls, *args)` (copyreg.__newobj__ under a name pickle does not check)."""
    return cls.__new__(cls, *args)
