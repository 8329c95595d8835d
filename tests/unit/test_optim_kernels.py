"""AdamW kernel selection (`optimizer_impl`)."""

from __future__ import annotations

import pytest
import torch

from nanotrain.language_model import LanguageModelModule
from nanotrain.runtime.optim_kernels import adamw_kernel_kwargs


def test_kernel_kwargs_per_impl():
    cpu = [torch.zeros(2)]
    assert adamw_kernel_kwargs("auto", cpu) == {}  # CPU: torch's default, results unchanged
    assert adamw_kernel_kwargs("fused", cpu) == {"fused": True}
    assert adamw_kernel_kwargs("foreach", cpu) == {"foreach": True}
    assert adamw_kernel_kwargs("loop", cpu) == {"foreach": False}


def test_unknown_impl_is_refused_at_construction():
    with pytest.raises(ValueError, match="optimizer_impl must be one of"):
        LanguageModelModule("tiny", optimizer_impl="apex")


@pytest.mark.parametrize("impl", ["fused", "foreach"])
def test_module_builds_the_chosen_kernel_and_matches_the_loop(impl):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(3))]
    ref = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt = torch.optim.AdamW(params, lr=0.01, **adamw_kernel_kwargs(impl, params))
    ref_opt = torch.optim.AdamW(ref, lr=0.01, **adamw_kernel_kwargs("loop", ref))
    assert opt.defaults[impl] is True
    for _ in range(3):
        for ps, o in ((params, opt), (ref, ref_opt)):
            for p in ps:
                p.grad = p.detach().sin()
            o.step()
    for p, q in zip(params, ref, strict=True):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
