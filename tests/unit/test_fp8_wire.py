"""The fp8 rows of the expert dispatch carry exactly DeepSeek's tile quantization."""

from __future__ import annotations

import pytest
import torch

from nanotrain.parallel.fp8_wire import (
    fp8_row_bytes,
    fp8_wire_roundtrip,
    pack_fp8_rows,
    unpack_fp8_rows,
)
from nanotrain.precision.quant import qdq_fp8


@pytest.mark.parametrize("hidden", [64, 128, 300])
def test_unpacked_rows_equal_the_tile_quantization_and_take_a_byte_per_value(hidden):
    g = torch.Generator().manual_seed(hidden)
    # rows of very different magnitudes (each tile keeps its own scale), an all-zero row
    x = torch.randn(6, hidden, generator=g) * torch.logspace(-3, 3, 6)[:, None]
    x[2] = 0.0
    packed = pack_fp8_rows(x)
    assert packed.dtype == torch.uint8
    assert packed.shape == (6, fp8_row_bytes(hidden))
    assert fp8_row_bytes(hidden) == hidden + 4 * -(-hidden // 128)  # values + fp32 tile scales
    for dtype in (torch.float32, torch.bfloat16):
        got = unpack_fp8_rows(packed, hidden, dtype)
        assert got.dtype == dtype
        assert torch.equal(got, qdq_fp8(x, "e4m3", "tile").to(dtype))
    assert torch.equal(unpack_fp8_rows(packed, hidden, torch.float32)[2], x[2])
    # the values really went through fp8
    assert not torch.equal(unpack_fp8_rows(packed, hidden, torch.float32), x)


def test_no_rows_pack_to_no_rows():
    packed = pack_fp8_rows(torch.empty(0, 64))
    assert packed.shape == (0, 68)
    assert unpack_fp8_rows(packed, 64, torch.bfloat16).shape == (0, 64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_roundtrip_without_a_wire_gives_its_values_and_passes_the_gradient(dtype):
    # a dispatch in fp8 on one expert-parallel rank: the rows the wire would deliver, and the
    # gradient the wire's all-to-all would hand back (unchanged)
    x = torch.randn(5, 200, dtype=dtype, requires_grad=True)
    y = fp8_wire_roundtrip(x)
    assert y.dtype == dtype
    assert torch.equal(y, unpack_fp8_rows(pack_fp8_rows(x), 200, dtype))
    assert not torch.equal(y, x)
    g = torch.randn(5, 200, dtype=dtype)
    y.backward(g)
    assert torch.equal(x.grad, g)
