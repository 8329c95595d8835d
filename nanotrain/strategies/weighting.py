"""How one optimizer step's microbatches are weighed, so that its gradient is that of the
objective over the whole global batch, whatever cut of it this rank and microbatch hold.

Two modes, picked by the module:

- **Loss terms** (the module implements `NanoModule.loss_counts` and its `training_step`
  returns ``"loss_terms"``, a `nanotrain.loss_terms.LossTerms`): term k of microbatch m is a
  mean over its own count ``c[m, k]``; the counts of every microbatch of every data-parallel
  rank are summed into ``C[k]`` (one all-reduce before any backward) and microbatch m
  backpropagates ``sum_k w[k] * value[m, k] * c[m, k] * R / C[k]`` (R = data-parallel
  replicas, whose average the gradient reduction takes). Summed over microbatches and averaged
  over replicas this is ``sum_k w[k] * global mean of term k``: any cut gives the same gradient.
- **One loss** (any other module): the whole loss of microbatch m is weighed by its tokens
  (`NanoModule.count_tokens`) as ``t[m] * R / T``; ``1 / M`` each when the data has no tokens.

Every count stays a device tensor: weighing adds no host-device synchronization; the totals
become Python ints only when `TrainState.consumed_tokens` / `consumed_samples` are read.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from nanotrain.loss_terms import LossTerms
from nanotrain.runtime.host_copy import host_to_device

if TYPE_CHECKING:
    from nanotrain.module import NanoModule
    from nanotrain.strategies.base import Strategy

__all__ = ["LossAccumulator", "MicrobatchWeights", "weigh_microbatches"]


@dataclass
class MicrobatchWeights:
    """How much each local microbatch's terms count in the step's objective.

    Attributes:
        scales: [M, K] float64: what term k of microbatch m is multiplied by in backward
            (``c[m, k] * R / C[k]``, 0 where ``C[k]`` is 0); K = 1 in one-loss mode.
        global_counts: [K] float64, each term's count over the global batch.
        tokens, samples: 0-dim float64 tensors, totals over the global batch.
        uses_terms: True in loss-terms mode.
        replicas: R, the number of data-parallel replicas.
        host_scales: `scales` as Python floats when they were computed on the host (one
            replica, counts known on the host), else None.

    Weights computed on the host are cached and shared by every step with the same counts:
    treat them, and the `StepOutput.num_tokens` / `num_samples` taken from them, as read-only.
    """

    scales: Tensor
    global_counts: Tensor
    tokens: Tensor
    samples: Tensor
    uses_terms: bool
    replicas: int
    host_scales: tuple[tuple[float, ...], ...] | None = None

    @property
    def weights(self) -> list[float]:
        """One-loss mode's per-microbatch weights as floats (reads the device: tests only)."""
        return self.scales[:, 0].tolist()


def _as_counts(value: Any, device: torch.device) -> Tensor:
    """A count (Python number or tensor, any device) as float64 [n] on `device`, with no
    host sync."""
    if isinstance(value, Tensor) and value.device.type != "cpu":
        return value.to(device=device, dtype=torch.float64).reshape(-1)
    return host_to_device([float(v) for v in torch.as_tensor(value).reshape(-1).tolist()], device)


def _on_host(value: Any) -> bool:
    """Whether a count is known on the host (None, a number or a CPU tensor)."""
    return not isinstance(value, Tensor) or value.device.type == "cpu"


def _host_values(count: Any) -> list[float]:
    """A host count (number or CPU tensor) as a flat list of floats."""
    if isinstance(count, Tensor):
        return [float(v) for v in count.reshape(-1).tolist()]
    return [float(count)]


def _check_lengths(module: Any, lengths: set[int]) -> None:
    if len(lengths) != 1:
        raise ValueError(
            f"{type(module).__name__}.loss_counts must return a tensor of the same length "
            "for every microbatch (one count per loss term)"
        )


def _host_rows(module: Any, raw: list | None, raw_tokens: list) -> tuple[list, list]:
    """(counts [M][K], tokens [M]) as Python floats, from counts known on the host."""
    tokens = [sum(_host_values(t)) for t in raw_tokens]
    if raw is None:
        return [[t] for t in tokens], tokens
    rows = [_host_values(c) for c in raw]
    _check_lengths(module, {len(r) for r in rows})
    return rows, tokens


