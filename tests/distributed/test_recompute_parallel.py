"""Activation recomputation under tp=2 and pp=2 (1F1B, interleaved, DualPipeV) matches one process
without recomputation, step for step (losses, grad norms, final parameters). So do the routed
experts' fp8 options against one process with the same option: their saves in fp8
(`fp8_expert_activations`) under ep=2 and DualPipeV, and their dispatch in fp8
(`fp8_dispatch`) under ep=2 (on the wire) and DualPipeV (no ep: rounded as the wire would)."""

from __future__ import annotations

import pytest
import torch

import nanotrain as nt
from nanotrain.strategies.megatron import MegatronStrategy
from tests.distributed.selection import selected
from tests.distributed.spawn import run_world
from tests.distributed.test_pipeline import LAYERS, STEPS, _check, fit_module

# layout against one process under numerical bounds (.ci/run reruns the `kernels` subset)
pytestmark = [pytest.mark.distributed, pytest.mark.numerics]

TP2_SP, DUALPIPEV = dict(tp=2, sequence_parallel=True), dict(pp=2, schedule="dualpipev")
LIGHT_FP8 = {"recompute": "light", "fp8_expert_activations": True}
FP8_DISPATCH = {"fp8_dispatch": True}
# name -> (MegatronStrategy kwargs, LanguageModelModule options)
LAYOUTS = {
    "tp=2 sp full": (TP2_SP, {"recompute": "full"}),
    "tp=2 selective": (dict(tp=2), {"recompute": "selective"}),
    "pp=2 1f1b full": (dict(pp=2), {"recompute": "full"}),
    "pp=2 x virtual 2 selective": (dict(pp=2, virtual_pp=2), {"recompute": "selective"}),
    # rebuilt norm shards, MLA heads and SwiGLU products; under DualPipeV's split backward the
    # weight half unpacks what the input half already rebuilt
    "tp=2 sp light": (TP2_SP, {"recompute": "light"}),
    "pp=2 dualpipev light": (DUALPIPEV, {"recompute": "light"}),
    # the rows and SwiGLU inputs kept in fp8: the same rounding wherever the experts run.
    # The fp8 tiles are cut inside the experts (`GroupedExperts`), from whichever rows reach
    # them, with no tp code: ep's dispatched rows and DualPipeV's split backward here; tp=2
    # with sp (a sequence shard's rows, light recompute) is "tp=2 sp light" above, in fp32
    "ep=2 light fp8": (dict(ep=2), LIGHT_FP8),
    "pp=2 dualpipev light fp8": (DUALPIPEV, LIGHT_FP8),
    "ep=2 fp8 dispatch": (dict(ep=2), FP8_DISPATCH),
    "pp=2 dualpipev fp8 dispatch": (DUALPIPEV, FP8_DISPATCH),
}
# Under tp each rank runs every layer on every microbatch: these layouts (recompute in fp32)
# train the preset's own 2 layers (one dense, one MoE: each kind of layer once; more layers
# repeat the same recomputation) in 2 microbatches of 4, against one process doing the same
# (`reference_short`). The pipelines keep `LAYERS` (a layer on every stage and chunk) and
# microbatches of 2 (at least 2 · pp of them), as do the fp8 layouts, whose bounds were
# measured on that model.
SHORT = {"tp=2 sp full", "tp=2 selective", "tp=2 sp light"}
SHORT_LAYERS, SHORT_MICRO = 2, 4
FP8_SAVES = [name for name, (_, options) in LAYOUTS.items() if options is LIGHT_FP8]
DISPATCH = [name for name, (_, options) in LAYOUTS.items() if options is FP8_DISPATCH]
# rerun by .ci/run on ATen's default kernels (marker `kernels`): one layout per kind of bound,
# recompute in fp32 under tp with sp, the fp8 saves and the fp8 dispatch under ep (the other
# layouts' bounds are the same functions of the same arithmetic)
KERNELS = {"tp=2 sp full", "ep=2 light fp8", "ep=2 fp8 dispatch"}


def _params(names: list[str]) -> list:
    return [pytest.param(n, marks=[pytest.mark.kernels] if n in KERNELS else []) for n in names]


def _module(layers: int = LAYERS, **options):
    return nt.LanguageModelModule(
        "tiny",
        vocab_size=257,
        lr=3e-3,
        warmup_steps=2,
        model_overrides={"num_layers": layers},
        **options,
    )


def _fit(name: str | None, strategy, root: str, **options) -> dict:
    """`fit_module` on `_module(**options)`: the short model in microbatches of 4 for the
    `SHORT` layouts (and their reference, `name` None), `LAYERS` layers in 2s otherwise."""
    short = name is None or name in SHORT
    layers, micro = (SHORT_LAYERS, SHORT_MICRO) if short else (LAYERS, 2)
    return fit_module(_module(layers, **options), strategy, root, micro_batch_size=micro)


def _run(rank: int, world_size: int, root: str, names: list[str]) -> dict:
    out = {}
    for i, name in enumerate(names):
        kw, options = LAYOUTS[name]
        out[name] = _fit(name, MegatronStrategy(**kw), f"{root}/{i}", **options)
    return out


@pytest.fixture(scope="module")
def world2(request, tmp_path_factory) -> list[dict]:
    names = selected(request, "layout", LAYOUTS)  # the selected tests' layouts only
    return run_world(_run, 2, str(tmp_path_factory.mktemp("w2")), names, timeout=240)


