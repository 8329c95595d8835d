"""`nanotrain.models.lazy`: lazy views read exactly what eager indexing gives, and nothing
is read until asked."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from safetensors.torch import save_file

from nanotrain.models.lazy import concat, open_safetensors, stack


@pytest.fixture
def stored(tmp_path) -> tuple[dict[str, torch.Tensor], dict]:
    g = torch.Generator().manual_seed(0)
    tensors = {"x": torch.randn(6, 4, 5, generator=g), "y": torch.randn(3, 4, 5, generator=g)}
    save_file(tensors, tmp_path / "t.safetensors")
    return tensors, open_safetensors(tmp_path / "t.safetensors")


def test_views_read_what_eager_indexing_gives(stored):
    eager, lazy = stored
    x, y = eager["x"], eager["y"]
    lx, ly = lazy["x"], lazy["y"]
    assert lx.shape == x.shape and lx.dtype == x.dtype
    assert torch.equal(lx.read(), x)
    assert torch.equal(lx[2:5].read(), x[2:5])
    assert torch.equal(lx[4].read(), x[4])
    assert torch.equal(lx.chunk(2, dim=1)[1].read(), x.chunk(2, dim=1)[1])
    assert torch.equal(lx.unbind(2)[3].narrow(0, 1, 2).read(), x[1:3, :, 3])
    assert torch.equal(stack(lx.unbind(0)).narrow(0, 1, 3).read(), x[1:4])
    assert torch.equal(stack([x[0], lx[1]]).read(), x[:2])  # tensors and lazy ones mixed
    both = concat([lx, ly], 0)
    assert torch.equal(both.narrow(0, 4, 4).read(), torch.cat([x, y])[4:8])
    assert both.narrow(0, 3, 0).read().shape == (0, 4, 5)


def test_only_the_pieces_a_box_overlaps_are_read(stored):
    _, lazy = stored
    reads = []
    for name in ("x", "y"):
        real = lazy[name]._read
        lazy[name]._read = lambda box, real=real, name=name: reads.append(name) or real(box)
    concat([lazy["x"], lazy["y"]], 0).narrow(0, 7, 2).read()
    assert reads == ["y"]


def test_a_file_tensor_pickles_and_copies(stored):
    eager, lazy = stored
    lazy["x"].read()  # the file is open now
    for copied in (pickle.loads(pickle.dumps(lazy)), copy.deepcopy(lazy)):
        assert torch.equal(copied["x"][1:3].read(), eager["x"][1:3])


def test_bad_views_are_refused(stored):
    _, lazy = stored
    with pytest.raises(ValueError, match=r"narrow\(0, 5, 2\) is outside shape \(6, 4, 5\)"):
        lazy["x"].narrow(0, 5, 2)
    with pytest.raises(TypeError, match="t\\[a:b\\] and t\\[i\\] only"):
        lazy["x"][::2]
    with pytest.raises(ValueError, match="one shape and dtype"):
        stack([lazy["x"][0], lazy["y"][0].narrow(0, 0, 2)])
