"""A backward in two halves: the input gradient now, the weight gradients later.

Zero-bubble pipeline schedules (Qi et al. 2024) and DualPipe split each stage's backward into
the part the previous stage waits for, the gradient of the stage's input ("I", the papers'
B), and the part nobody waits for, the gradients of the stage's weights ("W"), so that W can
fill time the pipeline would otherwise idle. The split works on the autograd graph, for every
layer kind at once (embeddings, norms, attention, dense and expert MLPs, router, head, MTP),
with no change to the layers:

- `backward_input` walks the graph from the stage's outputs (and loss terms) to its input
  only, through `torch.distributed.pipelining`'s `stage_backward_input`: autograd skips
  every weight edge, and the gradients arriving at the nodes where weights branch off are
  kept;
- `WeightGradients.__call__` resumes from those nodes towards the weights alone, as one
  `torch.autograd.backward(..., inputs=weights)`, so weight gradients accumulate into
  `.grad` the usual way and post-accumulate-grad hooks fire (overlapped data-parallel
  reduction, ZeRO-2, fp32 master gradients).

Each node runs once in all: the two halves cost one fused backward, and equal it to fp32
rounding (the same kernels on the same values; `tests/unit/test_split_backward.py`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor
from torch.autograd.graph import GradientEdge
from torch.distributed.pipelining._backward import stage_backward_input

__all__ = ["WeightGradients", "backward_input"]


@dataclass
class WeightGradients:
    """The weight-gradient half of a split backward, run once by calling it.

    Attributes:
        params: the stage's parameters (those the graph does not reach get no gradient).
        groups: per group of weights, the graph nodes where they branch off the input path
            and the gradients that reached those nodes during the input half.
        rest: a whole backward to run instead (a stage whose input needs no gradient: its
            entire backward is weight gradient), or None.
    """

    params: list[Tensor]
    groups: list[dict[str, Any]] = field(default_factory=list)
    rest: Callable[[], None] | None = None

    def __call__(self) -> None:
        if self.rest is not None:
            self.rest()
            self.rest = None
            return
        edges, grads, handles = [], [], []
        try:
            for group in self.groups:
                for saved, node in zip(group["grads"], group["intermediates"], strict=True):
                    # a node that is also reached from another kept node must see only what
                    # it saw in the input half, or its gradient would be counted twice
                    handles.append(node.register_prehook(lambda _, saved=saved: saved))
                    for i, grad in enumerate(saved):
                        if grad is not None:
                            edges.append(GradientEdge(node, i))
                            grads.append(grad)
            if edges:
                torch.autograd.backward(edges, grad_tensors=grads, inputs=self.params)
        finally:
            for handle in handles:
                handle.remove()
            self.groups = []


def backward_input(
    tensors: Sequence[Tensor],
    grads: Sequence[Tensor],
    inp: Tensor | None,
    params: Sequence[Tensor],
) -> tuple[Tensor | None, WeightGradients]:
    """The input half of ``torch.autograd.backward(tensors, grads)``.

    Args:
        tensors: the stage's outputs and loss terms (each with a grad_fn).
        grads: the gradient of each (received from the next stage, or the loss scale).
        inp: the stage's input activation (a leaf that requires grad), or None on the first
            stage, whose input (token ids) takes no gradient.
        params: the stage's parameters.

    Returns:
        The gradient of ``inp`` (None when ``inp`` is None; zeros when the graph does not
        reach it) and the `WeightGradients` to call later. ``tensors`` are detached.
    """
    params = [p for p in params if p.requires_grad]
    if inp is None or not inp.requires_grad or not tensors:
        # nothing flows upstream: the whole backward is the weight half
        def rest() -> None:
            if tensors:
                torch.autograd.backward(list(tensors), list(grads))

        return None, WeightGradients(params, rest=rest)
    (dinp,), groups = stage_backward_input(list(tensors), list(grads), [inp], iter(params))
    return (torch.zeros_like(inp) if dinp is None else dinp), WeightGradients(params, groups)
