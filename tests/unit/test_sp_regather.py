"""`nanotrain.parallel.sp_regather` in one process: a stand-in two-rank group whose all-gather
appends a fixed other half. Layers reading the gathered input inside the region give the same
gradients as without it, while autograd keeps only the shard; views and autocast's casts of
the gathered input are rebuilt bitwise; other saved-tensor hooks still see what is saved."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from nanotrain.parallel import sp_regather
from nanotrain.parallel.sp_regather import RegatheredInput, cast_in_region


class _Pair:
    """Stands for a two-rank group (only its size is asked)."""

    def size(self) -> int:
        return 2


@pytest.fixture
def other_half(monkeypatch):
    """The other rank's half of the sequence; the region's all-gather appends it."""
    half = torch.randn(2, 3, 8)
    gathers = []

    def gather(x, dim, group):
        gathers.append(x.shape)
        return torch.cat([x, half], dim)

    monkeypatch.setattr(sp_regather, "all_gather_along_dim", gather)
    return half, gathers


class _Counter:
    """Outer saved-tensor hooks: the storages autograd keeps, counted once each."""

    def __init__(self) -> None:
        self.bytes: dict[int, int] = {}

    def hooks(self):
        def pack(t):
            self.bytes.setdefault(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
            return t

        return torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)


def _block(shard, half, weights, autocast, region):
    """Three column layers reading the gathered input (the second through a view); the sum
    of their outputs' squares."""
    full = torch.cat([shard, half], 1)
    counter = _Counter()
    with counter.hooks(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        ctx = RegatheredInput(full, shard, _Pair(), 1) if region else _NoRegion()
        with ctx:
            outs = [F.linear(cast_in_region(full), weights[0])]
            outs.append(F.linear(cast_in_region(full[:, 1:]), weights[1]))
            outs.append(F.linear(cast_in_region(full), weights[2]))
    loss = sum(o.float().pow(2).sum() for o in outs)
    return loss, sum(counter.bytes.values())


class _NoRegion:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None


@pytest.mark.parametrize("autocast", [False, True])
def test_layers_in_the_region_keep_the_shard_and_get_the_same_gradients(other_half, autocast):
    half, gathers = other_half
    torch.manual_seed(0)
    weights = [torch.randn(5, 8, requires_grad=True) for _ in range(3)]
    shard = torch.randn(2, 3, 8, requires_grad=True)
    grads = {}
    kept = {}
    for region in (False, True):
        for w in weights:
            w.grad = None
        shard.grad = None
        loss, kept[region] = _block(shard, half, weights, autocast, region)
        loss.backward()
        grads[region] = [shard.grad.clone(), *(w.grad.clone() for w in weights)]
    for a, b in zip(grads[False], grads[True], strict=True):
        assert torch.equal(a, b)
    # the whole fp32 input (or, under autocast, its three bf16 copies: [2, 6, 8] twice and
    # the view's [2, 5, 8]) against one fp32 shard [2, 3, 8]
    saved_whole = (2 * 6 * 8 + 2 * 5 * 8 + 2 * 6 * 8) * 2 if autocast else 2 * 6 * 8 * 4
    assert kept[False] - kept[True] == saved_whole - 2 * 3 * 8 * 4
    assert gathers == [torch.Size([2, 3, 8])]  # one all-gather in backward for the three


def test_a_recomputed_region_and_a_closed_region_do_nothing(other_half):
    half, gathers = other_half
    shard = torch.randn(2, 3, 8, requires_grad=True)
    w = torch.randn(5, 8, requires_grad=True)
    full = torch.cat([shard, half], 1)

    def inside(x):
        with RegatheredInput(full, shard, _Pair(), 1):
            return F.linear(cast_in_region(x), w)

    y = torch.utils.checkpoint.checkpoint(inside, full, use_reentrant=False)
    y.sum().backward()
    assert gathers == []  # the checkpoint's rerun saved what it needed
    with torch.no_grad(), RegatheredInput(full, shard, _Pair(), 1):
        assert cast_in_region(full) is full  # no gradient: no region
