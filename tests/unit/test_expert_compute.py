"""Routed-expert computation: same values as per-expert indexing, cost linear in the experts."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from nanotrain.models.expert_compute import (
    CPU_GROUPED_MM_DTYPES,
    batched_swiglu,
    equal_group_rows,
    grouped_mm_available,
    grouped_swiglu,
    looped_swiglu,
)
from nanotrain.models.moe import GroupedExperts

E, H, INTER = 16, 8, 6

cpu_grouped_mm_runs = torch.float32 in CPU_GROUPED_MM_DTYPES
needs_cpu_grouped_mm = pytest.mark.skipif(
    not cpu_grouped_mm_runs, reason="this torch has no CPU torch.nn.functional.grouped_mm"
)


def _experts(
    dtype: torch.dtype = torch.float32, device: str = "cpu", h: int = H, inter: int = INTER
) -> GroupedExperts:
    torch.manual_seed(0)
    ex = GroupedExperts(E, h, inter, device=device)
    for p in ex.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return ex.to(dtype)


def _reference(x, sizes, ex):
    """The former implementation: index the stacked weights per expert."""
    out = []
    for e, x_e in enumerate(x.split(sizes)):
        a = F.silu(x_e @ ex.gate_proj[e].T) * (x_e @ ex.up_proj[e].T)
        out.append(a @ ex.down_proj[e].T)
    return torch.cat(out)


def _sizes() -> list[int]:
    # some experts get nothing: their weights must still get a (zero) gradient
    return [3, 0, 1, 5, 0, 2, 4, 0, 1, 1, 2, 0, 3, 1, 2, 1]


def test_looped_matches_per_expert_indexing_values_and_grads():
    ex = _experts()
    sizes = _sizes()
    x = torch.randn(sum(sizes), H, requires_grad=True)
    y = ex(x, torch.tensor(sizes))
    ref = _reference(x, sizes, ex)
    torch.testing.assert_close(y, ref, rtol=0, atol=0)
    g = torch.randn_like(y)
    got = torch.autograd.grad(y, [x, *ex.parameters()], g)
    want = torch.autograd.grad(ref, [x, *ex.parameters()], g)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert got[1][1].abs().sum() == 0  # expert 1 received no rows: zero, not missing, grad


class _CountStackSized(TorchDispatchMode):
    """Counts ops whose output is as large as a whole weight stack."""

    def __init__(self, numel: int):
        super().__init__()
        self.numel, self.count = numel, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor) and out.numel() == self.numel:
            self.count += 1
        return out


def test_backward_builds_each_stack_gradient_once():
    # Indexing w[e] made autograd zero-fill a whole-stack gradient per expert (E per weight,
    # quadratic total cost); unbind stacks the per-expert gradients once per weight.
    ex = _experts()
    sizes = _sizes()
    x = torch.randn(sum(sizes), H)
    y = ex(x, sizes)
    mode = _CountStackSized(E * INTER * H)
    with mode:
        y.sum().backward()
    assert mode.count <= 2 * 3, mode.count  # at most a couple per weight, never per expert


def test_grouped_gemm_needs_aligned_rows_and_a_supported_dtype():
    # the kernels read rows in 16-byte steps: fp32 widths multiples of 4, bf16 of 8
    assert not grouped_mm_available(torch.zeros(2, H), _experts(h=H, inter=6).gate_proj)
    bf16 = _experts(torch.bfloat16, h=16, inter=4)  # 4 bf16 = 8 bytes per row: unaligned
    assert not grouped_mm_available(torch.zeros(2, 16, dtype=torch.bfloat16), bf16.gate_proj)
    fp16 = _experts(torch.float16, h=16, inter=8)
    assert not grouped_mm_available(torch.zeros(2, 16, dtype=torch.float16), fp16.gate_proj)
    aligned = _experts(h=16, inter=8)
    assert not grouped_mm_available(torch.zeros(2, 16, dtype=torch.bfloat16), aligned.gate_proj)
    assert grouped_mm_available(torch.zeros(2, 16), aligned.gate_proj) == cpu_grouped_mm_runs


class _SeenOps(TorchDispatchMode):
    """Names of the aten ops dispatched, and how many."""

    def __init__(self):
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.__name__)
        return func(*args, **(kwargs or {}))


class _PassThrough(torch.overrides.TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def _unequal_sizes(num_experts: int, rows: int = 128) -> list[int]:
    # the same tokens at every E, spread unevenly, with empty experts
    weights = [(e % 3) for e in range(num_experts)]
    sizes = [rows * w // sum(weights) for w in weights]
    sizes[0] += rows - sum(sizes)
    return sizes


@needs_cpu_grouped_mm
@pytest.mark.parametrize("counts_as", [list, torch.tensor])
def test_unequal_groups_take_one_grouped_gemm_per_weight_on_cpu(counts_as):
    ex = _experts(h=32, inter=16)
    sizes = _unequal_sizes(E)
    x = torch.randn(sum(sizes), 32, requires_grad=True)
    with _SeenOps() as seen:
        y = ex(x, counts_as(sizes))
    assert seen.names.count("_grouped_mm.default") == 3 and "mm.default" not in seen.names
    ref = looped_swiglu(x, sizes, ex.gate_proj, ex.up_proj, ex.down_proj)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-6)
    got = torch.autograd.grad(y.sum(), [x, *ex.parameters()])  # a stride-0 gradient
    want = torch.autograd.grad(ref.sum(), [x, *ex.parameters()])
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert sizes[3] == 0 and all(g[3].abs().sum() == 0 for g in got[1:])  # zero, not missing


@needs_cpu_grouped_mm
def test_grouped_op_count_does_not_grow_with_the_experts():
    counts = []
    for num_experts in (2, 32):
        torch.manual_seed(0)
        ex = GroupedExperts(num_experts, 16, 8)
        x = torch.randn(128, 16, requires_grad=True)
        with _SeenOps() as seen:
            ex(x, _unequal_sizes(num_experts)).sum().backward()
        counts.append(len(seen.names))
    assert counts[0] == counts[1], counts


def _bf16_cpu_grouped_mm() -> bool:
    return torch.bfloat16 in CPU_GROUPED_MM_DTYPES


@pytest.mark.skipif(not _bf16_cpu_grouped_mm(), reason="this torch has no bf16 grouped_mm on CPU")
def test_grouped_runs_under_autocast_on_inputs_cast_as_autocast_casts_them():
    # bf16-mixed: x comes in fp32 from the norm and the weights are fp32; the layer casts
    # both to bf16 (as autocast casts each matmul's inputs) and runs the grouped GEMM, which
    # on CUDA is the path without a host sync, instead of the per-expert loop
    ex = _experts(h=32, inter=16)
    sizes = _unequal_sizes(E)
    x = torch.randn(sum(sizes), 32, requires_grad=True)
    g = torch.randn(sum(sizes), 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with _SeenOps() as seen:
            y = ex(x, sizes)
        ref = looped_swiglu(x, sizes, ex.gate_proj, ex.up_proj, ex.down_proj)
    assert "_grouped_mm.default" in seen.names and y.dtype == ref.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), ref.float(), rtol=2e-2, atol=2e-2)
    got = torch.autograd.grad(y, [x, *ex.parameters()], g)
    want = torch.autograd.grad(ref, [x, *ex.parameters()], g)
    for a, b in zip(got, want, strict=True):
        assert a.dtype == torch.float32  # the fp32 parameters and input get fp32 gradients
        torch.testing.assert_close(a, b, rtol=3e-2, atol=3e-2)


@needs_cpu_grouped_mm
def test_grouped_keeps_the_loop_under_function_modes():
    ex = _experts(h=32, inter=16)
    sizes = _unequal_sizes(E)
    x = torch.randn(sum(sizes), 32)
    with _PassThrough(), _SeenOps() as seen:  # as the fp8/fp4 emulation's mode
        ex(x, sizes)
    assert "_grouped_mm.default" not in seen.names and "mm.default" in seen.names


def test_grouped_swiglu_matches_the_loop_where_torch_runs_it_on_cpu():
    # torch's CPU grouped_mm (a reference implementation) checks the offsets and transposes
    # this module relies on; the CUDA kernel computes the same thing in bf16
    ex = _experts(h=16, inter=8)
    sizes = _sizes()
    x = torch.randn(sum(sizes), 16, requires_grad=True)
    y = grouped_swiglu(x, torch.tensor(sizes), ex.gate_proj, ex.up_proj, ex.down_proj)
    _assert_matches_the_loop(y, x, sizes, ex)


def _assert_matches_the_loop(y, x, sizes, ex) -> None:
    """y (computed from x by experts `ex` over groups `sizes`) and its gradients equal the
    per-expert loop's, to fp32 rounding."""
    ref = looped_swiglu(x, sizes, ex.gate_proj, ex.up_proj, ex.down_proj)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-6)
    g = torch.randn_like(y)
    got = torch.autograd.grad(y, [x, *ex.parameters()], g)
    want = torch.autograd.grad(ref, [x, *ex.parameters()], g)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@needs_cpu_grouped_mm
