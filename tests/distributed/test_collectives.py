"""Each autograd collective matches its single-process meaning, forward and backward.

Reference: one process holds every rank's input, builds what each rank's output *means* with
plain tensor ops (identity, sum, cat, chunk) and differentiates a loss with torch.autograd.
Each rank then runs the collective on its own input with the same per-rank loss weights and
must reproduce its output and its input's gradient.

Replicated outputs (after an all-reduce or an all-gather of the last dim) stand for ONE
tensor, so their loss is counted once with the same weights on every rank; outputs that differ
per rank add one loss term per rank.
"""

from __future__ import annotations

import multiprocessing
import os
import zlib
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist

from nanotrain.parallel import collectives as C
from tests.distributed.spawn import RankError, run_world

Tensors = list[torch.Tensor]


@dataclass(frozen=True)
class Case:
    """One collective and the single-process function of all ranks' inputs it stands for."""

    name: str
    op: Callable[[torch.Tensor, object], torch.Tensor]
    reference: Callable[[Tensors, int], Tensors]  # inputs of all ranks -> output of each rank
    shared_input: bool  # every rank holds the same input tensor (a replicated activation)
    replicated_output: bool  # every rank's output is the same tensor
    input_shape: Callable[[int], tuple[int, ...]]  # world size -> this rank's input shape


B, S, H = 2, 4, 8  # S and H divisible by every world size tested (2 and 4)


def _full(tp: int) -> tuple[int, ...]:
    return (B, S, H)


