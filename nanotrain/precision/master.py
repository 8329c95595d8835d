"""fp32 master weights and fp32 gradient accumulation for low-precision parameters.

With bf16 parameters (``bf16-true``) two things must stay in fp32: the gradient summed over the
microbatches of a step (a bf16 sum of many small gradients drops bits), and the weights the
optimizer updates (a bf16 weight cannot absorb an update smaller than 2**-8 of itself).

`MainGrads` gives each parameter a ``main_grad``: an fp32 view of one flat buffer that a
post-accumulate-grad hook adds ``param.grad`` into (then frees it), after every microbatch.
`MasterWeights` rewrites the optimizer's parameter groups *in place* to fp32 copies of the
parameters (as ZeRO does; the LR scheduler keeps driving the same object), feeds them the
main grads, steps, and copies the result back into the bf16 parameters.
Under ZeRO the same happens on each rank's 1/dp shard (`nanotrain.parallel.zero`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

__all__ = ["MainGrads", "MasterWeights", "grad_of"]


def grad_of(param: nn.Parameter) -> Tensor | None:
    """The gradient the optimizer reads: ``param.main_grad`` when the precision keeps one
    (fp32 accumulation), else ``param.grad``."""
    main = getattr(param, "main_grad", None)
    return main if main is not None else param.grad


class MainGrads:
    """fp32 gradient accumulation for ``params`` (one flat buffer, ``param.main_grad`` views).

    Args:
        params: parameters whose ``.grad`` is moved into fp32 after every backward.
        dtype: the accumulation dtype (fp32).
    """

    def __init__(self, params: Sequence[nn.Parameter], dtype: torch.dtype = torch.float32) -> None:
        self.params = list(params)
        numel = sum(p.numel() for p in self.params)
        device = self.params[0].device if self.params else torch.device("cpu")
        self.buffer = torch.zeros(numel, dtype=dtype, device=device)
        offset = 0
        for p in self.params:
            p.main_grad = self.buffer[offset : offset + p.numel()].view(p.shape)
            offset += p.numel()
        self._hooks = [p.register_post_accumulate_grad_hook(self._accumulate) for p in self.params]

    @staticmethod
    def _accumulate(param: Tensor) -> None:
        param.main_grad.add_(param.grad)
        param.grad = None  # the low-precision copy is not kept between microbatches

    def zero_(self) -> None:
        """Zero every main grad (after the optimizer step)."""
        self.buffer.zero_()

    def remove(self) -> None:
        """Unregister the hooks and drop the ``main_grad`` attributes."""
        for h in self._hooks:
            h.remove()
        for p in self.params:
            p.main_grad = None
        self._hooks = []


class MasterWeights:
    """fp32 master copies of the optimizer's low-precision parameters (see module docstring).

    Args:
        optimizer: the module's optimizer, not yet stepped; its groups are rewritten in place.
        dtype: the master dtype (fp32).

    Raises:
        ValueError: when the optimizer already has state (create masters before any step).
    """

    def __init__(
        self, optimizer: torch.optim.Optimizer, dtype: torch.dtype = torch.float32
    ) -> None:
        if optimizer.state:
            raise ValueError(
                "master weights must be created before the optimizer's first step; load "
                "optimizer checkpoints after the strategy's setup_optimizers"
            )
        self.optimizer = optimizer
        self.pairs: list[tuple[nn.Parameter, nn.Parameter]] = []  # (model param, master)
        for group in optimizer.param_groups:
            new = []
            for p in group["params"]:
                if p.dtype == dtype:
                    new.append(p)
                    continue
                master = nn.Parameter(p.detach().to(dtype).clone())
                self.pairs.append((p, master))
                new.append(master)
            group["params"] = new

    @property
    def masters(self) -> list[Tensor]:
        """The fp32 master tensors, in optimizer order (what checkpoints save)."""
        return [m for _, m in self.pairs]

    @torch.no_grad()
    def step(self) -> None:
        """Hand each master its parameter's fp32 grad, step, copy the masters back."""
        for p, m in self.pairs:
            g = grad_of(p)
            m.grad = None if g is None else g.to(m.dtype)
        self.optimizer.step()
        for p, m in self.pairs:
            p.copy_(m)
            m.grad = None

    @torch.no_grad()
    def refresh_from_params(self) -> None:
        """Set every master to its (low-precision) parameter's value."""
        for p, m in self.pairs:
            m.copy_(p)


@torch.no_grad()
def load_into(masters: Sequence[Tensor], tensors: Sequence[Tensor]) -> None:
    """Copy ``tensors`` into ``masters`` one by one.

    Raises:
        ValueError: for a different count or shape (a checkpoint of another layout).
    """
    if len(masters) != len(tensors):
        raise ValueError(
            f"the checkpoint holds {len(tensors)} master-weight tensors but this run has "
            f"{len(masters)}; resume with the same precision, parallel layout and ZeRO stage"
        )
    for m, t in zip(masters, tensors, strict=True):
        if m.shape != t.shape:
            raise ValueError(
                f"master weight of shape {tuple(t.shape)} in the checkpoint, {tuple(m.shape)} "
                "here; resume with the same parallel layout and ZeRO stage"
            )
        m.copy_(t)