@functools.lru_cache(maxsize=8)
def _weigh_on_host(
    rows: tuple, tokens: tuple, samples: float, uses_terms: bool, device: torch.device
) -> MicrobatchWeights:
    """`weigh_microbatches` for one data-parallel replica with counts known on the host:
    the same arithmetic in Python floats, copied to `device` as one tensor.

    Cached: a run's steps mostly repeat the same counts (fixed batch and sequence sizes), and
    building these small tensors every step was a third of the Trainer's own per-step time on
    a small model (docs/benchmarks.md)."""
    m, k = len(rows), len(rows[0])
    global_counts = [sum(r[j] for r in rows) for j in range(k)]
    # data without tokens (one-loss mode, no count): the plain mean over microbatches
    absent = 0.0 if uses_terms else 1.0 / m
    scales = tuple(
        tuple(r[j] / global_counts[j] if global_counts[j] > 0 else absent for j in range(k))
        for r in rows
    )
    flat = [v for r in scales for v in r] + global_counts + [sum(tokens), samples]
    t = host_to_device(flat, device)
    n = m * k
    return MicrobatchWeights(
        t[:n].view(m, k), t[n : n + k], t[n + k], t[n + k + 1], uses_terms, 1, scales
    )


def _device_counts(
    module: Any, raw: list | None, raw_tokens: list, samples: float, device: torch.device
) -> tuple[Tensor, Tensor]:
    """(counts [M, K], local sums [K + 2]) from counts of which some live on the device,
    without reading them."""
    tokens = torch.cat([_as_counts(t, device) for t in raw_tokens])
    if raw is None:
        counts_mk = tokens[:, None]
    else:
        counts = [_as_counts(c, device) for c in raw]
        _check_lengths(module, {c.numel() for c in counts})
        counts_mk = torch.stack(counts)
    samples_t = host_to_device([samples], device)
    return counts_mk, torch.cat([counts_mk.sum(0), tokens.sum().reshape(1), samples_t])


def weigh_microbatches(
    strategy: Strategy, module: NanoModule, microbatches: Sequence[Any]
) -> MicrobatchWeights:
    """Count every term's denominators (or the tokens) of the global batch with one small
    all-reduce over the data-parallel replicas, before any backward, and derive each local
    microbatch's scales (see the module docstring).

    Raises:
        ValueError: for an empty list of microbatches, or `loss_counts` giving counts of
            different lengths for the microbatches of one step.
    """
    if not microbatches:
        raise ValueError("forward_backward needs at least one microbatch")
    device = strategy.root_device
    raw = [module.loss_counts(mb) for mb in microbatches]
    uses_terms = raw[0] is not None
    if uses_terms and any(c is None for c in raw):
        raise ValueError(
            f"{type(module).__name__}.loss_counts returned None for some microbatches of "
            "a step and counts for others; return counts for every microbatch"
        )
    raw_tokens = [module.count_tokens(mb) for mb in microbatches]
    samples = float(sum(module.count_samples(mb) for mb in microbatches))
    replicas = strategy.gradient_replicas
    shards = strategy.data_shard().count
    if replicas != shards:  # context parallelism: replicas // shards ranks share each sample
        samples = samples * shards / replicas
    if all(map(_on_host, raw + raw_tokens)):
        rows, tokens = _host_rows(module, raw if uses_terms else None, raw_tokens)
        if replicas == 1:  # nothing to reduce: every number is known here
            return _weigh_on_host(
                tuple(map(tuple, rows)), tuple(tokens), samples, uses_terms, device
            )
        n, k = len(rows), len(rows[0])
        sums = [sum(r[j] for r in rows) for j in range(k)]
        flat = host_to_device([v for r in rows for v in r] + sums + [sum(tokens), samples], device)
        counts_mk, local = flat[: n * k].view(n, k), flat[n * k :]
    else:
        counts_mk, local = _device_counts(
            module, raw if uses_terms else None, raw_tokens, samples, device
        )
    total = strategy.reduce(local, op="sum")
    k = counts_mk.shape[1]
    global_counts, total_tokens, total_samples = total[:k], total[k], total[k + 1]
    present = global_counts > 0
    scales = counts_mk * replicas / torch.where(present, global_counts, 1.0)
    scales = torch.where(present, scales, torch.zeros_like(scales))
    if not uses_terms:
        # data without tokens: the plain mean over microbatches (and over replicas)
        even = torch.full_like(scales, 1.0 / len(microbatches))
        scales = torch.where(present, scales, even)
    return MicrobatchWeights(
        scales, global_counts, total_tokens, total_samples, uses_terms, replicas
    )


