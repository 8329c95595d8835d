"""Pipeline parallelism: which layers each stage owns, and running a schedule across stages.

Stage partition. The model's layers are cut into ``pp × virtual_pp`` chunks of consecutive
layers (virtual stages ``0 .. pp·v-1``); virtual stage ``k`` lives on pipeline rank
``k % pp`` as its local chunk ``k // pp`` (Megatron's interleaved assignment; with v=1 rank r
simply holds chunk r). The first virtual stage also owns the embedding, the last the final
norm, the head, the loss and the MTP modules (`nanotrain.models.stages`).

Running a schedule. `run_schedule` executes a list of `schedules.Action` on this rank: a
forward receives its input activation from the previous virtual stage, runs the chunk and
sends the output on; a backward receives the gradient of that output from the next virtual
stage, backpropagates the output and this chunk's own loss term (MoE balance losses, and on
the last stage the LM and MTP losses) and sends the input's gradient back. Every transfer is
point-to-point between neighbouring stages, batched (`dist.batch_isend_irecv`): the sends
left over from the previous action go out together with the receive the next action needs.
Shapes are known up front (``[micro_batch, seq_len (/ tp under SP), hidden]``), so receive
buffers are allocated without a shape handshake. Sends are never waited on before the end of
the step (only receives block), so any schedule whose per-rank order respects the data
dependencies runs without deadlock. Messages are told apart by tag (microbatch, edge,
direction), so several can be in flight between the same two ranks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from nanotrain.parallel.schedules import Action
from nanotrain.profiling import named_range

__all__ = [
    "PipelineComm",
    "ScheduleStats",
    "partition_layers",
    "run_schedule",
    "stage_layers",
]


def partition_layers(
    num_layers: int, pp: int, virtual_pp: int = 1, layout: Sequence[int] | None = None
) -> list[list[int]]:
    """Layer indices of every virtual stage, in pipeline order (``pp * virtual_pp`` lists).

    Args:
        num_layers: decoder layers in the model.
        pp, virtual_pp: pipeline size and chunks per rank.
        layout: optional number of layers per virtual stage (e.g. ``[1, 2, 2, 1]`` to give
            the stages that also hold the embedding or the head fewer layers); None splits
            evenly.

    Raises:
        ValueError: naming the numbers, when the layers do not split evenly without a layout,
            or the layout has the wrong length, a negative entry or the wrong sum.
    """
    chunks = pp * virtual_pp
    if pp < 1 or virtual_pp < 1:
        raise ValueError(f"pp and virtual_pp must be >= 1, got pp={pp}, virtual_pp={virtual_pp}")
    if layout is None:
        if num_layers % chunks != 0:
            raise ValueError(
                f"num_layers={num_layers} does not split evenly into pp*virtual_pp="
                f"{pp}*{virtual_pp}={chunks} chunks; pick sizes whose product divides "
                f"{num_layers}, or give pipeline_layout (layers per chunk, {chunks} numbers "
                f"summing to {num_layers})"
            )
        layout = [num_layers // chunks] * chunks
    layout = list(layout)
    if len(layout) != chunks:
        raise ValueError(
            f"pipeline_layout has {len(layout)} entries but pp*virtual_pp={pp}*{virtual_pp}="
            f"{chunks} chunks need one each"
        )
    if any(not isinstance(n, int) or n < 0 for n in layout) or sum(layout) != num_layers:
        raise ValueError(
            f"pipeline_layout {layout} must hold non-negative ints summing to "
            f"num_layers={num_layers} (sums to {sum(layout)})"
        )
    out, start = [], 0
    for n in layout:
        out.append(list(range(start, start + n)))
        start += n
    return out


def stage_layers(
    num_layers: int,
    pp: int,
    pp_rank: int,
    virtual_pp: int = 1,
    layout: Sequence[int] | None = None,
) -> list[list[int]]:
    """This rank's chunks: layer indices of virtual stages ``c * pp + pp_rank``, c = 0..v-1."""
    chunks = partition_layers(num_layers, pp, virtual_pp, layout)
    return [chunks[c * pp + pp_rank] for c in range(virtual_pp)]


