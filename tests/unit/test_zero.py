"""Flat layouts, gradient buckets, the sharded optimizer and the grad norm, in one process."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from nanotrain.parallel.data_parallel import (
    FlatLayout,
    GradBuckets,
    GradBucketSets,
    backward_order,
)
from nanotrain.parallel.grads import clip_grads_, reduced_square_norms
from nanotrain.parallel.zero import ZeroOptimizer, state_bytes


def _params(*shapes: tuple[int, ...]) -> list[nn.Parameter]:
    return [nn.Parameter(torch.randn(*s)) for s in shapes]


def test_layout_offsets_and_buckets_padded_to_dp():
    # sizes 6, 4, 5 with buckets closed at >= 8 elements and dp=4:
    # bucket 0 = params 0,1 (10 elements -> padded to 12), bucket 1 = param 2 (5 -> 8)
    layout = FlatLayout(_params((2, 3), (4,), (5,)), dp_size=4, bucket_numel=8)
    assert layout.offsets == [0, 6, 12]
    assert [(b.start, b.end, b.param_indices) for b in layout.buckets] == [
        (0, 12, (0, 1)),
        (12, 20, (2,)),
    ]
    assert layout.numel == 20 and layout.shard_numel == 5
    assert layout.buckets[1].owned(3, 4) == (18, 20)


def test_pieces_of_all_ranks_cover_every_element_once():
    layout = FlatLayout(_params((3, 5), (7,), (2, 2), (11,)), dp_size=3, bucket_numel=10)
    seen = {i: torch.zeros(p.numel(), dtype=torch.int64) for i, p in enumerate(layout.params)}
    for rank in range(3):
        pieces = layout.pieces(rank)
        # each rank's pieces fit in its shard buffer without overlapping
        ends = sorted((pc.shard_start, pc.shard_start + pc.numel) for pc in pieces)
        assert all(a[1] <= b[0] for a, b in zip(ends, ends[1:], strict=False))
        assert ends[-1][1] <= layout.shard_numel
        for pc in pieces:
            seen[pc.param_index][pc.param_start : pc.param_start + pc.numel] += 1
    assert all(bool((count == 1).all()) for count in seen.values())


def test_grads_are_views_of_the_buffer_and_buckets_launch_during_backward():
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    layout = FlatLayout(backward_order(model), dp_size=1, bucket_numel=10)
    grads = GradBuckets(layout, group=None)
    x = torch.randn(3, 4)
    grads.set_sync(False)  # an accumulation microbatch: nothing is launched
    model(x).sum().backward()
    assert grads._next_bucket == 0
    grads.set_sync(True)  # the last microbatch: every bucket launches from the hooks
    model(x).sum().backward()
    assert grads._next_bucket == len(layout.buckets) > 1
    grads.finish()
    expected = copy.deepcopy(model)
    for p in expected.parameters():
        p.grad = None
    expected(x).sum().mul(2).backward()  # two microbatches accumulated
    assert grads.buffer is not None
    for p, q in zip(model.parameters(), expected.parameters(), strict=True):
        assert p.grad.untyped_storage().data_ptr() == grads.buffer.untyped_storage().data_ptr()
        torch.testing.assert_close(p.grad, q.grad)


def _zero_step(opt_cls, **kw) -> tuple[nn.Module, nn.Module, ZeroOptimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Linear(7, 3))
    reference = copy.deepcopy(model)
    layout = FlatLayout(backward_order(model), dp_size=1, bucket_numel=16)
    grads = GradBuckets(layout, group=None)
    groups = lambda m: [  # noqa: E731 - decay on matrices only, as LanguageModelModule does
        {"params": [p for p in m.parameters() if p.ndim == 2], "weight_decay": 0.1},
        {"params": [p for p in m.parameters() if p.ndim == 1], "weight_decay": 0.0},
    ]
    zero = ZeroOptimizer(opt_cls(groups(model), **kw), grads, stage=1)
    ref_opt = opt_cls(groups(reference), **kw)
    for _ in range(3):
        x = torch.randn(4, 5)
        grads.set_sync(True)
        model(x).pow(2).sum().backward()
        grads.finish()
        zero.step()
        grads.zero_()
        reference(x).pow(2).sum().backward()
        ref_opt.step()
        ref_opt.zero_grad()
    return model, reference, zero


@pytest.mark.parametrize(
    ("opt_cls", "kw"),
    [
        (torch.optim.AdamW, {"lr": 0.01}),
        (torch.optim.AdamW, {"lr": 0.01, "fused": True}),  # one kernel over the flat pieces
        (torch.optim.AdamW, {"lr": 0.01, "foreach": True}),
        (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
    ],
)
def test_sharded_optimizer_updates_like_the_whole_one(opt_cls, kw):
    model, reference, zero = _zero_step(opt_cls, **kw)
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
    # parameters stay views of the flat buffer the optimizer updates
    for p in model.parameters():
        assert p.untyped_storage().data_ptr() == zero.flat_params[0].untyped_storage().data_ptr()


def test_sharded_optimizer_state_is_as_large_as_the_whole_ones_at_dp1():
    model, reference, zero = _zero_step(torch.optim.AdamW, lr=0.01)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=0.01)
    reference(torch.randn(2, 5)).sum().backward()
    ref_opt.step()
    # same moments; step counters: one per piece vs one per parameter (here the same count)
    assert zero.state_bytes() == state_bytes(ref_opt)


def test_non_elementwise_optimizer_is_refused():
    model = nn.Linear(3, 3)
    layout = FlatLayout(backward_order(model), dp_size=1, bucket_numel=8)
    grads = GradBuckets(layout, group=None)
    with pytest.raises(TypeError, match="elementwise.*LBFGS.*zero_stage=0"):
        ZeroOptimizer(torch.optim.LBFGS(model.parameters()), grads, stage=1)


def test_optimizer_over_foreign_tensors_is_refused():
    model = nn.Linear(3, 3)
    layout = FlatLayout(backward_order(model), dp_size=1, bucket_numel=8)
    grads = GradBuckets(layout, group=None)
    stray = nn.Parameter(torch.zeros(2))
    with pytest.raises(ValueError, match="not a trainable parameter"):
        ZeroOptimizer(torch.optim.SGD([stray], lr=0.1), grads, stage=2)


def test_mixed_dtypes_are_refused_with_the_fix():
    params = [nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(2, dtype=torch.float64))]
    with pytest.raises(TypeError, match="one dtype"):
        GradBuckets(FlatLayout(params, 1, 8), group=None)


def test_grad_norm_and_clipping_match_torch():
    grads = [torch.randn(3, 4), torch.randn(5), torch.randn(2, 2)]
    expected = [g.clone() for g in grads]
    norms = torch.stack([g.norm() for g in grads])
    params = [nn.Parameter(torch.zeros_like(g)) for g in expected]
    for p, g in zip(params, expected, strict=True):
        p.grad = g
    torch_norm = torch.nn.utils.clip_grad_norm_(params, max_norm=0.5)
    # grad 1 arrives in two pieces; without process groups every grad counts once
    owned = [(0, grads[0]), (1, grads[1][:2]), (1, grads[1][2:]), (2, grads[2])]
    sq = reduced_square_norms(
        owned, 3, [True, False, False], count_replicated=True, groups=[], device=torch.device("cpu")
    )
    torch.testing.assert_close(sq.sqrt().float(), norms)
    norm = sq.sum().sqrt().float()
    torch.testing.assert_close(norm, torch_norm)
    # on a tp rank other than 0 replicated grads are left to rank 0
    sq_other = reduced_square_norms(
        owned,
        3,
        [True, False, False],
        count_replicated=False,
        groups=[],
        device=torch.device("cpu"),
    )
    assert sq_other[0] == sq[0] and sq_other[1] == 0 and sq_other[2] == 0
    clip_grads_(grads, norm, 0.5)
    for g, p in zip(grads, params, strict=True):
        torch.testing.assert_close(g, p.grad)


def test_divisor_scales_the_reduced_gradient_even_without_a_group():
    # expert weights: summed over a group of one but divided by the whole dp size (here 4)
    model = nn.Linear(3, 2)
    grads = GradBuckets(FlatLayout(backward_order(model), 1, 8), group=None, divisor=4)
    x = torch.randn(5, 3)
    grads.set_sync(True)
    model(x).sum().backward()
    grads.finish()
    expected = copy.deepcopy(model)
    for p in expected.parameters():
        p.grad = None
    expected(x).sum().backward()
    for p, q in zip(model.parameters(), expected.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad / 4)


def test_layout_padded_for_another_group_size_is_refused():
    with pytest.raises(ValueError, match="padded for 2 ranks but the group has 1"):
        GradBuckets(FlatLayout(_params((4,)), 2, 8), group=None)


def test_two_bucket_sets_number_params_in_order_and_shard_the_optimizer_as_one():
    # "dense" = the first Linear, "expert" = the second, as MegatronStrategy splits them
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))
    reference = copy.deepcopy(model)
    dense, expert = (
        GradBuckets(FlatLayout(backward_order(m), 1, 16), group=None, reduce_scatter=True)
        for m in (model[0], model[2])
    )
    sets = GradBucketSets([dense, expert])
    assert sets.offset(1) == 2 and len(sets.params) == 4
    assert sets.params[2] is model[2].bias  # backward order within each set
    zero = ZeroOptimizer(torch.optim.AdamW(model.parameters(), lr=0.01), sets, stage=2)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=0.01)
    for _ in range(3):
        x = torch.randn(4, 5)
        sets.attach()
        sets.set_sync(True)
        model(x).pow(2).sum().backward()
        sets.finish()
        sets.release()
        # every piece of set 1 is numbered after set 0's parameters
        assert {i for i, _ in zero.owned_grads(1)} == {2, 3}
        assert {i for i, _ in zero.owned_grads()} == {0, 1, 2, 3}
        zero.step()
        sets.zero_()
        reference(x).pow(2).sum().backward()
        ref_opt.step()
        ref_opt.zero_grad()
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
    assert len(zero.flat_params) == 2
    with pytest.raises(ValueError, match="appears in two"):
        GradBucketSets([dense, dense])
