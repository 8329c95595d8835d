"""Pipeline parallelism: which layers each stage owns, and running a schedule across stages.

Stage partition. The model's layers are cut into ``pp × virtual_pp`` chunks of consecutive
layers (virtual stages ``0 .. pp·v-1``); which rank holds which is the placement
(`nanotrain.parallel.placement`): Megatron's interleaved one (stage ``k`` on rank ``k % pp``
as its chunk ``k // pp``; with v=1 rank r simply holds stage r) or DualPipeV's V. The first
virtual stage also owns the embedding, the last the final norm, the head, the loss and the
MTP modules (`nanotrain.models.stages`).

Running a schedule. `run_schedule` executes a list of `schedules.Action` on this rank (GPipe,
1F1B, interleaved 1F1B, 1F1B with split backwards or DualPipeV, with their bubbles, in
`nanotrain.parallel.schedules`): a forward receives its input activation from the previous
virtual stage, runs the chunk and sends the output on; a backward receives the gradient of
that output from the next virtual stage, backpropagates the output and this chunk's own loss
term (MoE balance losses, and on the last stage the LM and MTP losses) and sends the input's
gradient back. A split backward does the same in its input half (I) and leaves the weight
gradients to its W action (`nanotrain.parallel.split_backward`). Every transfer is
point-to-point between neighbouring stages; a send goes out as soon as its tensor exists and
only receives are waited on; between two stages on the same rank (DualPipeV's turn) the
tensor is handed over in memory. Shapes are known up front (``[micro_batch, seq_len (/ tp under
SP), hidden]``), so receive buffers are allocated without a shape handshake.

Deadlock freedom. Activations in each direction between two ranks, and gradients in each,
travel on channels with a two-rank process group of their own
(`MeshLayout.pipeline_channels`; the last-to-first wrap of interleaved schedules included). On NCCL the transfers of one group run one after another,
and a large send does not finish before its receive has started: with one group for both
directions, a send waiting for its peer could hold up the receive that the peer's own send
waits for (interleaved 1F1B and GPipe with virtual stages did deadlock so once activations
outgrow NCCL's buffers); DualPipeV sends activations and gradients the same way between two
ranks, in orders the receiver does not share. With a group per direction and kind every
channel is a queue whose order the receiver follows, so any schedule whose per-rank order respects the data dependencies
runs (`tests/unit/test_pipeline_channels.py` replays every schedule's transfers under these
rules). Tags (microbatch, edge, direction) tell messages apart on gloo; NCCL matches by order.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

from nanotrain.parallel.placement import StagePlacement
from nanotrain.parallel.schedules import Action
from nanotrain.parallel.split_backward import WeightGradients, backward_input
from nanotrain.runtime.collective_errors import CollectiveTimeoutError
from nanotrain.runtime.profiling import named_range

__all__ = [
    "PipelineComm",
    "open_channels",
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
        group = self.channels.get((*pair, backward))
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


@dataclass
class ScheduleStats:
    """What one run of a schedule did on this rank.

    Attributes:
        peak_in_flight: most microbatch-chunks whose forward activations were held at once
            (forward done, backward, or the weight half of a split one, not yet).
        forwards, backwards: forwards and backwards (whole, or input halves) executed.
    """

    peak_in_flight: int = 0
    forwards: int = 0
    backwards: int = 0


@dataclass(frozen=True)
class TimelineEvent:
    """One span of a rank's run of a schedule, for pictures of it
    (`nanotrain.report.schedule_chart`).

    Attributes:
        kind: "F", "B", "I" or "W" (the action's compute), or "recv" (the time spent
            waiting for an activation or a gradient from a neighbouring stage).
        microbatch, chunk: the action's (a "recv" event's: the action it feeds).
        start, end: `time.perf_counter()` seconds on this rank.
    """

    kind: str
    microbatch: int
    chunk: int
    start: float
    end: float


#: forward_step(microbatch, chunk, input or None) -> (output or None, loss term or None)
ForwardStep = Callable[[int, int, Tensor | None], tuple[Tensor | None, Tensor | None]]


_NO_SPAN = contextlib.nullcontext()


class _Span:
    """Appends a `TimelineEvent` of `kind` for the time spent inside the `with` block."""

    def __init__(self, timeline: list[TimelineEvent], kind: str, action: Action) -> None:
        self.timeline, self.kind, self.action = timeline, kind, action

    def __enter__(self) -> None:
        self.start = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        a = self.action
        self.timeline.append(
            TimelineEvent(self.kind, a.microbatch, a.chunk, self.start, time.perf_counter())
        )


class _Transfers:
    """Posts every send at once (on its channel's group) and waits on receives; the sends'
    handles are kept until `finish` so that their tensors stay alive until delivered.
    Hand-overs between stages of this rank wait in `local` until received."""

    def __init__(self, comm: PipelineComm) -> None:
        self.comm = comm
        self.sends: list[dist.Work] = []
        self.local: dict[int, Tensor] = {}

    def send(self, op: dist.P2POp | _LocalHandOver) -> None:
        if isinstance(op, _LocalHandOver):
            self.local[op.tag] = op.tensor
            return
        self.sends.append(dist.isend(op.tensor, op.peer, group=op.group, tag=op.tag))
        self.sends = [w for w in self.sends if not w.is_completed()]

    def receive(
        self, op: dist.P2POp | _LocalHandOver, what: str, span: _Span | None = None
    ) -> Tensor:
        """Wait for `op` and return what it brought (`what`, for the error); a wait that
        outlasts the channel's timeout ends in a `CollectiveTimeoutError` naming this stage,
        the peer and `what`. `span`: records the wait as a "recv" event."""
        if isinstance(op, _LocalHandOver):
            return self.local.pop(op.tag)
        work = dist.irecv(op.tensor, op.peer, group=op.group, tag=op.tag)
        try:
            if span is None:
                work.wait()
            else:
                with span:
                    work.wait()
        except RuntimeError as exc:
            if not any(word in str(exc) for word in ("imed out", "imeout")):
                raise
            comm = self.comm
            peer_stage = comm.pp_ranks.index(op.peer)
            raise CollectiveTimeoutError(
                f"pipeline stage {comm.pp_rank} (rank {comm.rank}) waited for {what} from rank "
                f"{op.peer} (stage {peer_stage}) past the process group's timeout: rank "
                f"{op.peer} never sent it (stalled, crashed, or running another schedule or "
                f"number of microbatches). Cause: {exc}"
            ) from exc
        return op.tensor

    def finish(self) -> None:
        for work in self.sends:
            work.wait()
        self.sends = []


def run_schedule(
    actions: Sequence[Action],
    comm: PipelineComm,
    forward_step: ForwardStep,
    *,
    loss_scales: Sequence[float] | None = None,
    forward_only: bool = False,
    before_last_backward: Callable[[], None] | None = None,
    params: Sequence[Tensor] = (),
    timeline: list[TimelineEvent] | None = None,
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
        forward_only: no autograd graph, no backward (validation); backward actions are
            refused.
        before_last_backward: called right before the rank's last action that accumulates
            weight gradients, its final B or W (e.g. to turn on overlapped gradient reduction).
        params: this rank's parameters, for schedules that split backwards (I and W actions).
        timeline: when given, every action's compute and every wait for a receive are
            appended to it as `TimelineEvent`s, in the order they happen.

    Returns:
        `ScheduleStats` of this run.
    """
    transfers, stats = _Transfers(comm), ScheduleStats()
    held: dict[tuple[int, int], tuple[Tensor | None, Tensor | None, Tensor | None]] = {}
    deferred: dict[tuple[int, int], WeightGradients] = {}
    last_b = max((i for i, a in enumerate(actions) if a.kind in ("B", "W")), default=-1)

    def span(kind: str) -> contextlib.AbstractContextManager:
        return _NO_SPAN if timeline is None else _Span(timeline, kind, action)

    for i, action in enumerate(actions):
        m, c = action.microbatch, action.chunk
        waited = None if timeline is None else _Span(timeline, "recv", action)
        if action.kind == "F":
            inp = None
            if not comm.is_first(c):
                what = f"microbatch {m}'s input activation (virtual stage {comm.virtual_stage(c)})"
                inp = transfers.receive(comm.recv_forward(m, c), what, waited)
                inp.requires_grad_(not forward_only)
            stage_range = named_range(f"nanotrain/stage{comm.virtual_stage(c)}/forward/mb{m}")
            with torch.set_grad_enabled(not forward_only), stage_range, span("F"):
                out, loss = forward_step(m, c, inp)
            if out is not None and not comm.is_last(c):
                transfers.send(comm.send_forward(m, c, out))
            stats.forwards += 1
            if not forward_only:
                if comm.is_last(c):
                    # the last chunk's output goes nowhere; holding it would keep the part of
                    # the graph below it alive until the next backward (after a split
                    # backward's weight half, with the saved tensors of its input-only path)
                    out = None
                held[(m, c)] = (inp, out, loss)
                stats.peak_in_flight = max(stats.peak_in_flight, len(held) + len(deferred))
            continue
        if forward_only:
            raise ValueError("a forward-only run got a backward action")
        if i == last_b and before_last_backward is not None:
            before_last_backward()
        stage = comm.virtual_stage(c)
        if action.kind == "W":
            with named_range(f"nanotrain/stage{stage}/backward_weights/mb{m}"), span("W"):
                deferred.pop((m, c))()
            continue
        grad = None
        if not comm.is_last(c):
            what = f"the gradient of microbatch {m}'s output (virtual stage {stage})"
            grad = transfers.receive(comm.recv_backward(m, c), what, waited)
        inp, out, loss = held.pop((m, c))
        tensors, grads = _backward_roots(
            out, grad, loss, 1.0 if loss_scales is None else loss_scales[m]
        )
        if action.kind == "I":
            with named_range(f"nanotrain/stage{stage}/backward_input/mb{m}"), span("I"):
                inp_grad, deferred[(m, c)] = backward_input(tensors, grads, inp, params)
        else:
            with named_range(f"nanotrain/stage{stage}/backward/mb{m}"), span("B"):
                if tensors:
                    torch.autograd.backward(tensors, grads)
            inp_grad = None if inp is None else inp.grad
        if inp is not None:
            g = inp_grad if inp_grad is not None else torch.zeros_like(inp)
            transfers.send(comm.send_backward(m, c, g))
        stats.backwards += 1
    transfers.finish()
    assert not held, f"schedule left forwards without a backward: {sorted(held)}"
    assert not deferred, f"schedule left split backwards without their W: {sorted(deferred)}"
    return stats


def _backward_roots(
    out: Tensor | None, grad: Tensor | None, loss: Tensor | None, loss_scale: float
) -> tuple[list[Tensor], list[Tensor]]:
    """What a chunk backpropagates: its output (with the received gradient) and its scaled
    loss term, each only when it carries a graph."""
    tensors, grads = [], []
    if out is not None and grad is not None and out.requires_grad:
        tensors.append(out)
        grads.append(grad)
    if loss is not None and loss.requires_grad:
        tensors.append(loss)
        grads.append(torch.full_like(loss, loss_scale))
    return tensors, grads
