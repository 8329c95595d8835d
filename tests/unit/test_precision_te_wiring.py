"""The Transformer Engine plugin's wiring, checked on CPU against a stand-in `transformer_engine`
module (no real TE here): recipe classes by TE's names, the GPU check, which layers are
swapped, that the swapped GEMM shares the layer's weight and runs inside ``fp8_autocast``.
TE's own numerics are not exercised (tests/unit/test_precision.py has the GPU+TE test)."""

from __future__ import annotations

import contextlib
import sys
import types

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from nanotrain.precision import TransformerEnginePrecision
from nanotrain.strategies import SingleDeviceStrategy
from tests.precision_helpers import fit


class FakeLinear(nn.Module):
    calls = 0

    def __init__(self, in_features, out_features, bias=True, params_dtype=None, device=None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=params_dtype))

    def forward(self, x):
        FakeLinear.calls += 1
        assert FakeAutocast.depth > 0, "TE GEMM ran outside fp8_autocast"
        return F.linear(x, self.weight)


class FakeAutocast:
    depth = 0
    recipes: list = []

    def __init__(self, enabled=True, fp8_recipe=None):
        FakeAutocast.recipes.append(fp8_recipe)

    def __enter__(self):
        FakeAutocast.depth += 1

    def __exit__(self, *exc):
        FakeAutocast.depth -= 1


def _recipe_class(name):
    def init(self, fp8_format=None):
        self.fp8_format = fp8_format

    return type(name, (), {"__init__": init})


@pytest.fixture
def fake_te(monkeypatch):
    root = types.ModuleType("transformer_engine")
    pt = types.ModuleType("transformer_engine.pytorch")
    common = types.ModuleType("transformer_engine.common")
    recipe = types.ModuleType("transformer_engine.common.recipe")
    recipe.Format = types.SimpleNamespace(HYBRID="HYBRID", E4M3="E4M3")
    for name in (
        "DelayedScaling",
        "Float8CurrentScaling",
        "Float8BlockScaling",
        "MXFP8BlockScaling",
    ):
        setattr(recipe, name, _recipe_class(name))
    pt.Linear, pt.fp8_autocast = FakeLinear, FakeAutocast
    support = {"check_fp8_support": (True, ""), "check_mxfp8_support": (False, "needs Blackwell")}
    pt.fp8 = types.SimpleNamespace(
        **{k: (lambda v=v: v) for k, v in support.items()},
        check_fp8_block_scaling_support=lambda: (True, ""),
    )
    root.pytorch, root.common, common.recipe = pt, common, recipe
    for name, mod in [
        ("transformer_engine", root),
        ("transformer_engine.pytorch", pt),
        ("transformer_engine.common", common),
        ("transformer_engine.common.recipe", recipe),
    ]:
        monkeypatch.setitem(sys.modules, name, mod)
    FakeLinear.calls, FakeAutocast.recipes = 0, []
    return recipe


def test_no_gpu_is_refused_at_construction(fake_te, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="needs a CUDA GPU .* use precision='fp8-emulated'"):
        TransformerEnginePrecision()


@pytest.mark.parametrize(
    ("recipe", "cls", "fmt"),
    [
        ("delayed", "DelayedScaling", "HYBRID"),
        ("current", "Float8CurrentScaling", "HYBRID"),
        ("blockwise", "Float8BlockScaling", "E4M3"),
    ],
)
def test_recipes_by_te_names(fake_te, monkeypatch, recipe, cls, fmt):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    plugin = TransformerEnginePrecision(recipe=recipe)
    assert type(plugin.recipe).__name__ == cls and plugin.recipe.fp8_format == fmt
    assert plugin.peak_precision() == "fp8"


def test_unsupported_recipe_on_this_gpu(fake_te, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(
        ValueError, match="cannot run the 'mxfp8' fp8 recipe on this GPU: needs Blackwell"
    ):
        TransformerEnginePrecision(recipe="mxfp8")


def test_policy_layers_run_their_gemm_through_te_sharing_the_weight(fake_te, monkeypatch, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    plugin = TransformerEnginePrecision(recipe="delayed")
    trainer, rec = fit(plugin, SingleDeviceStrategy("cpu"), steps=2, root=str(tmp_path))
    module = trainer.module
    low = [n for n, v in plugin.resolved_policy.items() if v == "low"]
    assert len(plugin._te_linears) == len(low) == 14  # tiny-dense: 7 linears x 2 layers
    weights = {id(m.weight) for m in plugin._te_linears}
    assert weights <= {id(p) for p in module.parameters()}  # shared, not copied
    assert not any("te" in n.split(".") for n, _ in module.named_parameters())
    # 2 steps x 2 microbatches x 14 layers forward
    assert FakeLinear.calls == 2 * 2 * 14
    assert all(type(r).__name__ == "DelayedScaling" for r in FakeAutocast.recipes)
    assert rec.losses[1] < rec.losses[0] + 1.0 and all(torch.isfinite(torch.tensor(rec.losses)))


def test_fp8_region_uses_the_newer_autocast_where_transformer_engine_has_it():
    from nanotrain.precision.te import te_fp8_context

    seen = []

    def new_autocast(enabled=True, calibrating=False, recipe=None, amax_reduction_group=None):
        seen.append(("autocast", recipe))
        return contextlib.nullcontext()

    def old_autocast(enabled=True, calibrating=False, fp8_recipe=None, fp8_group=None):
        seen.append(("fp8_autocast", fp8_recipe))
        return contextlib.nullcontext()

    with te_fp8_context(
        types.SimpleNamespace(autocast=new_autocast, fp8_autocast=old_autocast), "r1"
    ):
        pass
    with te_fp8_context(types.SimpleNamespace(fp8_autocast=old_autocast), "r2"):
        pass
    # an `autocast` without a recipe argument is not TE's fp8 one: keep fp8_autocast
    with te_fp8_context(
        types.SimpleNamespace(autocast=lambda enabled=True: None, fp8_autocast=old_autocast), "r3"
    ):
        pass
    assert seen == [("autocast", "r1"), ("fp8_autocast", "r2"), ("fp8_autocast", "r3")]
