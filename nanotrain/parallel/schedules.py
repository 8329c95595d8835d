"""Pipeline schedules as plain lists of actions: which microbatch goes forward or backward
through which local model chunk, in what order, on one pipeline rank.

Every schedule has the same signature ``(num_microbatches, pp_size, pp_rank, num_chunks) ->
list[Action]``, so the executor (`nanotrain.parallel.schedule_runner.run_schedule`) and the strategy
never branch on which one is in use. Timelines for pp=4, m=8 (F = forward, B = backward,
numbers = microbatch) are drawn in docs/parallelism.md.

- GPipe (Huang et al. 2019): every forward, then every backward. Simple; holds the
  activations of all m microbatches at once. Bubble: (p - 1) / m of the ideal (bubble-free)
  step time, Narayanan et al.'s bubble fraction t_pb / t_id; (p - 1) / (m + p - 1) of the
  whole step, as GPipe's paper writes it.
- 1F1B (PipeDream-Flush, Narayanan et al. 2021): ``pp - rank - 1`` warm-up forwards, then
  alternate one forward and one backward, then the cool-down backwards. Same bubble as GPipe,
  (p - 1) / m of the ideal time, (p - 1) / (m + p - 1) of the step, but at most
  ``pp - rank`` microbatches in flight.
- Interleaved 1F1B (Megatron-LM, Narayanan et al. 2021 section 2.2): each rank holds
  ``num_chunks`` (v) non-consecutive chunks of layers; the bubble shrinks by v, to
  (p - 1) / (v·m) of the ideal time, (p - 1) / (v·m + p - 1) of the step, for v times more
  point-to-point traffic.
- 1F1B with split backwards (``zb_1f1b``; the split of Qi et al. 2024, "Zero Bubble
  Pipeline Parallelism"): every backward runs as its input gradient ("I", the paper's B),
  sent upstream at once, then its weight gradient ("W"). Bubble (p - 1)·(F + I) against
  1F1B's (p - 1)·(F + I + W), at 1F1B's memory; ``zb_interleaved_1f1b`` does the same to
  interleaved 1F1B.
- ZB-H1 (``zb_h1``, Qi et al. 2024): 1F1B with split backwards where rank r defers its
  weight halves by r microbatches, so the gradients travel up the pipeline sooner and the
  deferred W's fill the drain. Bubble (p - 1)·(F + I - W); every rank holds at most p
  microbatches, the peak 1F1B has on its first rank.
- DualPipeV (``dualpipev``; DeepSeek-AI's one-copy variant of DualPipe, DeepSeek-V3
  report section 3.2.1): two chunks per rank placed in a V (rank r holds virtual stages r
  and 2p - 1 - r, so rank 0 embeds and computes the loss, rank p - 1 turns the microbatch
  around without a transfer); the steady state pairs one chunk's forward with the other
  chunk's backward, and part of the backwards run split, their weight halves filling the
  cool-down. Needs m >= 2p. Bubble at most (p - 1)·(F + 2B - 3W) with per-chunk times
  (B = I + W; DualPipe's bound, its F&B = F + B without compute-communication overlap),
  against (p - 1)·(2F + 2B) for 1F1B over the same layers on p ranks; every rank holds
  up to 2p + 1 microbatch-chunks (p + 1/2 microbatches of its layers), where 1F1B's first
  rank holds p.

Here p = pp, m = num_microbatches, v = num_chunks, and every stage (every chunk, for v > 1)
takes the same time per microbatch, as the papers assume.

Pure functions: no process group, no tensors.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

__all__ = [
    "SCHEDULES",
    "SPLIT_BACKWARD_SCHEDULES",
    "Action",
    "ONE_CHUNK_SCHEDULES",
    "V_SHAPED_SCHEDULES",
    "check_schedule_args",
    "dualpipev",
    "forward_only",
    "gpipe",
    "interleaved_1f1b",
    "max_in_flight",
    "one_f_one_b",
    "splits_backward",
    "zero_bubble_1f1b",
    "zero_bubble_h1",
    "zero_bubble_interleaved_1f1b",
]


@dataclass(frozen=True)
class Action:
    """One step of a schedule: ``kind`` of ``microbatch`` through local ``chunk``
    (0 .. num_chunks-1; which virtual stage that is: `nanotrain.parallel.placement`). Kinds: "F"
    forward; "B" the whole backward; "I" the input-gradient half of a backward (what goes
    upstream) and "W" its weight-gradient half, which must follow the I of the same
    microbatch and chunk (`nanotrain.parallel.split_backward`)."""

    kind: str
    microbatch: int
    chunk: int = 0

    @property
    def sends_input_grad(self) -> bool:
        """Whether this action produces the gradient sent to the previous stage (B or I)."""
        return self.kind in ("B", "I")

    @property
    def frees_activations(self) -> bool:
        """Whether this action ends the microbatch-chunk's saved activations (B or W)."""
        return self.kind in ("B", "W")


