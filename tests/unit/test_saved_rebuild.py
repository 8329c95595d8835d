"""`nanotrain.parallel.saved_rebuild`: tracked tensors are saved as recipes and rebuilt in
backward, once per recipe, bitwise; what the region does not track, and the recipes' inputs,
still reach the enclosing hooks; the region stands aside where it must."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from nanotrain.parallel.saved_rebuild import RebuiltSaves, cast_in_region


class _Seen:
    """Enclosing saved-tensor hooks: the storages handed to them (each once)."""

    def __init__(self) -> None:
        self.storages: set[int] = set()
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        self.storages.add(t.untyped_storage().data_ptr())
        return t


def _swiglu(x, w_gate, w_up, w_down, rebuild=None, calls=None):
    """down(silu(gate) * up) with silu(gate) and the product tracked (recipe `rebuild`,
    counted in `calls`), or untracked when `rebuild` is None."""
    gate, up = x @ w_gate, x @ w_up
    if rebuild is None:
        return (F.silu(gate) * up) @ w_down

    def recipe(g, u):
        calls.append(1)
        return rebuild(g, u)

    with RebuiltSaves() as saves:
        act = saves.track(F.silu(gate), F.silu, gate)
        product = saves.track(act * up, recipe, gate, up)
        return product @ w_down, act, product


def _grads(fn):
    torch.manual_seed(0)
    x = torch.randn(6, 8, requires_grad=True)
    weights = [torch.randn(8, 5, requires_grad=True), torch.randn(8, 5, requires_grad=True)]
    weights.append(torch.randn(5, 8, requires_grad=True))
    out = fn(x, *weights)
    y = out[0] if isinstance(out, tuple) else out
    y.square().sum().backward()
    return [t.grad for t in (x, *weights)], out


def test_tracked_tensors_are_rebuilt_once_per_recipe_and_give_the_same_grads():
    plain, _ = _grads(_swiglu)
    calls = []
    rebuilt, (_, act, product) = _grads(
        lambda *a: _swiglu(*a, rebuild=lambda g, u: F.silu(g) * u, calls=calls)
    )
    for a, b in zip(plain, rebuilt, strict=True):
        assert torch.equal(a, b)
    assert calls == [1]  # the product's one save (by the matmul) rebuilt once


def test_saved_copies_come_from_the_recipe():
    # the mutation check: a recipe that rebuilds other values changes the gradients, so the
    # product the down matmul saved was not kept but rebuilt
    plain, _ = _grads(_swiglu)
    wrong, _ = _grads(lambda *a: _swiglu(*a, rebuild=lambda g, u: F.silu(g) * u + 1, calls=[]))
    assert not torch.equal(plain[3], wrong[3])  # w_down's gradient reads the product


def test_the_region_keeps_tracked_storages_from_the_enclosing_hooks():
    seen = _Seen()
    with seen.hooks:
        _, (_, act, product) = _grads(
            lambda *a: _swiglu(*a, rebuild=lambda g, u: F.silu(g) * u, calls=[])
        )
    assert act.untyped_storage().data_ptr() not in seen.storages
    assert product.untyped_storage().data_ptr() not in seen.storages
    assert len(seen.storages) > 0  # gate, up, x and the weights still went through them


def test_casts_made_in_the_region_are_rebuilt_bitwise_under_autocast():
    torch.manual_seed(0)
    h = torch.randn(4, 8, requires_grad=True)
    w = torch.randn(3, 8, requires_grad=True)

    def run(track):
        calls = []
        with torch.autocast("cpu", dtype=torch.bfloat16), RebuiltSaves() as saves:
            y = h * 2
            if track:
                saves.track(y, lambda a: (calls.append(1), a * 2)[1], h)
            out = F.linear(cast_in_region(y), w)  # saves y's bf16 cast
        out.float().square().sum().backward()
        grads = (h.grad.clone(), w.grad.clone())
        h.grad = w.grad = None
        return grads, calls

    plain, _ = run(track=False)
    rebuilt, calls = run(track=True)
    assert calls == [1]
    for a, b in zip(plain, rebuilt, strict=True):
        assert torch.equal(a, b)


def test_a_second_backward_rebuilds_again():
    torch.manual_seed(0)
    x = torch.randn(5, 4, requires_grad=True)
    calls = []
    with RebuiltSaves() as saves:
        y = saves.track(x.exp(), lambda a: (calls.append(1), a.exp())[1], x)
        z = (y * y).sum()
    (g1,) = torch.autograd.grad(z, x, retain_graph=True)
    assert calls == [1]  # exp's and the product's three saves from one rebuild
    (g2,) = torch.autograd.grad(z, x)  # the first backward released it: made again
    assert torch.equal(g1, g2) and torch.equal(g1, 2 * x.exp() * x.exp())
    assert len(calls) > 1


@pytest.mark.parametrize("where", ["no_grad", "checkpoint"])
def test_the_region_stands_aside_without_grad_and_inside_a_checkpoint(where):
    x = torch.randn(3, 3, requires_grad=True)

    def body(a):
        with RebuiltSaves() as saves:
            assert not saves.active
            y = saves.track(a.exp(), lambda t: pytest.fail("rebuilt"), a)
            return (y * y).sum()

    if where == "no_grad":
        with torch.no_grad():
            body(x)
    else:
        checkpoint(body, x, use_reentrant=False).backward()
        assert torch.allclose(x.grad, 2 * x.exp() * x.exp())


def test_two_tracked_tensors_on_one_storage_are_both_kept_as_they_are():
    x = torch.randn(4, 6, requires_grad=True)
    with RebuiltSaves() as saves:
        both = x.exp()
        left, right = both[:, :3], both[:, 3:]
        saves.track(left, lambda a: pytest.fail("rebuilt"), x)
        saves.track(right, lambda a: pytest.fail("rebuilt"), x)
        z = (left * right).sum()  # saves both views: kept, not rebuilt
    z.backward()
    e = x.detach().exp()
    expected = torch.cat([e[:, :3] * e[:, 3:], e[:, 3:] * e[:, :3]], 1)
    assert torch.allclose(x.grad, expected)
