"""The CPU expert kernel: same values and gradients as batched BLAS, per-expert results that
do not depend on how many experts share a call, and a clean fallback where it cannot run."""

from __future__ import annotations

import platform
import warnings

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import nanotrain.models.expert_gemm_cpu as kernel
from nanotrain.models.expert_compute import BmmGemms, _BatchedSwiGLU, batched_swiglu
from nanotrain.models.moe import GroupedExperts

kernel_buildable = (
    platform.machine().lower() in ("x86_64", "amd64")
    and torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")
    and kernel._compiler() is not None
)
needs_kernel = pytest.mark.skipif(
    not kernel_buildable, reason="the CPU expert kernel needs x86-64 AVX2 and a C compiler"
)


def _layer(experts: int, hidden: int, inter: int, seed: int = 0) -> GroupedExperts:
    torch.manual_seed(seed)
    ex = GroupedExperts(experts, hidden, inter)
    for p in ex.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return ex


def _fwd_bwd(ex: GroupedExperts, x: torch.Tensor, grad: torch.Tensor, gemms) -> list[torch.Tensor]:
    x = x.detach().requires_grad_()
    weights = (ex.gate_proj, ex.up_proj, ex.down_proj)
    y = _BatchedSwiGLU.apply(x, ex.num_local_experts, gemms, *weights)
    return [y.detach(), *torch.autograd.grad(y, [x, *weights], grad)]


@needs_kernel
@pytest.mark.parametrize(
    ("experts", "rows", "hidden", "inter"),
    [
        (4, 1, 32, 16),
        (3, 7, 12, 6),
        (2, 40, 24, 40),
        (5, 17, 8, 9),
        (2, 64, 136, 64),
        (8, 3, 256, 272),  # weight-gradient stacks over 2 MiB: streaming stores
        (8, 3, 260, 272),  # as large, rows not 32-byte aligned: plain stores
    ],
)
def test_kernel_matches_batched_blas_values_and_grads(experts, rows, hidden, inter):
    # widths that are and are not multiples of the 8-float vectors and 16-column panels, few
    # rows (the activations are packed) and many (the weights are packed)
    ex = _layer(experts, hidden, inter)
    x = torch.randn(experts * rows, hidden)
    grad = torch.randn(experts * rows, hidden)
    assert kernel.cpu_kernel_runs(x, ex.gate_proj, ex.up_proj, ex.down_proj)
    got = _fwd_bwd(ex, x, grad, kernel.KernelGemms)
    blas = _fwd_bwd(ex, x, grad, BmmGemms)
    exact = _fwd_bwd(ex.double(), x.double(), grad.double(), BmmGemms)
    for a, b, ref in zip(got, blas, exact, strict=True):
        # both within fp32 rounding of the fp64 result (sums of up to 272 products)
        scale = ref.abs().max().item()
        torch.testing.assert_close(a.double(), ref, rtol=0, atol=2e-6 * scale)
        torch.testing.assert_close(b.double(), ref, rtol=0, atol=2e-6 * scale)


@needs_kernel
def test_an_experts_result_does_not_depend_on_the_others():
    # Under expert parallelism a rank holds a slice of the experts: each expert's output and
    # gradients must be bit-identical whether it shares the call with 3 others or with none.
    ex = _layer(4, 32, 16)
    x, grad = torch.randn(4 * 9, 32), torch.randn(4 * 9, 32)
    whole = _fwd_bwd(ex, x, grad, kernel.KernelGemms)
    part = GroupedExperts(4, 32, 16, ep_size=2, ep_rank=1)  # experts 2 and 3
    part.load_state_dict(part.shard_full_state_dict(dict(ex.state_dict())))
    sliced = _fwd_bwd(part, x[18:], grad[18:], kernel.KernelGemms)
    torch.testing.assert_close(sliced[0], whole[0][18:], rtol=0, atol=0)
    torch.testing.assert_close(sliced[1], whole[1][18:], rtol=0, atol=0)
    for a, b in zip(sliced[2:], whole[2:], strict=True):
        torch.testing.assert_close(a, b[2:], rtol=0, atol=0)


@needs_kernel
def test_the_layer_takes_the_kernel_only_where_it_runs(monkeypatch):
    ex = _layer(4, 16, 8)
    x = torch.randn(4 * 3, 16)
    weights = (ex.gate_proj, ex.up_proj, ex.down_proj)
    calls = []
    real_call = kernel._call
    monkeypatch.setattr(kernel, "_call", lambda name, *a: calls.append(name) or real_call(name, *a))
    ex(x, [3] * 4).sum().backward()
    assert calls == list(kernel._ENTRY_POINTS)  # forward stages, then backward stages

    class _Mode(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    with _Mode():
        assert not kernel.cpu_kernel_runs(x, *weights)  # e.g. fake tensors: no host data
    assert not kernel.cpu_kernel_runs(x.bfloat16(), *(w.bfloat16() for w in weights))
    assert not kernel.cpu_kernel_runs(x.t().contiguous().t(), *weights)  # not contiguous
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # bmm uses every thread; the kernel runs on one
    try:
        assert not kernel.cpu_kernel_runs(x, *weights)
    finally:
        torch.set_num_threads(threads)
    monkeypatch.setenv("NANOTRAIN_CPU_EXPERT_KERNEL", "0")
    assert not kernel.cpu_kernel_runs(x, *weights)
    calls.clear()
    y = batched_swiglu(x, 4, *weights)  # falls back to batched BLAS, same values
    assert calls == []
    monkeypatch.delenv("NANOTRAIN_CPU_EXPERT_KERNEL")
    torch.testing.assert_close(y, batched_swiglu(x, 4, *weights), rtol=1e-5, atol=1e-6)
    assert calls


@needs_kernel
def test_build_is_cached_and_leaves_no_partial_file(tmp_path, monkeypatch):
    monkeypatch.setenv("NANOTRAIN_KERNEL_CACHE", str(tmp_path))
    first = kernel._build(kernel._compiler())
    mtime = first.stat().st_mtime_ns
    assert kernel._build(kernel._compiler()) == first
    assert first.stat().st_mtime_ns == mtime  # not rebuilt
    assert [p.name for p in tmp_path.iterdir()] == [first.name]


def test_a_failed_build_warns_once_and_leaves_batched_blas(tmp_path, monkeypatch):
    monkeypatch.setattr(kernel, "_library", None)
    monkeypatch.setattr(kernel, "_load_tried", False)
    monkeypatch.setenv("NANOTRAIN_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    ex = _layer(2, 16, 8)
    x = torch.randn(2 * 4, 16)
    weights = (ex.gate_proj, ex.up_proj, ex.down_proj)
    with pytest.warns(UserWarning, match="CPU expert kernel"):
        assert not kernel.cpu_kernel_runs(x, *weights)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the second call neither warns nor retries
        assert not kernel.cpu_kernel_runs(x, *weights)
        y = batched_swiglu(x, 2, *weights)
    torch.testing.assert_close(y, ex(x, [4, 4]), rtol=0, atol=0)
    assert list(tmp_path.iterdir()) == []
