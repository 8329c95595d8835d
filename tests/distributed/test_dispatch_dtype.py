"""The expert dispatch crosses ranks in the dtype the experts' GEMMs read: bf16 under bf16
autocast, bitwise the result of sending fp32; fp32 where the experts are run another way.

One forked world of 2 gloo ranks, ep=2, the tiny DeepSeekMoE layer in training mode under
bf16 autocast, dropless and with a capacity factor. Each case runs the layer twice from the
same weights and tokens: as built, and with `GroupedExperts.for_dispatch` replaced by the
identity (the fp32 dispatch of before). Outputs, input grads and every parameter grad must
be bitwise equal, and the payload dtypes of the data all-to-alls (forward dispatch and
combine, their backward pair) are recorded: bf16 out and back as built, fp32 dispatch
before. A layer whose experts a precision plugin keeps high (`wrap_forward`, as a policy
that keeps the routed experts in fp32 does) dispatches fp32, as does a layer without
autocast. Under "fp8-emulated" (experts set up by `EmulatedFP8`) the copies go out as fp8
rows with tile scales (uint8 on the wire) and give bitwise the numbers of the fp32 dispatch
the experts then quantize to the same tiles. With `set_fp8_dispatch` under bf16 autocast the
rows go out as fp8 rows too and the combine and gradients in bf16; without autocast the ep=2
layer gives what one rank gives when it rounds the rows as the wire would (`_for_dispatch`).
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist

from nanotrain.models import presets
from nanotrain.models.build import init_weights
from nanotrain.models.expert_compute import GroupedExperts, set_fp8_dispatch
from nanotrain.models.moe import DeepSeekMoE
from nanotrain.parallel import ParallelMesh
from nanotrain.precision.base import wrap_forward
from nanotrain.precision.emulated import EmulatedFP8
from tests.distributed.spawn import run_world

# bitwise and fp8-rounding claims on one small world: .ci/run reruns them on other kernels
pytestmark = [pytest.mark.distributed, pytest.mark.numerics, pytest.mark.kernels]


@contextlib.contextmanager
def recorded_all_to_alls(dtypes: list[torch.dtype], weights: list[torch.dtype]):
    """Appends the payload dtype of every floating-point or uint8 (fp8 rows) `all_to_all_single`
    of rows to `dtypes`, and of the copies' gate weights (one value per copy, and their
    gradient) to `weights` (the split-size exchanges are int64 and left out)."""
    real = dist.all_to_all_single

    def spy(output, input, *args, **kwargs):
        if input.is_floating_point() or input.dtype == torch.uint8:
            (dtypes if input.dim() > 1 else weights).append(input.dtype)
        return real(output, input, *args, **kwargs)

    dist.all_to_all_single = spy
    try:
        yield
    finally:
        dist.all_to_all_single = real


def _run(layer: DeepSeekMoE, rank: int, autocast: bool) -> tuple[list, list[torch.dtype]]:
    """(output, input grad, parameter grads) of one forward/backward, and the payload dtypes
    of the rows; the gate weights' are checked here: they cross as the router made them (this
    bare layer's router runs under autocast), out and back."""
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(2, 6, 64, generator=g, requires_grad=True)
    w = torch.randn(2, 6, 64, generator=g)
    dtypes: list[torch.dtype] = []
    weights: list[torch.dtype] = []
    with recorded_all_to_alls(dtypes, weights):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            y, aux = layer(x)
        ((y.float() * w).sum() + aux).backward()
    if layer.ep_group is not None:
        assert weights == [torch.bfloat16 if autocast else torch.float32] * 2, weights
    grads = [p.grad.clone() for p in layer.parameters() if p.grad is not None]
    return [y.detach(), x.grad.clone(), grads], dtypes


def _layer(
    mesh: ParallelMesh | None, capacity: float | None, keep_high: bool = False
) -> DeepSeekMoE:
    config = presets.get("tiny", aux_loss_alpha=0.01, capacity_factor=capacity)
    layer = DeepSeekMoE(config, ep_group=None if mesh is None else mesh.ep_group)
    init_weights(layer, torch.Generator().manual_seed(3))
    if keep_high:  # what Precision.apply_to_linear does to a layer the policy keeps high
        wrap_forward(layer.experts, lambda: torch.autocast("cpu", enabled=False))
    return layer.train()


def _fp8_layer(mesh: ParallelMesh, capacity: float | None, fp8_wire: bool) -> DeepSeekMoE:
    """The layer with its experts set up as "fp8-emulated" sets them up; `fp8_wire` False:
    their copies dispatched in fp32 instead."""
    layer = _layer(mesh, capacity)
    EmulatedFP8().apply_to_linear("mlp.experts", layer.experts, low=True)
    assert layer.experts.dispatches_fp8
    layer.experts.dispatches_fp8 = fp8_wire
    return layer