def test_unequal_groups_compile_in_fp32_on_cpu():
    # eager takes the CPU grouped GEMM here, but torch.compile's shape function for grouped_mm
    # refuses fp32: compiled, the layer must take another path (it failed to trace before)
    ex = _experts(h=16, inter=8)
    sizes = _sizes()
    x = torch.randn(sum(sizes), 16, requires_grad=True)
    counts = torch.tensor(sizes)
    torch._dynamo.reset()
    y = torch.compile(ex, backend="aot_eager")(x, counts)
    torch._dynamo.reset()
    _assert_matches_the_loop(y, x, sizes, ex)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="grouped_mm needs a CUDA GPU")
def test_grouped_mm_matches_loop_on_cuda():
    # widths multiples of 8: the bf16 kernels want 16-byte row strides
    ex = _experts(torch.bfloat16, "cuda", h=16, inter=16)
    if not grouped_mm_available(
        torch.zeros(1, 16, dtype=torch.bfloat16, device="cuda"), ex.gate_proj
    ):
        pytest.skip("this GPU has no bf16 grouped GEMM (compute capability < 8.0)")
    sizes = _sizes()
    x = torch.randn(sum(sizes), 16, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    # the gate weights, as the MoE layer hands them in (fp32 from the router)
    w = torch.rand(sum(sizes), device="cuda", requires_grad=True)
    counts = torch.tensor(sizes, device="cuda")
    if torch.cuda.get_device_capability()[0] in (9, 10):
        # torch's grouped-GEMM kernels take the offsets on the device (Hopper, Blackwell; its
        # fallback elsewhere reads them on the host): the layer must not sync
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            ex(x, counts, w).float().sum().backward()
            ex.fp8_saved_activations = True  # packing and unpacking the saves stays async
            ex(x, counts, w).float().sum().backward()
        finally:
            torch.cuda.set_sync_debug_mode("default")
            ex.fp8_saved_activations = False
    scale = w.to(torch.bfloat16)[:, None]
    y = grouped_swiglu(x, counts, ex.gate_proj, ex.up_proj, ex.down_proj, scale=scale)
    ref = looped_swiglu(x, sizes, ex.gate_proj, ex.up_proj, ex.down_proj, scale=scale)
    torch.testing.assert_close(y, ref, rtol=2e-2, atol=2e-2)
    gy = torch.autograd.grad(y.float().sum(), [x, ex.gate_proj, w])
    gr = torch.autograd.grad(ref.float().sum(), [x, ex.gate_proj, w])
    for a, b in zip(gy, gr, strict=True):
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2)