def extract_loss(output: Any) -> Tensor:
    """Return the loss tensor from what `training_step` returned (a tensor or a dict with "loss").

    Raises:
        TypeError: when the output is neither.
    """
    if isinstance(output, Tensor):
        return output
    if isinstance(output, dict) and isinstance(output.get("loss"), Tensor):
        return output["loss"]
    if output is None:
        raise TypeError(
            "training_step returned None: Lightning skips such a batch, but nanotrain steps "
            "whole global batches on every rank together; return the loss, and leave unwanted "
            "samples out of the data (or weigh them 0 in the loss)"
        )
    raise TypeError(
        "training_step must return the loss as a scalar tensor or a dict with a 'loss' tensor, "
        f"got {type(output).__name__}"
    )


class LossAccumulator:
    """Turns each microbatch's `training_step` output into what to backpropagate, and sums
    the detached terms for the step's global values.

    Args:
        weighed: the step's `MicrobatchWeights`.
    """

    def __init__(self, weighed: MicrobatchWeights) -> None:
        self.weighed = weighed
        self._sums: Tensor | None = None
        # a microbatch whose host scale is exactly 1 (one microbatch, one replica), kept
        # as is until a sum is needed: then the step's loss is that loss, with no tensor op
        self._unit_loss: Tensor | None = None
        self.terms: LossTerms | None = None

    @property
    def sums(self) -> Tensor:
        """[K] float64: each term summed over the microbatches so far, times their scales."""
        if self._sums is None:
            self._sums = torch.zeros_like(self.weighed.global_counts)
        if self._unit_loss is not None:
            self._sums.add_(self._unit_loss.double())
            self._unit_loss = None
        return self._sums

    def objective(self, m: int, output: Any) -> Tensor:
        """The scalar microbatch `m` backpropagates, given its `training_step` output.

        Raises:
            TypeError: in loss-terms mode, when the output carries no `LossTerms`.
        """
        if not self.weighed.uses_terms:
            loss = extract_loss(output)
            host = self.weighed.host_scales
            if host is not None and host[m][0] == 1.0:  # x * 1.0 == x: skip the multiplies
                if self._sums is None and self._unit_loss is None:
                    self._unit_loss = loss.detach()
                else:
                    self.sums.add_(loss.detach().double())
                return loss
            scale = self.weighed.scales[m]
            self.sums.add_(loss.detach().double() * scale)
            return loss * scale[0].to(loss.dtype)
        scale = self.weighed.scales[m]
        terms = output.get("loss_terms") if isinstance(output, dict) else None
        if not isinstance(terms, LossTerms):
            raise TypeError(
                "the module's loss_counts() reports loss terms, so training_step must return "
                "{'loss': ..., 'loss_terms': LossTerms(...)} (see nanotrain.loss_terms)"
            )
        if terms.values.numel() != scale.numel():
            raise ValueError(
                f"training_step returned {terms.values.numel()} loss terms but loss_counts "
                f"gave {scale.numel()} counts; they must match term by term"
            )
        values = terms.values
        # kept for the names and weights only: detached, so the step does not hold this
        # microbatch's graph (a split backward's weight half leaves input-only nodes alive
        # for as long as anything references the loss)
        self.terms = replace(terms, values=values.detach())
        self.sums.add_(values.detach().double() * scale)
        factor = terms.weight_tensor(scale.device) * scale
        return (values * factor.to(values.dtype)).sum()

    def finish(self, strategy: Strategy, sums: Tensor | None = None) -> tuple[Tensor, dict]:
        """The step's global loss and the global value of each named term.

        Args:
            strategy: reduces the sums over data-parallel replicas (one all-reduce).
            sums: the local sums to use instead of `self.sums` (e.g. already summed over
                pipeline stages).
        Returns:
            (loss: 0-dim float32, identical on every rank; {metric name: 0-dim tensor}).
        """
        if sums is None and self._sums is None and self._unit_loss is not None:
            # one microbatch at scale 1 on one replica: 0 + x summed once and cast back to
            # float32 is x itself
            loss = self._unit_loss.float()
            return (loss if loss.dim() == 0 else loss.reshape(())), {}
        local = self.sums if sums is None else sums
        if self.weighed.replicas == 1:  # nothing to reduce over (and x / 1 == x)
            global_values = local
        else:
            global_values = strategy.reduce(local, op="sum") / self.weighed.replicas
        if self.terms is None:
            return global_values.sum().float(), {}
        weights = self.terms.weight_tensor(global_values.device)
        loss = (global_values * weights).sum().float()
        named = self.terms.named_means(global_values)
        return loss, {name: value.float() for name, value in named.items()}