def _single_process(tmp_path_factory, name: str, **options) -> dict:
    root = str(tmp_path_factory.mktemp(name))
    return fit_module(_module(**options), nt.SingleDeviceStrategy("cpu"), root)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    return _single_process(tmp_path_factory, "ref")


@pytest.fixture(scope="module")
def reference_short(tmp_path_factory) -> dict:
    """One process as the `SHORT` layouts run: 2 layers, microbatches of 4."""
    root = str(tmp_path_factory.mktemp("ref_short"))
    return _fit(None, nt.SingleDeviceStrategy("cpu"), root)


@pytest.fixture(scope="module")
def reference_fp8(tmp_path_factory) -> dict:
    return _single_process(tmp_path_factory, "ref_fp8", **LIGHT_FP8)


@pytest.fixture(scope="module")
def reference_dispatch(tmp_path_factory) -> dict:
    return _single_process(tmp_path_factory, "ref_dispatch", **FP8_DISPATCH)


@pytest.mark.parametrize("layout", _params([n for n in LAYOUTS if n not in FP8_SAVES + DISPATCH]))
def test_recompute_layout_matches_single_process(request, world2, layout):
    reference = request.getfixturevalue("reference_short" if layout in SHORT else "reference")
    for rank, result in enumerate(world2):
        _check(result[layout], reference, f"{layout}, rank {rank}")


@pytest.mark.parametrize("layout", _params(DISPATCH))
def test_fp8_dispatch_matches_single_process_with_it(world2, reference_dispatch, reference, layout):
    # the rows are rounded before any expert reads them, on one rank as on the wire; what is
    # left is the experts' GEMM grouping, which may land a row element on another e4m3 number
    for rank, result in enumerate(world2):
        _check_fp8(result[layout], reference_dispatch, f"{layout}, rank {rank}")
    with pytest.raises(AssertionError):  # the rounding changes the run, from its first loss
        _check_fp8(reference, reference_dispatch, "without fp8 dispatch")


LR = 3e-3  # _module's learning rate


def _check_fp8(result: dict, reference: dict, what: str) -> None:
    """The fp8 layouts (expert saves or dispatch in fp8) against one process with the same
    option. e4m3 keeps 3 mantissa bits: neighbouring numbers lie 2^-3 of a value apart. A value
    the layout computes in another fp32 order (1e-7 away) lands now and then on the neighbour
    of one process's, which moves that element by an eighth of itself, and AdamW may turn that
    into a visible step of one weight. How many such flips a run has depends on the CPU's
    kernels (ATen's default, AVX2, AVX512, thread count; other CPUs' BLAS): the bounds allow
    flips. Measured worst over those six settings (tests/numerics_log.py): losses 4.6e-7, grad
    norms of steps 1-2 1.5e-5, of step 3 6.7e-5, the logged validation terms 5.2e-6. What
    dropping the rounding moves (the `pytest.raises` checks): losses 4.7e-5 (dispatch) and
    1.2e-4 (saves), grad norms 2.6e-3 (steps 1-2) and 1.1e-2 (step 3), per-parameter grad norms
    1e-2. Each bound sits between."""
    torch.testing.assert_close(result["losses"], reference["losses"], rtol=1e-5, atol=0, msg=what)
    got, want = result["grad_norms"], reference["grad_norms"]
    torch.testing.assert_close(got[:2], want[:2], rtol=1e-4, atol=0, msg=what)
    torch.testing.assert_close(got[2:], want[2:], rtol=2e-3, atol=0, msg=what)
    assert result["named"].keys() == reference["named"].keys(), what
    for name, value in reference["named"].items():
        assert abs(result["named"][name] - value) <= 2e-3 * value + 1e-7, f"{what}: {name}"
    assert result["logged"].keys() == reference["logged"].keys(), what
    for name, value in reference["logged"].items():
        assert result["logged"][name] == pytest.approx(value, rel=1e-4), f"{what}: {name}"
    # weights: all but one in twenty elements of each within 1e-4 + 1e-4 relative, none
    # further than AdamW can move two runs apart (2 lr per step). One flipped element of a
    # saved row changes a whole row of its weight's gradient slightly, and AdamW turns that
    # into steps of up to lr where the gradient is ~0; routing scores pass it on to the router
    # gate (measured worst: 25 of 16,384 elements of an expert's gate_proj, 7 of the router
    # gate's 512, 1.4%); a wrong gradient moves most elements
    assert result["params"].keys() == reference["params"].keys(), what
    for name, value in reference["params"].items():
        mine = result["params"][name][: value.shape[0]]  # a vocab-parallel head is padded
        diff = (mine - value).abs()
        off = int((diff > 1e-4 + 1e-4 * value.abs()).sum())
        assert off <= max(2, value.numel() // 20), f"{what}: {name}: {off} elements off"
        assert float(diff.max()) <= 2 * LR * STEPS, f"{what}: {name} by {float(diff.max())}"


@pytest.mark.parametrize("layout", _params(FP8_SAVES))
def test_fp8_expert_saves_match_single_process_with_them(world2, reference_fp8, reference, layout):
    for rank, result in enumerate(world2):
        _check_fp8(result[layout], reference_fp8, f"{layout}, rank {rank}")
    # the rounding reaches the gradients: the run is not the one without fp8 saves
    assert reference_fp8["losses"][0] == reference["losses"][0]  # forward is exact
    with pytest.raises(AssertionError):
        _check_fp8(reference, reference_fp8, "without fp8 saves")