class PipelineComm:
    """Point-to-point transfers between neighbouring virtual stages of one pipeline.

    Args:
        pp_ranks: global ranks of this rank's pipeline group, in stage order.
        pp_rank: this rank's stage index.
        num_chunks: local chunks (virtual_pp).
        shape, dtype, device: of every activation and activation gradient sent.
    """

    def __init__(
        self,
        pp_ranks: Sequence[int],
        pp_rank: int,
        num_chunks: int,
        shape: Sequence[int],
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.pp_ranks, self.pp_rank = list(pp_ranks), pp_rank
        self.pp = len(self.pp_ranks)
        self.num_virtual = self.pp * num_chunks
        self.shape, self.dtype, self.device = tuple(shape), dtype, device

    def virtual_stage(self, chunk: int) -> int:
        """Virtual stage index of local ``chunk``."""
        return chunk * self.pp + self.pp_rank

    def is_first(self, chunk: int) -> bool:
        """Whether local ``chunk`` is the first virtual stage (it embeds the tokens)."""
        return self.virtual_stage(chunk) == 0

    def is_last(self, chunk: int) -> bool:
        """Whether local ``chunk`` is the last virtual stage (it computes the loss)."""
        return self.virtual_stage(chunk) == self.num_virtual - 1

    def _tag(self, microbatch: int, edge: int, backward: bool) -> int:
        # edge k joins virtual stages k and k+1
        return (microbatch * self.num_virtual + edge) * 2 + int(backward)

    def _peer(self, virtual_stage: int) -> int:
        return self.pp_ranks[virtual_stage % self.pp]

    def recv_forward(self, microbatch: int, chunk: int) -> tuple[Tensor, dist.P2POp]:
        """Buffer and op receiving ``chunk``'s input activation from the previous stage."""
        k = self.virtual_stage(chunk)
        buf = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        tag = self._tag(microbatch, k - 1, False)
        return buf, dist.P2POp(dist.irecv, buf, self._peer(k - 1), tag=tag)

    def send_forward(self, microbatch: int, chunk: int, output: Tensor) -> dist.P2POp:
        """Op sending ``chunk``'s output activation to the next stage."""
        k = self.virtual_stage(chunk)
        tag = self._tag(microbatch, k, False)
        return dist.P2POp(dist.isend, output.detach().contiguous(), self._peer(k + 1), tag=tag)

    def recv_backward(self, microbatch: int, chunk: int) -> tuple[Tensor, dist.P2POp]:
        """Buffer and op receiving the gradient of ``chunk``'s output from the next stage."""
        k = self.virtual_stage(chunk)
        buf = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        return buf, dist.P2POp(
            dist.irecv, buf, self._peer(k + 1), tag=self._tag(microbatch, k, True)
        )

    def send_backward(self, microbatch: int, chunk: int, grad: Tensor) -> dist.P2POp:
        """Op sending the gradient of ``chunk``'s input to the previous stage."""
        k = self.virtual_stage(chunk)
        tag = self._tag(microbatch, k - 1, True)
        return dist.P2POp(dist.isend, grad.contiguous(), self._peer(k - 1), tag=tag)


@dataclass
class ScheduleStats:
    """What one run of a schedule did on this rank.

    Attributes:
        peak_in_flight: most microbatch-chunks whose forward activations were held at once
            (forward done, backward not yet).
        forwards, backwards: actions executed.
    """

    peak_in_flight: int = 0
    forwards: int = 0
    backwards: int = 0


#: forward_step(microbatch, chunk, input or None) -> (output or None, loss term or None)
ForwardStep = Callable[[int, int, Tensor | None], tuple[Tensor | None, Tensor | None]]


class _Sender:
    """Sends wait to go out with the next receive (one batched call); handles are kept until
    `finish` so that the tensors stay alive until delivered."""

    def __init__(self) -> None:
        self.pending: list[dist.P2POp] = []
        self.works: list[dist.Work] = []

    def exchange(self, recv: dist.P2POp | None = None) -> None:
        ops = self.pending + ([recv] if recv is not None else [])
        self.pending = []
        if not ops:
            return
        works = dist.batch_isend_irecv(ops)
        if recv is not None:
            works[-1].wait()
        self.works += works[: len(ops) - (recv is not None)]
        self.works = [w for w in self.works if not w.is_completed()]

    def finish(self) -> None:
        self.exchange()
        for work in self.works:
            work.wait()
        self.works = []


def run_schedule(
    actions: Sequence[Action],
    comm: PipelineComm,
    forward_step: ForwardStep,
    *,
    loss_scales: Sequence[float] | None = None,
    forward_only: bool = False,
    before_last_backward: Callable[[], None] | None = None,
) -> ScheduleStats:
    """Run ``actions`` on this rank, exchanging activations and gradients through ``comm``.

    Args:
        actions: this rank's schedule (`nanotrain.parallel.schedules`).
        comm: the transfers of this rank's pipeline.
        forward_step: runs one chunk on one microbatch, given the received input activation
            (None on the first virtual stage); returns the output activation (None on the
            last virtual stage) and this chunk's loss term (None or a scalar).
        loss_scales: per microbatch, what its loss terms are multiplied by in backward (its
            weight in the step's loss); None: 1.0 each.
        forward_only: no autograd graph, no backward (validation); B actions are refused.
        before_last_backward: called right before the rank's final backward (e.g. to turn
            on overlapped gradient reduction).

    Returns:
        `ScheduleStats` of this run.
    """
    sender, stats = _Sender(), ScheduleStats()

    def receives_next(i: int) -> bool:
        """Whether action i + 1 starts with a receive (so a pending send can go with it)."""
        if i + 1 >= len(actions):
            return False
        nxt = actions[i + 1]
        c = nxt.chunk
        return not comm.is_first(c) if nxt.kind == "F" else not comm.is_last(c)

    held: dict[tuple[int, int], tuple[Tensor | None, Tensor | None, Tensor | None]] = {}
    last_b = max((i for i, a in enumerate(actions) if a.kind == "B"), default=-1)
    for i, action in enumerate(actions):
        m, c = action.microbatch, action.chunk
        if action.kind == "F":
            inp = None
            if not comm.is_first(c):
                inp, op = comm.recv_forward(m, c)
                sender.exchange(op)
                inp.requires_grad_(not forward_only)
            stage_range = named_range(f"nanotrain/stage{comm.virtual_stage(c)}/forward/mb{m}")
            with torch.set_grad_enabled(not forward_only), stage_range:
                out, loss = forward_step(m, c, inp)
            if out is not None and not comm.is_last(c):
                sender.pending.append(comm.send_forward(m, c, out))
                if not receives_next(i):
                    # no receive to pair it with: send now, or the next stage idles until
                    # this rank's next receive (GPipe's first stage would send nothing until
                    # all its forwards were done)
                    sender.exchange()
            stats.forwards += 1
            if not forward_only:
                held[(m, c)] = (inp, out, loss)
                stats.peak_in_flight = max(stats.peak_in_flight, len(held))
            continue
        if forward_only:
            raise ValueError("a forward-only run got a backward action")
        grad = None
        if not comm.is_last(c):
            grad, op = comm.recv_backward(m, c)
            sender.exchange(op)
        inp, out, loss = held.pop((m, c))
        if i == last_b and before_last_backward is not None:
            before_last_backward()
        with named_range(f"nanotrain/stage{comm.virtual_stage(c)}/backward/mb{m}"):
            _backward(out, grad, loss, 1.0 if loss_scales is None else loss_scales[m])
        if inp is not None:
            g = inp.grad if inp.grad is not None else torch.zeros_like(inp)
            sender.pending.append(comm.send_backward(m, c, g))
            if not receives_next(i):
                sender.exchange()
        stats.backwards += 1
    sender.finish()
    assert not held, f"schedule left forwards without a backward: {sorted(held)}"
    return stats


def _backward(
    out: Tensor | None, grad: Tensor | None, loss: Tensor | None, loss_scale: float
) -> None:
    """Backpropagate the chunk's output (with the received gradient) and its scaled loss."""
    tensors, grads = [], []
    if out is not None and grad is not None and out.requires_grad:
        tensors.append(out)
        grads.append(grad)
    if loss is not None and loss.requires_grad:
        tensors.append(loss)
        grads.append(torch.full_like(loss, loss_scale))
    if tensors:
        torch.autograd.backward(tensors, grads)
