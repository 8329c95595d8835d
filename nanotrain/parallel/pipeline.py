"""Pipeline parallelism: which layers each stage owns, and the transfers between stages.

Stage partition. The model's layers are cut into ``pp × virtual_pp`` chunks of consecutive
layers (virtual stages ``0 .. pp·v-1``); which rank holds which is the placement
(`nanotrain.parallel.placement`): Megatron's interleaved one (stage ``k`` on rank ``k % pp``
as its chunk ``k // pp``; with v=1 rank r simply holds stage r) or DualPipeV's V. The first
virtual stage also owns the embedding, the last the final norm, the head, the loss and the
MTP modules (`nanotrain.models.stages`).

Running a schedule: `nanotrain.parallel.schedule_runner.run_schedule` executes a list of
`schedules.Action` on this rank over a `PipelineComm` (GPipe, 1F1B, interleaved 1F1B, 1F1B
with split backwards or DualPipeV, with their bubbles, in `nanotrain.parallel.schedules`).
Every transfer is point-to-point between neighbouring stages; a send goes out as soon as its
tensor exists and only receives are waited on; between two stages on the same rank
(DualPipeV's turn) the tensor is handed over in memory. Shapes are known up front
(``[micro_batch, seq_len (/ tp under SP), hidden]``), so receive buffers are allocated
without a shape handshake.

Deadlock freedom. Activations in each direction between two ranks, and gradients in each,
travel on channels with a two-rank process group of their own
(`MeshLayout.pipeline_channels`; the last-to-first wrap of interleaved schedules included).
On NCCL the transfers of one group run one after another, and a large send does not finish
before its receive has started: with one group for both directions, a send waiting for its
peer could hold up the receive that the peer's own send waits for (interleaved 1F1B and
GPipe with virtual stages did deadlock so once activations outgrow NCCL's buffers);
DualPipeV sends activations and gradients the same way between two ranks, in orders the
receiver does not share. With a group per direction and kind every channel is a queue whose
order the receiver follows, so any schedule whose per-rank order respects the data
dependencies runs (`tests/unit/test_pipeline_channels.py` replays every schedule's
transfers under these rules). Tags (microbatch, edge, direction) tell messages apart on
gloo; NCCL matches by order.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

from nanotrain.parallel.placement import StagePlacement

__all__ = ["PipelineComm", "open_channels", "partition_layers", "stage_layers"]


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
    v_shape: bool = False,
) -> list[list[int]]:
    """This rank's chunks: layer indices of its virtual stages, by local chunk (interleaved
    placement: stages ``c * pp + pp_rank``; ``v_shape``: stages ``pp_rank`` and
    ``2·pp - 1 - pp_rank``)."""
    chunks = partition_layers(num_layers, pp, virtual_pp, layout)
    placement = StagePlacement(pp, virtual_pp, v_shape)
    return [chunks[k] for k in placement.stages_of(pp_rank)]


class PipelineComm:
    """Point-to-point transfers between neighbouring virtual stages of one pipeline.

    Args:
        pp_ranks: global ranks of this rank's pipeline group, in stage order.
        pp_rank: this rank's stage index.
        num_chunks: local chunks (virtual_pp).
        shape, dtype, device: of every activation and activation gradient sent.
        channels: (sender, receiver, gradient?) global ranks -> that channel's two-rank
            group (`ParallelMesh.pp_channels`); None: every transfer on the default group,
            which is safe on gloo only (see the module docstring).
        v_shape: the stages sit in DualPipeV's V (`nanotrain.parallel.placement`); False:
            interleaved.
    """

    def __init__(
        self,
        pp_ranks: Sequence[int],
        pp_rank: int,
        num_chunks: int,
        shape: Sequence[int],
        dtype: torch.dtype,
        device: torch.device,
        channels: Mapping[tuple[int, int, bool], ProcessGroup] | None = None,
        v_shape: bool = False,
    ) -> None:
        self.pp_ranks, self.pp_rank = list(pp_ranks), pp_rank
        self.pp = len(self.pp_ranks)
        self.placement = StagePlacement(self.pp, num_chunks, v_shape)
        self.num_virtual = self.placement.num_virtual
        self.shape, self.dtype, self.device = tuple(shape), dtype, device
        self.channels = dict(channels or {})
        self.rank = self.pp_ranks[pp_rank]

    def _op(
        self, op: Callable, tensor: Tensor | None, peer: int, microbatch: int, edge: int,
        backward: bool,
    ) -> dist.P2POp | _LocalHandOver:  # fmt: skip
        # edge k joins virtual stages k and k+1
        tag = (microbatch * self.num_virtual + edge) * 2 + int(backward)
        if peer == self.rank:
            return _LocalHandOver(tensor, tag)
        pair = (self.rank, peer) if op is dist.isend else (peer, self.rank)
        channel = (*pair, backward)
        if self.channels and channel not in self.channels:
            # falling back to the default group could deadlock NCCL (module docstring)
            raise ValueError(
                f"no pipeline channel {channel} (sender, receiver, gradient?) for a transfer "
                f"of this placement (v_shape={self.placement.v_shape}); build the mesh with "
                "the same placement (ParallelMesh.build(..., pipeline_v_shape=...))"
            )
        group = self.channels.get(channel)
        return dist.P2POp(op, tensor, peer, group=group, tag=tag)

    def virtual_stage(self, chunk: int) -> int:
        """Virtual stage index of local ``chunk``."""
        return self.placement.stage(self.pp_rank, chunk)

    def is_first(self, chunk: int) -> bool:
        """Whether local ``chunk`` is the first virtual stage (it embeds the tokens)."""
        return self.virtual_stage(chunk) == 0

    def is_last(self, chunk: int) -> bool:
        """Whether local ``chunk`` is the last virtual stage (it computes the loss)."""
        return self.virtual_stage(chunk) == self.num_virtual - 1

    def _peer(self, virtual_stage: int) -> int:
        return self.pp_ranks[self.placement.locate(virtual_stage)[0]]

    def _buffer(self, peer: int) -> Tensor | None:
        # a hand-over on this rank brings its own tensor
        if peer == self.rank:
            return None
        return torch.empty(self.shape, dtype=self.dtype, device=self.device)

    def recv_forward(self, microbatch: int, chunk: int) -> dist.P2POp | _LocalHandOver:
        """Op receiving ``chunk``'s input activation from the previous stage."""
        k = self.virtual_stage(chunk)
        peer = self._peer(k - 1)
        return self._op(dist.irecv, self._buffer(peer), peer, microbatch, k - 1, False)

    def send_forward(
        self, microbatch: int, chunk: int, output: Tensor
    ) -> dist.P2POp | _LocalHandOver:
        """Op sending ``chunk``'s output activation to the next stage."""
        k = self.virtual_stage(chunk)
        return self._op(
            dist.isend, output.detach().contiguous(), self._peer(k + 1), microbatch, k, False
        )

    def recv_backward(self, microbatch: int, chunk: int) -> dist.P2POp | _LocalHandOver:
        """Op receiving the gradient of ``chunk``'s output from the next stage."""
        k = self.virtual_stage(chunk)
        peer = self._peer(k + 1)
        return self._op(dist.irecv, self._buffer(peer), peer, microbatch, k, True)

    def send_backward(
        self, microbatch: int, chunk: int, grad: Tensor
    ) -> dist.P2POp | _LocalHandOver:
        """Op sending the gradient of ``chunk``'s input to the previous stage."""
        k = self.virtual_stage(chunk)
        return self._op(dist.isend, grad.contiguous(), self._peer(k - 1), microbatch, k - 1, True)


def open_channels(
    order: Sequence[tuple[int, int, bool]],
    channels: Mapping[tuple[int, int, bool], ProcessGroup],
    rank: int,
    device: torch.device,
) -> None:
    """Send one element over every pipeline channel this rank is in, in the global `order`
    (`MeshLayout.pipeline_channels`; every rank walks the same list). NCCL connects a group at
    its first transfer, and both ranks wait there for each other: connecting them all up
    front, in one order, keeps that wait from crossing the schedule's own transfers (the
    earliest unconnected channel always has both its ranks waiting on it)."""
    one = torch.zeros(1, device=device)
    for channel in order:
        src, dst, _ = channel
        if rank == src:
            dist.send(one, dst, group=channels[channel])
        elif rank == dst:
            dist.recv(one, src, group=channels[channel])


@dataclass(frozen=True)
class _LocalHandOver:
    """A transfer between two stages on the same rank: the sent tensor (None on the
    receiving side) under the transfer's tag."""

    tensor: Tensor | None
    tag: int