def check_schedule_args(
    num_microbatches: int, pp_size: int, pp_rank: int, num_chunks: int = 1
) -> None:
    """Raise ValueError for sizes no schedule can run (naming the numbers and the fix)."""
    if num_microbatches < 1 or pp_size < 1 or num_chunks < 1:
        raise ValueError(
            f"need num_microbatches, pp and virtual_pp >= 1, got {num_microbatches}, "
            f"{pp_size}, {num_chunks}"
        )
    if not 0 <= pp_rank < pp_size:
        raise ValueError(f"pp_rank={pp_rank} is outside [0, {pp_size})")


def gpipe(num_microbatches: int, pp_size: int, pp_rank: int, num_chunks: int = 1) -> list[Action]:
    """All forwards, then all backwards (each chunk in pipeline order).

    GPipe's schedule (Huang et al. 2019): bubble (p - 1) / m of the ideal step time; holds
    every microbatch's activations (m · num_chunks microbatch-chunks) before the first
    backward. Chunks > 1 run GPipe over virtual stages.
    """
    check_schedule_args(num_microbatches, pp_size, pp_rank, num_chunks)
    chunks = range(num_chunks)
    forwards = [Action("F", m, c) for c in chunks for m in range(num_microbatches)]
    backwards = [Action("B", m, c) for c in reversed(chunks) for m in range(num_microbatches)]
    return forwards + backwards


def one_f_one_b(
    num_microbatches: int, pp_size: int, pp_rank: int, num_chunks: int = 1
) -> list[Action]:
    """Warm-up forwards, one-forward-one-backward steady state, cool-down backwards.

    PipeDream-Flush's 1F1B (Narayanan et al. 2021): ``min(pp - pp_rank - 1, m)`` warm-up
    forwards. The bubble is GPipe's, (p - 1) / m of the ideal step time, but a rank holds the
    activations of at most ``pp - pp_rank`` microbatches instead of m.

    Raises:
        ValueError: for num_chunks != 1 (use `interleaved_1f1b`).
    """
    check_schedule_args(num_microbatches, pp_size, pp_rank, num_chunks)
    if num_chunks != 1:
        raise ValueError(f"1F1B runs one chunk per rank, got virtual_pp={num_chunks}")
    m = num_microbatches
    warmup = min(pp_size - pp_rank - 1, m)
    actions = [Action("F", i) for i in range(warmup)]
    for i in range(m - warmup):
        actions += [Action("F", warmup + i), Action("B", i)]
    actions += [Action("B", i) for i in range(m - warmup, m)]
    return actions


