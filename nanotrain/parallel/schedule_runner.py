"""Running a pipeline schedule on one rank: `run_schedule` executes the actions of
`nanotrain.parallel.schedules` over the transfers of a `PipelineComm`
(`nanotrain.parallel.pipeline`).

A forward receives its input activation from the previous virtual stage, runs the chunk and
sends the output on; a backward receives the gradient of that output from the next virtual
stage, backpropagates the output and this chunk's own loss term (MoE balance losses, and on
the last stage the LM and MTP losses) and sends the input's gradient back. A split backward
does the same in its input half (I) and leaves the weight gradients to its W action
(`nanotrain.parallel.split_backward`). Sends go out as soon as their tensor exists; only
receives are waited on.

Paired chunks (``overlap=True``): where a forward of one chunk is followed by a backward (or
input half) of another chunk, as in DualPipeV's steady state, both receives are waited on
first (DualPipe's order), then the backward runs on a worker thread while the forward runs on
this one, and both results are sent. Whatever one of them waits for, its expert all-to-alls
above all, the other computes meanwhile. The two chunks must use process groups of their
own for the collectives inside them (`PipelineStage` binds the second chunk to the mesh's
paired groups), so that each group's collectives keep one order on every rank. The results
are the same as run one after the other.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from nanotrain.parallel.pipeline import PipelineComm, _LocalHandOver
from nanotrain.parallel.schedules import Action
from nanotrain.parallel.split_backward import WeightGradients, backward_input
from nanotrain.runtime.collective_errors import CollectiveTimeoutError
from nanotrain.runtime.profiling import named_range

__all__ = ["ForwardStep", "ScheduleStats", "TimelineEvent", "pairs_with", "run_schedule"]


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


def pairs_with(first: Action, second: Action) -> bool:
    """Whether `second` can run beside `first` under ``overlap=True``: a forward, then a
    backward or input half of another chunk (another microbatch, other layers)."""
    return first.kind == "F" and second.sends_input_grad and first.chunk != second.chunk


#: a held forward: (input activation, output, loss term), each None where absent
_Held = tuple[Tensor | None, Tensor | None, Tensor | None]


class _Run:
    """One run of a schedule on this rank: the held forwards, the deferred weight halves,
    the transfers and the statistics (see `run_schedule` for the arguments)."""

    def __init__(
        self,
        comm: PipelineComm,
        forward_step: ForwardStep,
        loss_scales: Sequence[float] | None,
        forward_only: bool,
        params: Sequence[Tensor],
        timeline: list[TimelineEvent] | None,
    ) -> None:
        self.comm, self.forward_step, self.loss_scales = comm, forward_step, loss_scales
        self.forward_only, self.params, self.timeline = forward_only, params, timeline
        self.transfers, self.stats = _Transfers(comm), ScheduleStats()
        self.held: dict[tuple[int, int], _Held] = {}
        self.deferred: dict[tuple[int, int], WeightGradients] = {}

    def _span(self, kind: str, action: Action) -> contextlib.AbstractContextManager:
        return _NO_SPAN if self.timeline is None else _Span(self.timeline, kind, action)

    def _waited(self, action: Action) -> _Span | None:
        return None if self.timeline is None else _Span(self.timeline, "recv", action)

    # -- forward --------------------------------------------------------------------------
    def forward_input(self, a: Action) -> Tensor | None:
        """The received input activation of forward `a` (None on the first stage)."""
        comm, m, c = self.comm, a.microbatch, a.chunk
        if comm.is_first(c):
            return None
        what = f"microbatch {m}'s input activation (virtual stage {comm.virtual_stage(c)})"
        inp = self.transfers.receive(comm.recv_forward(m, c), what, self._waited(a))
        inp.requires_grad_(not self.forward_only)
        return inp

    def forward(self, a: Action, inp: Tensor | None) -> tuple[Tensor | None, Tensor | None]:
        """Run forward `a` on `inp`: (output, loss term)."""
        m, c = a.microbatch, a.chunk
        stage_range = named_range(f"nanotrain/stage{self.comm.virtual_stage(c)}/forward/mb{m}")
        with torch.set_grad_enabled(not self.forward_only), stage_range, self._span("F", a):
            return self.forward_step(m, c, inp)

    def forward_done(
        self, a: Action, inp: Tensor | None, out: Tensor | None, loss: Tensor | None
    ) -> None:
        """Send forward `a`'s output on and hold what its backward needs."""
        comm, m, c = self.comm, a.microbatch, a.chunk
        if out is not None and not comm.is_last(c):
            self.transfers.send(comm.send_forward(m, c, out))
        self.stats.forwards += 1
        if self.forward_only:
            return
        if comm.is_last(c):
            # the last chunk's output goes nowhere; holding it would keep the part of the
            # graph below it alive until the next backward (after a split backward's weight
            # half, with the saved tensors of its input-only path)
            out = None
        self.held[(m, c)] = (inp, out, loss)
        live = len(self.held) + len(self.deferred)
        self.stats.peak_in_flight = max(self.stats.peak_in_flight, live)

    # -- backward -------------------------------------------------------------------------
    def backward_grad(self, a: Action) -> Tensor | None:
        """The received gradient of backward `a`'s output (None on the last stage)."""
        comm, m, c = self.comm, a.microbatch, a.chunk
        if comm.is_last(c):
            return None
        what = f"the gradient of microbatch {m}'s output (virtual stage {comm.virtual_stage(c)})"
        return self.transfers.receive(comm.recv_backward(m, c), what, self._waited(a))

    def backward(
        self, a: Action, grad: Tensor | None, held: _Held
    ) -> tuple[Tensor | None, Tensor | None, WeightGradients | None]:
        """Run backward (or input half) `a` of the forward `held`: (its input, the input's
        gradient, the weight half left for later or None). Touches no shared state, so it
        may run on another thread."""
        m, stage = a.microbatch, self.comm.virtual_stage(a.chunk)
        inp, out, loss = held
        scale = 1.0 if self.loss_scales is None else self.loss_scales[m]
        tensors, grads = _backward_roots(out, grad, loss, scale)
        if a.kind == "I":
            with named_range(f"nanotrain/stage{stage}/backward_input/mb{m}"), self._span("I", a):
                params = self.params() if callable(self.params) else self.params
                inp_grad, weights = backward_input(tensors, grads, inp, params)
            return inp, inp_grad, weights
        with named_range(f"nanotrain/stage{stage}/backward/mb{m}"), self._span("B", a):
            if tensors:
                torch.autograd.backward(tensors, grads)
        return inp, None if inp is None else inp.grad, None

    def backward_done(
        self,
        a: Action,
        inp: Tensor | None,
        inp_grad: Tensor | None,
        weights: WeightGradients | None,
    ) -> None:
        """Keep backward `a`'s weight half for its W, send its input's gradient back."""
        m, c = a.microbatch, a.chunk
        if weights is not None:
            self.deferred[(m, c)] = weights
        if inp is not None:
            g = inp_grad if inp_grad is not None else torch.zeros_like(inp)
            self.transfers.send(self.comm.send_backward(m, c, g))
        self.stats.backwards += 1

    def weight(self, a: Action) -> None:
        """Run weight half `a`."""
        m, c = a.microbatch, a.chunk
        stage = self.comm.virtual_stage(c)
        with named_range(f"nanotrain/stage{stage}/backward_weights/mb{m}"), self._span("W", a):
            self.deferred.pop((m, c))()

    # -- whole actions --------------------------------------------------------------------
    def run_forward(self, a: Action) -> None:
        inp = self.forward_input(a)
        out, loss = self.forward(a, inp)
        self.forward_done(a, inp, out, loss)

    def run_backward(self, a: Action) -> None:
        grad = self.backward_grad(a)
        self.backward_done(a, *self.backward(a, grad, self.held.pop((a.microbatch, a.chunk))))

    def run_pair(self, f: Action, b: Action, worker: ThreadPoolExecutor) -> None:
        """Forward `f` here while backward `b` runs on `worker` (both receives first)."""
        inp = self.forward_input(f)
        grad = self.backward_grad(b)
        key = (b.microbatch, b.chunk)
        running = worker.submit(self.backward, b, grad, self.held[key])
        try:
            out, loss = self.forward(f, inp)
        finally:
            result = running.result()  # its error first: the forward may wait on its peers
        self.forward_done(f, inp, out, loss)  # counts the backward's microbatch as held
        del self.held[key]
        self.backward_done(b, *result)

    def finish(self) -> ScheduleStats:
        self.transfers.finish()
        assert not self.held, f"schedule left forwards without a backward: {sorted(self.held)}"
        assert not self.deferred, (
            f"schedule left split backwards without their W: {sorted(self.deferred)}"
        )
        return self.stats


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
    overlap: bool = False,
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
        params: this rank's parameters, for schedules that split backwards (I and W actions),
            or a callable returning them at each input half (ZeRO-3: FSDP2's gathered
            parameters, which exist only once a forward has gathered them).
        timeline: when given, every action's compute and every wait for a receive are
            appended to it as `TimelineEvent`s, in the order they happen (a paired
            backward's span overlaps its forward's).
        overlap: run each forward and the backward of another chunk right after it side by
            side (`pairs_with`; see the module docstring).

    Returns:
        `ScheduleStats` of this run.
    """
    run = _Run(comm, forward_step, loss_scales, forward_only, params, timeline)
    last_b = max((i for i, a in enumerate(actions) if a.kind in ("B", "W")), default=-1)
    pairing = overlap and not forward_only
    with ThreadPoolExecutor(1) if pairing else contextlib.nullcontext() as worker:
        i = 0
        while i < len(actions):
            action = actions[i]
            if action.kind != "F" and forward_only:
                raise ValueError("a forward-only run got a backward action")
            paired = pairing and i + 1 < len(actions) and pairs_with(action, actions[i + 1])
            if before_last_backward is not None and last_b in (i, i + int(paired)):
                before_last_backward()
            if paired:
                run.run_pair(action, actions[i + 1], worker)
                i += 2
                continue
            if action.kind == "F":
                run.run_forward(action)
            elif action.kind == "W":
                run.weight(action)
            else:
                run.run_backward(action)
            i += 1
    return run.finish()


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