def test_equal_group_rows_only_for_equal_nonempty_groups():
    assert equal_group_rows([4, 4, 4]) == 4
    assert equal_group_rows([4, 3, 4]) is None
    assert equal_group_rows([0, 0]) is None
    assert equal_group_rows([]) is None


@pytest.mark.parametrize("rows", [1, 7, 40])
def test_batched_matches_the_loop_values_and_grads(rows):
    ex = _experts(h=32, inter=16)
    sizes = [rows] * E
    x = torch.randn(sum(sizes), 32, requires_grad=True)
    y = ex(x, torch.tensor(sizes))  # equal groups: the layer takes the batched path
    ref = looped_swiglu(x, sizes, ex.gate_proj, ex.up_proj, ex.down_proj)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(batched_swiglu(x, E, *ex.parameters()), y, rtol=0, atol=0)
    g = torch.randn_like(y)
    got = torch.autograd.grad(y, [x, *ex.parameters()], g)
    want = torch.autograd.grad(ref, [x, *ex.parameters()], g)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_batched_takes_an_expanded_gradient():
    # y.sum().backward() hands the Function a stride-0 gradient
    ex = _experts(h=32, inter=16)
    x = torch.randn(E * 3, 32, requires_grad=True)
    ex(x, [3] * E).sum().backward()
    grads = [x.grad, *(p.grad for p in ex.parameters())]
    ex.zero_grad()
    x.grad = None
    looped_swiglu(x, [3] * E, *ex.parameters()).sum().backward()
    for a, b in zip(grads, [x.grad, *(p.grad for p in ex.parameters())], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_uneven_and_empty_groups_still_match_the_reference():
    # unequal groups (dropless routing, empty experts) where no grouped GEMM runs (widths
    # not 16-byte aligned) keep the loop: exact, zero grads
    ex = _experts(h=30, inter=14)
    sizes = [7, 0, 1, 40, 0, 3] + [2] * (E - 6)
    x = torch.randn(sum(sizes), 30, requires_grad=True)
    y = ex(x, sizes)
    torch.testing.assert_close(y, _reference(x, sizes, ex), rtol=0, atol=0)
    grads = torch.autograd.grad(y.square().sum(), list(ex.parameters()))
    assert all(g[1].abs().sum() == 0 and g[4].abs().sum() == 0 for g in grads)


def test_batched_keeps_the_loop_under_function_modes_and_runs_under_autocast():
    class _Seen(torch.overrides.TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.funcs = set()

        def __torch_function__(self, func, types, args=(), kwargs=None):
            self.funcs.add(func)
            return func(*args, **(kwargs or {}))

    ex = _experts(h=32, inter=16)
    x = torch.randn(E * 2, 32)
    with _Seen() as seen:  # e.g. the fp8 emulation intercepts the per-expert x @ W.T
        ex(x, [2] * E)
    names = {getattr(f, "__name__", "") for f in seen.funcs}
    assert "bmm" not in names and "matmul" in names
    with torch.autocast("cpu", dtype=torch.bfloat16), _SeenOps() as ops:
        y = ex(x, [2] * E)  # the layer casts x and the weights as autocast would
    assert "bmm.default" in ops.names
    with torch.autocast("cpu", dtype=torch.bfloat16):  # autocast casts each x @ W.T
        ref = looped_swiglu(x, [2] * E, ex.gate_proj, ex.up_proj, ex.down_proj)
    assert y.dtype == ref.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), ref.float(), rtol=2e-2, atol=2e-2)