def interleaved_1f1b(
    num_microbatches: int, pp_size: int, pp_rank: int, num_chunks: int = 2
) -> list[Action]:
    """Megatron's interleaved 1F1B over ``num_chunks`` virtual stages per rank.

    Narayanan et al. 2021 (section 2.2.2): with v = ``num_chunks`` the bubble is
    (p - 1) / (v·m) of the ideal step time, v times smaller than 1F1B's, for v times as many
    point-to-point transfers. Warm-up: ``(pp - pp_rank - 1)·2 + (v - 1)·pp`` forwards (capped
    at m·v; all of them when m == pp), as in Megatron-LM.

    Microbatches go through the chunks in groups of ``pp``: forward k (0 .. m·v-1) is
    microbatch ``(k // (pp·v))·pp + k % pp`` on chunk ``(k // pp) % v``; backward k the same
    microbatch on chunk ``v - 1 - (k // pp) % v``.

    Raises:
        ValueError: when num_microbatches is not a multiple of pp (the groups must be whole).
    """
    check_schedule_args(num_microbatches, pp_size, pp_rank, num_chunks)
    p, v, m = pp_size, num_chunks, num_microbatches
    if m % p != 0:
        raise ValueError(
            f"interleaved 1F1B needs the number of microbatches ({m}) to be a multiple of "
            f"pp={p}; use global_batch_size / micro_batch_size / dp = {max(p, m // p * p)} "
            "or virtual_pp=1"
        )

    def microbatch(k: int) -> int:
        return (k // (p * v)) * p + k % p

    def fwd(k: int) -> Action:
        return Action("F", microbatch(k), (k // p) % v)

    def bwd(k: int) -> Action:
        return Action("B", microbatch(k), v - 1 - (k // p) % v)

    total = m * v
    # as Megatron: with m == p the steady state has nothing to alternate
    warmup = total if m == p else min(total, (p - pp_rank - 1) * 2 + (v - 1) * p)
    actions = [fwd(k) for k in range(warmup)]
    for k in range(total - warmup):
        actions += [fwd(warmup + k), bwd(k)]
    actions += [bwd(k) for k in range(total - warmup, total)]
    return actions


def zero_bubble_1f1b(
    num_microbatches: int, pp_size: int, pp_rank: int, num_chunks: int = 1
) -> list[Action]:
    """1F1B with every backward split into its input half (I) and, right after it, its
    weight half (W).

    The gradient goes upstream as soon as I is done, so the chain of gradients through the
    cool-down moves by one I per stage instead of a whole backward: with equal F, I and W
    the step takes m·3F + (p - 1)·2F against 1F1B's m·3F + (p - 1)·3F, at 1F1B's memory
    (``pp - pp_rank`` microbatches in flight, each until its W). Qi et al. 2024's ZB-H1
    defers W's further, placed by measured times, for (p - 1)·F.

    Raises:
        ValueError: for num_chunks != 1.
    """
    check_schedule_args(num_microbatches, pp_size, pp_rank, num_chunks)
    if num_chunks != 1:
        raise ValueError(f"zb_1f1b runs one chunk per rank, got virtual_pp={num_chunks}")
    return _split_backwards(one_f_one_b(num_microbatches, pp_size, pp_rank))


def zero_bubble_h1(
    num_microbatches: int, pp_size: int, pp_rank: int, num_chunks: int = 1
) -> list[Action]:
    """ZB-H1 (Qi et al. 2024, "Zero Bubble Pipeline Parallelism"): 1F1B's forwards and input
    halves, with rank r's weight halves each run r microbatches late (in order), the ones
    still pending after the last input half at the end.

    The last rank's input halves then follow its forwards directly, so each gradient starts
    up the pipeline one weight half sooner per stage; the deferred weight halves fill the
    drain, where a rank would wait for the next gradient. Bubble (p - 1)·(F + I - W) against
    `zero_bubble_1f1b`'s (p - 1)·(F + I); a rank holds at most p microbatches (until their W),
    1F1B's peak on its first rank.

    Raises:
        ValueError: for num_chunks != 1.
    """
    check_schedule_args(num_microbatches, pp_size, pp_rank, num_chunks)
    if num_chunks != 1:
        raise ValueError(f"zb_h1 runs one chunk per rank, got virtual_pp={num_chunks}")
    m, delay = num_microbatches, pp_rank
    warmup = min(pp_size - pp_rank - 1, m)
    actions = [Action("F", i) for i in range(warmup)]
    pending: list[Action] = []

    def backward(i: int) -> None:
        actions.append(Action("I", i))
        pending.append(Action("W", i))
        if len(pending) > delay:
            actions.append(pending.pop(0))

    for i in range(m - warmup):
        actions.append(Action("F", warmup + i))
        backward(i)
    for i in range(m - warmup, m):
        backward(i)
    return actions + pending


def zero_bubble_interleaved_1f1b(
    num_microbatches: int, pp_size: int, pp_rank: int, num_chunks: int = 2
) -> list[Action]:
    """Interleaved 1F1B with every backward split into its input half (I) and, right after
    it, its weight half (W), as `zero_bubble_1f1b` does for 1F1B: the interleaved bubble,
    (p - 1)·(F + I + W)/v, loses its W part, at interleaved 1F1B's memory.

    Raises:
        ValueError: as `interleaved_1f1b`.
    """
    return _split_backwards(interleaved_1f1b(num_microbatches, pp_size, pp_rank, num_chunks))


def _split_backwards(actions: list[Action]) -> list[Action]:
    """`actions` with each B replaced by its I followed by its W."""
    out = []
    for a in actions:
        if a.kind == "B":
            out += [Action("I", a.microbatch, a.chunk), Action("W", a.microbatch, a.chunk)]
        else:
            out.append(a)
    return out


def dualpipev(
    num_microbatches: int, pp_size: int, pp_rank: int, num_chunks: int = 2
) -> list[Action]:
    """DualPipeV: two chunks per rank in a V, forward and backward chunks paired.

    Chunk 0 of rank r is virtual stage r (microbatches go down the ranks), chunk 1 is stage
    2p - 1 - r (they come back up; rank p - 1 passes chunk 0's output to its own chunk 1).
    Per rank, in order (r = pp_rank, p = pp, m = num_microbatches; F0/F1 a forward of chunk
    0/1, B a whole backward, I an input half whose W goes to a queue, W the oldest queued
    weight half; each kind of each chunk takes the microbatches in order):

    1. 2·(p - r - 1) × F0: fill the pipe down to the turn;
    2. (r + 1) × (F0, F1): the first microbatches turn and start back up;
    3. (p - r - 1) × (I1, W, F1): the first backwards, their weight halves at once;
    4. (m - 2p + r + 1) × (F0, B1, F1, B0): the steady state, a forward of one chunk beside
       a backward of the other (the pairs whose communication can hide behind compute);
    5. (p - r - 1) × (B1, F1, B0): the last forwards of chunk 1;
    6. (r + 1) × (B1, B0), the second half of them split (I, W queued): chunk 1 drains;
    7. (p - r - 1) × (W, I0): queued weight halves fill the waits for chunk 0's gradients;
    8. (r + 1) × W: the queue empties.

    The order is DualPipe's (deepseek-ai/DualPipe, ``DualPipeV.step``), written as actions.

    Raises:
        ValueError: for num_chunks != 2, or fewer than 2·pp microbatches.
    """
    check_schedule_args(num_microbatches, pp_size, pp_rank, num_chunks)
    p, r, m = pp_size, pp_rank, num_microbatches
    if num_chunks != 2:
        raise ValueError(f"dualpipev runs two chunks per rank (a V), got virtual_pp={num_chunks}")
    if m < 2 * p:
        raise ValueError(
            f"dualpipev needs at least 2*pp={2 * p} microbatches per step, got {m}; raise "
            "global_batch_size or lower micro_batch_size (microbatches = global_batch_size / "
            "micro_batch_size / dp), or pick another schedule"
        )
    actions: list[Action] = []
    forwards, backwards = [0, 0], [0, 0]
    queued: list[Action] = []

    def f(chunk: int) -> None:
        actions.append(Action("F", forwards[chunk], chunk))
        forwards[chunk] += 1

    def b(chunk: int, split: bool = False) -> None:
        mb = backwards[chunk]
        backwards[chunk] += 1
        actions.append(Action("I" if split else "B", mb, chunk))
        if split:
            queued.append(Action("W", mb, chunk))

    def w() -> None:
        actions.append(queued.pop(0))

    for _ in range(2 * (p - r - 1)):
        f(0)
    for _ in range(r + 1):
        f(0)
        f(1)
    for _ in range(p - r - 1):
        b(1, split=True)
        w()
        f(1)
    for _ in range(m - 2 * p + r + 1):
        f(0)
        b(1)
        f(1)
        b(0)
    for _ in range(p - r - 1):
        b(1)
        f(1)
        b(0)
    # the later half of the drain splits its backwards (odd ranks from a chunk-1 one, even
    # ranks from the chunk-0 one after it): r + 1 weight halves for step 8
    half = (r + 1) // 2
    for i in range(r + 1):
        b(1, split=i > half or (i == half and r % 2 == 1))
        b(0, split=i >= half)
    for _ in range(p - r - 1):
        w()
        b(0, split=True)
    for _ in range(r + 1):
        w()
    return actions


def forward_only(
    num_microbatches: int, pp_size: int, pp_rank: int, num_chunks: int = 1
) -> list[Action]:
    """Forwards only (validation): each microbatch through every local chunk in order."""
    check_schedule_args(num_microbatches, pp_size, pp_rank, num_chunks)
    return [Action("F", m, c) for m in range(num_microbatches) for c in range(num_chunks)]


def max_in_flight(actions: list[Action]) -> int:
    """Most (microbatch, chunk) forwards whose saved activations are still held (their B, or
    W after a split backward, has not run yet), at any point."""
    live = peak = 0
    for action in actions:
        live += 1 if action.kind == "F" else -int(action.frees_activations)
        peak = max(peak, live)
    return peak


#: schedules that run backwards as input and weight halves (I and W actions)
SPLIT_BACKWARD_SCHEDULES = frozenset({"zb_1f1b", "zb_h1", "zb_interleaved_1f1b", "dualpipev"})


def splits_backward(schedule: str, pp: int) -> bool:
    """Whether a pipeline of `pp` stages under `schedule` runs each backward as separate input
    and weight halves (a split-backward schedule with more than one stage)."""
    return pp > 1 and schedule in SPLIT_BACKWARD_SCHEDULES


#: schedules that run one chunk per rank
ONE_CHUNK_SCHEDULES = frozenset({"1f1b", "zb_1f1b", "zb_h1"})

#: schedules whose two chunks per rank sit in a V (`nanotrain.parallel.placement`)
V_SHAPED_SCHEDULES = frozenset({"dualpipev"})

#: name -> schedule function (the strategy's ``schedule`` argument).
SCHEDULES: dict[str, Callable[..., list[Action]]] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "interleaved_1f1b": interleaved_1f1b,
    "zb_1f1b": zero_bubble_1f1b,
    "zb_h1": zero_bubble_h1,
    "zb_interleaved_1f1b": zero_bubble_interleaved_1f1b,
    "dualpipev": dualpipev,
}
