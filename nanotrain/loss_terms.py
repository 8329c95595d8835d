"""LossTerms: an objective made of several means, each over its own count.

A language model's objective is rarely one mean: the next-token loss averages over the tokens
that carry a label, a multi-token-prediction loss over its own targets (fewer: the last k
positions of a sequence have none), a sequence-wise balance loss over sequences. Weighing a
microbatch's *total* loss by one count (its tokens) makes the gradient depend on how the global
batch is cut into microbatches and ranks as soon as labels are ignored (-100). A module that
reports its terms separately lets the strategy average each term over its own global count:

    objective = sum_k weights[k] * (sum of term k over the global batch) / (global count k)

which is the same number, and the same gradient, for every cut of the global batch.

The protocol (see `NanoModule.loss_counts`): ``loss_counts(batch)`` gives the K counts of a
microbatch before its forward; ``training_step`` returns ``{"loss": ..., "loss_terms":
LossTerms(...)}`` whose ``values`` are the K terms averaged over this microbatch's counts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from nanotrain.runtime.host_copy import host_to_device

__all__ = ["LossTerms"]


@dataclass
class LossTerms:
    """One microbatch's loss terms, each a mean over the count `loss_counts` gave for it.

    Attributes:
        values: [K] tensor (with autograd graph): term k averaged over this microbatch's
            count k (0 where the count is 0, e.g. ``sum / count.clamp(min=1)``).
        weights: K floats: the objective is ``sum_k weights[k] * global_mean_k``.
        names: K metric names the step's global means are logged under (e.g.
            "train/lm_loss"); terms that share a name are logged as the mean of their
            values (one multi-token-prediction term per depth, logged as one loss).

    Raises:
        ValueError: when `values`, `weights` and `names` do not all have K entries.
    """

    values: Tensor
    weights: Sequence[float]
    names: Sequence[str]

    def __post_init__(self) -> None:
        k = self.values.numel()
        if self.values.dim() != 1 or len(self.weights) != k or len(self.names) != k:
            raise ValueError(
                f"LossTerms needs values of shape [K] and K weights and names; got values of "
                f"shape {tuple(self.values.shape)}, {len(self.weights)} weights and "
                f"{len(self.names)} names"
            )

    def weight_tensor(self, device: torch.device) -> Tensor:
        """The weights as a float64 tensor [K] on `device` (copied without a host sync)."""
        return host_to_device(list(self.weights), device)

    def named_means(self, global_values: Tensor) -> dict[str, Tensor]:
        """``{name: mean of the global values of the terms with that name}``, in order.

        Args: global_values: [K], the step's global mean of each term.
        """
        groups: dict[str, list[int]] = {}
        for k, name in enumerate(self.names):
            groups.setdefault(name, []).append(k)
        # integer indexing is a view: no index tensor copied to the device
        return {
            name: torch.stack([global_values[k] for k in idx]).mean()
            for name, idx in groups.items()
        }