class _CountOps(TorchDispatchMode):
    """Counts dispatched ops, and those that write a new tensor as large as a weight stack."""

    def __init__(self, stack_numel: int):
        super().__init__()
        self.stack_numel, self.ops, self.stack_sized = stack_numel, 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops += 1
        inputs = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)}
        if (
            isinstance(out, torch.Tensor)
            and out.numel() == self.stack_numel
            and out.untyped_storage().data_ptr() not in inputs  # not a view (transpose)
        ):
            self.stack_sized += 1
        return out


def _count_fwd_bwd(num_experts: int) -> _CountOps:
    torch.manual_seed(0)
    ex = GroupedExperts(num_experts, 16, 8)
    rows = 64 // num_experts  # same tokens (and FLOPs) at every size
    x = torch.randn(64, 16, requires_grad=True)
    mode = _CountOps(num_experts * 8 * 16)
    with mode:
        ex(x, [rows] * num_experts).sum().backward()
    return mode


def test_batched_op_count_does_not_grow_with_the_experts():
    # A per-expert op anywhere (a loop, or indexing w[e] with its stack-sized zero gradient
    # per expert) would make these counts grow with E; batched GEMMs keep them constant.
    small, large = _count_fwd_bwd(2), _count_fwd_bwd(32)
    assert large.ops == small.ops, (small.ops, large.ops)
    assert large.stack_sized <= 3, large.stack_sized  # each weight gradient written once


def _paths() -> list[str]:
    return ["looped", "batched"] + (["grouped"] if cpu_grouped_mm_runs else [])


@pytest.mark.parametrize("rebuild", [False, True], ids=["plain", "light"])
@pytest.mark.parametrize("path", _paths())
def test_a_scale_weighs_each_rows_output_on_every_path(path, rebuild):
    # the gate weights enter before the down projection: the output and every gradient are
    # those of weighing the unscaled output afterwards (fp32 rounding apart), the scale's too
    ex = _experts(inter=8)  # rows of 32 bytes: the grouped GEMM's alignment
    sizes = [3] * E if path == "batched" else _sizes()
    x = torch.randn(sum(sizes), H, requires_grad=True)
    w = torch.rand(sum(sizes), requires_grad=True)
    params = [x, w, *ex.parameters()]
    probe = torch.randn(sum(sizes), H)
    weights = (ex.gate_proj, ex.up_proj, ex.down_proj)
    if path == "looped":
        y = looped_swiglu(x, sizes, *weights, rebuild, w[:, None])
    elif path == "batched":
        y = batched_swiglu(x, E, *weights, rebuild, w[:, None])
    else:
        y = grouped_swiglu(x, torch.tensor(sizes), *weights, rebuild, w[:, None])
    ref = _reference(x, sizes, ex) * w[:, None]
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-6)
    got = torch.autograd.grad((y * probe).sum(), params)
    want = torch.autograd.grad((ref * probe).sum(), params)
    for name, a, b in zip(["x", "scale", "gate", "up", "down"], got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=name)


def test_the_module_routes_a_scale_to_the_path_it_picks_and_casts_it():
    # GroupedExperts.forward takes the scale as [M] in any dtype; under bf16 autocast it is
    # cast with x, and its gradient comes back in its own dtype
    ex = _experts()
    sizes = _sizes()
    x = torch.randn(sum(sizes), H)
    w = torch.rand(sum(sizes), requires_grad=True)
    torch.testing.assert_close(ex(x, sizes, w), ex(x, sizes) * w[:, None], rtol=1e-5, atol=1e-6)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = ex(x, sizes, w)
    assert y.dtype == torch.bfloat16
    (grad,) = torch.autograd.grad(y.float().sum(), w)
    assert grad.dtype == torch.float32 and grad.abs().sum() > 0
