"""Routed experts' saved rows and SwiGLU inputs kept in fp8 (`nanotrain.models.fp8_saves`).

Every expert path (loop, batched GEMMs, grouped GEMM), with and without recompute "light",
is checked against gradients written out by hand from the rounded saves: the rows x and the
gate / up outputs g, u read back as ``qdq_fp8(., "e4m3", "tile")`` (the fp8 emulation's own
quantizer), everything else exact. The forward output is bitwise the one without fp8 saves.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from nanotrain import LanguageModelModule
from nanotrain.models.expert_compute import (
    CPU_GROUPED_MM_DTYPES,
    GroupedExperts,
    batched_swiglu,
    grouped_swiglu,
    looped_swiglu,
    set_fp8_expert_activations,
)
from nanotrain.models.fp8_saves import Fp8Saves, fp8_saved_bytes
from nanotrain.precision.quant import qdq_fp8
from tests.precision_helpers import VOCAB, fit

H, INTER = 256, 160  # two 128-wide tiles per row, the second ragged for INTER


def _qdq(t: torch.Tensor) -> torch.Tensor:
    return qdq_fp8(t, "e4m3", "tile")


def _by_hand(x, sizes, gate, up, down, scale, dy, light):
    """(dx, d gate, d up, d down, d scale) of sum(dy * y) with x, g, u saved rounded."""
    dxs, dgates, dups, ddowns, dscales = [], [], [], [], []
    start = 0
    for e, n in enumerate(sizes):
        xe, se, dye = x[start : start + n], scale[start : start + n], dy[start : start + n]
        start += n
        g, u = xe @ gate[e].T, xe @ up[e].T
        xq, gq, uq = _qdq(xe), _qdq(g), _qdq(u)
        # light rebuilds silu(g) and the product from the rounded saves; else they are kept
        sg = F.silu(gq) if light else F.silu(g)
        a = sg * (uq if light else u)
        ddowns.append(dye.T @ (a * se))
        dz = dye @ down[e]
        dscales.append((dz * a).sum(-1, keepdim=True))
        da = dz * se
        sig = torch.sigmoid(gq)
        dg = da * uq * sig * (1 + gq * (1 - sig))
        du = da * sg
        dgates.append(dg.T @ xq)
        dups.append(du.T @ xq)
        dxs.append(dg @ gate[e] + du @ up[e])
    stack = torch.stack
    return torch.cat(dxs), stack(dgates), stack(dups), stack(ddowns), torch.cat(dscales)


def _inputs(sizes, seed=0):
    g = torch.Generator().manual_seed(seed)
    e, m = len(sizes), sum(sizes)
    x = torch.randn(m, H, generator=g)
    gate = torch.randn(e, INTER, H, generator=g) / H**0.5
    up = torch.randn(e, INTER, H, generator=g) / H**0.5
    down = torch.randn(e, H, INTER, generator=g) / INTER**0.5
    scale = torch.rand(m, 1, generator=g)
    dy = torch.randn(m, H, generator=g)
    return x, gate, up, down, scale, dy


def _run(path, sizes, light, fp8):
    x, gate, up, down, scale, dy = (t.requires_grad_() for t in _inputs(sizes))
    with Fp8Saves(fp8) as saves:
        saves.keep(x)
        if path == "loop":
            y = looped_swiglu(x, sizes, gate, up, down, light, scale)
        elif path == "batched":
            y = batched_swiglu(x, len(sizes), gate, up, down, light, scale)
        else:
            y = grouped_swiglu(x, torch.tensor(sizes), gate, up, down, light, scale)
    (y * dy).sum().backward()
    return y.detach(), [t.grad for t in (x, gate, up, down, scale)]


PATHS = [
    pytest.param("loop", [3, 7, 2]),
    pytest.param("batched", [4, 4, 4]),
    pytest.param(
        "grouped",
        [3, 7, 2],
        marks=pytest.mark.skipif(
            torch.float32 not in CPU_GROUPED_MM_DTYPES, reason="no fp32 grouped_mm on this CPU"
        ),
    ),
]


@pytest.mark.parametrize("light", [False, True], ids=["keep", "light"])
@pytest.mark.parametrize(("path", "sizes"), PATHS)
def test_gradients_read_the_rows_and_swiglu_inputs_rounded_to_fp8(path, sizes, light):
    y, grads = _run(path, sizes, light, fp8=True)
    y_plain, grads_plain = _run(path, sizes, light, fp8=False)
    assert torch.equal(y, y_plain)  # forward computes with the exact values
    x, gate, up, down, scale, dy = _inputs(sizes)
    expected = _by_hand(x, sizes, gate, up, down, scale, dy, light)
    for name, got, want, plain in zip(
        ("x", "gate", "up", "down", "scale"), grads, expected, grads_plain, strict=True
    ):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=name)
        # down's and the scale's gradients read the product: kept exact, rebuilt under light
        if name not in ("down", "scale") or light:
            assert (got - plain).abs().max() > 1e-4, f"{name}'s gradient did not change"


def test_the_module_keeps_what_the_formula_says_and_nothing_twice():
    sizes = [3, 7, 2]
    experts = GroupedExperts(3, H, INTER)
    x, gate, up, down, scale, _ = _inputs(sizes)
    with torch.no_grad():
        experts.gate_proj.copy_(gate), experts.up_proj.copy_(up), experts.down_proj.copy_(down)
    experts.rebuild_activation = True
    params = {p.untyped_storage().data_ptr() for p in experts.parameters()}

    def saved_bytes(fp8: bool) -> int:
        set_fp8_expert_activations(experts, fp8)
        seen: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            storage = t.untyped_storage()
            if storage.data_ptr() not in params:
                seen.setdefault(storage.data_ptr(), storage.nbytes())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            experts(x.clone().requires_grad_(), sizes, scale[:, 0]).sum().backward()
        return sum(seen.values())

    m = sum(sizes)
    plain, fp8 = saved_bytes(False), saved_bytes(True)
    # light keeps x, g, u (fp32 here) and the scale; fp8 replaces the first three
    swapped = 4 * m * (H + 2 * INTER) - fp8_saved_bytes(m, H) - 2 * fp8_saved_bytes(m, INTER)
    assert plain - fp8 == swapped


def test_a_checkpointed_region_keeps_nothing_in_fp8():
    # what a checkpoint region saves is recomputed from exact values: fp8 would only lose bits
    sizes = [4, 4, 4]
    x, gate, up, down, scale, dy = _inputs(sizes)

    def run(fp8: bool):
        leaves = [t.clone().requires_grad_() for t in (x, gate, up, down)]

        def region(xx, gg, uu, dd):
            with Fp8Saves(fp8) as saves:
                assert not saves.active
                return batched_swiglu(saves.keep(xx), 3, gg, uu, dd, False, scale)

        y = torch.utils.checkpoint.checkpoint(region, *leaves, use_reentrant=False)
        (y * dy).sum().backward()
        return [t.grad for t in leaves]

    for got, want in zip(run(True), run(False), strict=True):
        assert torch.equal(got, want)


def test_the_switch_takes_a_bool_only():
    with pytest.raises(TypeError, match="True or False"):
        set_fp8_expert_activations(GroupedExperts(2, 8, 8), "fp8")


def test_the_module_refuses_fp8_saves_under_torch_compile():
    # torch.compile does not run saved-tensor hooks: the saves would silently stay exact
    with pytest.raises(ValueError, match="torch.compile"):
        LanguageModelModule("tiny", fp8_expert_activations=True, compile_layers=True)
    with pytest.raises(TypeError, match="True or False"):
        LanguageModelModule("tiny", fp8_expert_activations=1)


def test_the_module_sets_every_routed_expert_module_including_mtp():
    module = LanguageModelModule("tiny", vocab_size=257, fp8_expert_activations=True)
    module.configure_model()
    experts = [m for m in module.model.modules() if isinstance(m, GroupedExperts)]
    assert len(experts) == 2  # tiny: one MoE layer and the MTP block's
    assert all(m.fp8_saved_activations for m in experts)


def test_a_run_with_the_fp8_expert_options_resumes_exactly(tmp_path):
    # the options are hyperparameters: a resumed run keeps them, and rounds as the first did
    def module():
        return LanguageModelModule(
            "tiny",
            vocab_size=VOCAB,
            lr=3e-3,
            warmup_steps=2,
            recompute="light",
            fp8_expert_activations=True,
            fp8_dispatch=True,
        )

    _, straight = fit("32-true", steps=4, root=str(tmp_path / "straight"), module=module())
    fit("32-true", steps=2, root=str(tmp_path / "split"), module=module())
    trainer, resumed = fit(
        "32-true", steps=4, root=str(tmp_path / "split"), module=module(), ckpt_path="last"
    )
    assert trainer.module.hparams["fp8_expert_activations"] is True
    assert resumed.losses == straight.losses[2:]
    assert resumed.grad_norms == straight.grad_norms[2:]