def _cases(rank: int, world_size: int) -> dict:
    mesh = ParallelMesh.build(ep=2)
    out = {}
    for capacity in (None, 1.0):
        built, built_dtypes = _run(_layer(mesh, capacity), rank, autocast=True)
        fp32_wire = _layer(mesh, capacity)
        fp32_wire.experts.for_dispatch = lambda x: x  # the fp32 dispatch of before
        before, before_dtypes = _run(fp32_wire, rank, autocast=True)
        flat = [built[0], built[1], *built[2]], [before[0], before[1], *before[2]]
        same = all(torch.equal(a, b) for a, b in zip(*flat, strict=True))
        _, high_dtypes = _run(_layer(mesh, capacity, keep_high=True), rank, autocast=True)
        _, fp32_dtypes = _run(_layer(mesh, capacity), rank, autocast=False)
        fp8, fp8_dtypes = _run(_fp8_layer(mesh, capacity, True), rank, autocast=True)
        fp32_wire, _ = _run(_fp8_layer(mesh, capacity, False), rank, autocast=True)
        flat = [fp8[0], fp8[1], *fp8[2]], [fp32_wire[0], fp32_wire[1], *fp32_wire[2]]
        fp8_same = all(torch.equal(a, b) for a, b in zip(*flat, strict=True))
        out[capacity] = (same, built_dtypes, before_dtypes, high_dtypes, fp32_dtypes)
        out[f"fp8 {capacity}"] = (fp8_same, fp8_dtypes)
        # the option, under bf16 autocast (dtypes) and in fp32 against one rank (numbers)
        layer = _layer(mesh, capacity)
        set_fp8_dispatch(layer, True)
        _, option_dtypes = _run(layer, rank, autocast=True)
        results = []
        for ep_mesh, fp8 in ((mesh, True), (None, True), (None, False)):
            layer = _layer(ep_mesh, capacity)
            set_fp8_dispatch(layer, fp8)
            results.append(_run(layer, rank, autocast=False)[0][:2])  # output, input grad
        out[f"option {capacity}"] = (option_dtypes, results)
    return out


@pytest.fixture(scope="module")
def world() -> list[dict]:
    return run_world(_cases, 2)


def test_dispatch_goes_out_in_bf16_under_autocast_and_gives_the_fp32_dispatchs_numbers(world):
    bf16, fp32 = torch.bfloat16, torch.float32
    for rank_result in world:
        for capacity in (None, 1.0):
            same, built, before, high, no_autocast = rank_result[capacity]
            case = f"capacity_factor={capacity}"
            assert same, f"{case}: bf16 dispatch changed outputs or grads"
            # forward dispatch, forward combine, backward of the combine, backward of dispatch
            assert built == [bf16, bf16, bf16, bf16], case
            assert before == [fp32, bf16, bf16, fp32], case
            assert high == [fp32, fp32, fp32, fp32], case
            assert no_autocast == [fp32, fp32, fp32, fp32], case


def test_fp8_emulated_dispatches_fp8_rows_with_the_fp32_dispatchs_numbers(world):
    for rank_result in world:
        for capacity in (None, 1.0):
            same, dtypes = rank_result[f"fp8 {capacity}"]
            assert same, f"capacity_factor={capacity}: fp8 dispatch changed outputs or grads"
            # dispatch as fp8 rows; the combine in bf16 (the experts' autocast output), its
            # gradient likewise; the copies' gradients back in their fp32
            assert dtypes == [torch.uint8, torch.bfloat16, torch.bfloat16, torch.float32]


def test_for_dispatch_casts_only_what_autocast_would():
    experts = GroupedExperts(4, 8, 16)
    x = torch.randn(3, 8)
    assert experts.for_dispatch(x) is x  # no autocast
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert experts.for_dispatch(x).dtype == torch.bfloat16
        double = x.double()
        assert experts.for_dispatch(double) is double  # autocast casts fp32 only
    wrap_forward(experts, contextlib.nullcontext)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert experts.for_dispatch(x) is x  # a precision plugin runs these experts


def test_fp8_dispatch_option_sends_fp8_rows_and_every_layout_computes_on_them(world):
    for rank_result in world:
        for capacity in (None, 1.0):
            dtypes, (ep2, one_rank, one_rank_plain) = rank_result[f"option {capacity}"]
            case = f"capacity_factor={capacity}"
            # fp8 rows out; the combine, its gradient and the copies' gradients in bf16
            assert dtypes == [torch.uint8] + [torch.bfloat16] * 3, case
            for got, want, plain in zip(ep2, one_rank, one_rank_plain, strict=True):
                # one rank rounds the rows as the wire does: equal up to the experts' GEMM
                # grouping; without the rounding the output is off by far more
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=case)
                assert (got - plain).abs().max() > 1e-4, case