CASES = [
    Case("copy_to_tp", C.copy_to_tensor_parallel_region,
         lambda xs, tp: list(xs), True, False, _full),
    Case("reduce_from_tp", C.reduce_from_tensor_parallel_region,
         lambda xs, tp: [sum(xs)] * tp, False, True, _full),
    Case("scatter_to_tp", C.scatter_to_tensor_parallel_region,
         lambda xs, tp: [x.chunk(tp, -1)[r] for r, x in enumerate(xs)], True, False, _full),
    Case("gather_from_tp", C.gather_from_tensor_parallel_region,
         lambda xs, tp: [torch.cat(xs, -1)] * tp, False, True, lambda tp: (B, S, H // tp)),
    Case("scatter_to_sp", C.scatter_to_sequence_parallel_region,
         lambda xs, tp: [x.chunk(tp, 1)[r] for r, x in enumerate(xs)], True, False, _full),
    # All-gathered along the sequence, then each rank computes something different with it
    # (its own weight shard): one loss term per rank, so the grads are reduce-scattered.
    Case("gather_from_sp", C.gather_from_sequence_parallel_region,
         lambda xs, tp: [torch.cat(xs, 1)] * tp, False, False, lambda tp: (B, S // tp, H)),
    Case("reduce_scatter_to_sp", C.reduce_scatter_to_sequence_parallel_region,
         lambda xs, tp: [sum(xs).chunk(tp, 1)[r] for r in range(tp)], False, False, _full),
]  # fmt: skip


def _inputs(case: Case, tp: int) -> Tensors:
    gen = torch.Generator().manual_seed(zlib.crc32(case.name.encode()))
    if case.shared_input:
        x = torch.randn(case.input_shape(tp), generator=gen, dtype=torch.float64)
        return [x] * tp
    return [
        torch.randn(case.input_shape(tp), generator=gen, dtype=torch.float64) for _ in range(tp)
    ]


def _loss_weights(outputs: Tensors, replicated: bool) -> Tensors:
    gen = torch.Generator().manual_seed(1234)
    if replicated:
        return [torch.randn(outputs[0].shape, generator=gen, dtype=torch.float64)] * len(outputs)
    return [torch.randn(o.shape, generator=gen, dtype=torch.float64) for o in outputs]


def _reference(case: Case, tp: int) -> tuple[Tensors, Tensors, Tensors]:
    """(per-rank outputs, per-rank loss weights, per-rank input grads) in one process."""
    inputs = _inputs(case, tp)
    leaves = [x.clone().requires_grad_() for x in inputs]
    if case.shared_input:
        leaves = [leaves[0]] * tp  # one tensor: its grad accumulates every rank's use
    outputs = case.reference(leaves, tp)
    weights = _loss_weights(outputs, case.replicated_output)
    terms = [(o * w).sum() for o, w in zip(outputs, weights, strict=True)]
    loss = terms[0] if case.replicated_output else sum(terms)
    loss.backward()
    return [o.detach() for o in outputs], weights, [leaf.grad for leaf in leaves]


def _check_case(case: Case, rank: int, tp: int) -> None:
    expected_out, weights, expected_grad = _reference(case, tp)
    x = _inputs(case, tp)[rank].clone().requires_grad_()
    before = x.detach().clone()
    out = case.op(x, dist.group.WORLD)
    torch.testing.assert_close(out, expected_out[rank], rtol=1e-12, atol=0, msg=case.name)
    (out * weights[rank]).sum().backward()
    torch.testing.assert_close(x.grad, expected_grad[rank], rtol=1e-12, atol=0, msg=case.name)
    torch.testing.assert_close(x.detach(), before, rtol=0, atol=0, msg=f"{case.name} mutated x")


def _check_size_one_groups_are_no_ops(rank: int, tp: int) -> None:
    # new_group is collective: every rank creates every singleton group, keeps its own.
    singles = [dist.new_group([r]) for r in range(tp)]
    x = torch.randn(B, S, H, requires_grad=True)
    for case in CASES:
        assert case.op(x, singles[rank]) is x, case.name


def _check_other_seq_dim(rank: int, tp: int) -> None:
    # Megatron's [seq, batch, hidden] layout: the sequence is dim 0.
    x = torch.arange(S * B * H, dtype=torch.float64).view(S, B, H)
    gathered = C.gather_from_sequence_parallel_region(x.chunk(tp, 0)[rank], None, seq_dim=0)
    assert gathered.shape == (S // tp, B, H)  # group None: untouched
    gathered = C.gather_from_sequence_parallel_region(
        x.chunk(tp, 0)[rank], dist.group.WORLD, seq_dim=0
    )
    torch.testing.assert_close(gathered, x)
    local = C.reduce_scatter_to_sequence_parallel_region(x, dist.group.WORLD, seq_dim=0)
    torch.testing.assert_close(local, tp * x.chunk(tp, 0)[rank])


def _check_indivisible_split_raises(rank: int, tp: int) -> None:
    odd = torch.zeros(B, tp + 1, H)
    for fn in (C.scatter_to_sequence_parallel_region, C.reduce_scatter_to_sequence_parallel_region):
        try:
            fn(odd, dist.group.WORLD)
        except ValueError as err:
            assert f"{tp + 1} is not divisible by {tp}" in str(err)
        else:
            raise AssertionError(f"{fn.__name__} accepted a dim of {tp + 1} over {tp} ranks")


def _world_checks(rank: int, world_size: int) -> list[str]:
    torch.manual_seed(0)  # same on every rank: _check_size_one_groups_are_no_ops draws
    for case in CASES:
        _check_case(case, rank, world_size)
    _check_size_one_groups_are_no_ops(rank, world_size)
    _check_other_seq_dim(rank, world_size)
    _check_indivisible_split_raises(rank, world_size)
    return [case.name for case in CASES]


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [2, 4])
def test_collectives_match_single_process_forward_and_backward(world_size: int) -> None:
    results = run_world(_world_checks, world_size)
    assert results == [[case.name for case in CASES]] * world_size


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_collectives_are_identity_without_a_group(case: Case) -> None:
    x = torch.randn(case.input_shape(1), requires_grad=True)
    assert case.op(x, None) is x
    assert C.group_size(None) == 1 and C.group_rank(None) == 0


# --------------------------------------------------------------------------------------------
# The harness every distributed test relies on: failures surface fast, nothing is left behind
# --------------------------------------------------------------------------------------------


def _rank_one_raises(rank: int, world_size: int) -> None:
    if rank == 1:
        raise ValueError("boom from rank 1")
    dist.all_reduce(torch.ones(1))  # rank 0 waits on a peer that is gone


def _rank_one_exits(rank: int, world_size: int) -> None:
    if rank == 1:
        os._exit(3)
    dist.all_reduce(torch.ones(1))


def _both_wait_forever(rank: int, world_size: int) -> None:
    dist.recv(torch.empty(1), src=1 - rank)  # nobody sends: blocks until killed


@pytest.mark.distributed
def test_harness_reports_the_failing_ranks_traceback_and_leaves_no_process() -> None:
    with pytest.raises(RankError, match=r"(?s)rank 1 of 2:.*ValueError: boom from rank 1"):
        run_world(_rank_one_raises, 2)
    with pytest.raises(RankError, match=r"rank 1 of 2: died without a result \(exit code 3\)"):
        run_world(_rank_one_exits, 2)
    assert multiprocessing.active_children() == []


@pytest.mark.distributed
def test_harness_kills_ranks_that_exceed_the_timeout() -> None:
    with pytest.raises(RankError, match=r"ranks \[0, 1\] of 2 gave no result within 0.5s"):
        run_world(_both_wait_forever, 2, timeout=0.5)
    assert multiprocessing.active_children() == []
