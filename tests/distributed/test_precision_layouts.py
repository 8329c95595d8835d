"""Precision plugins under DDP, Megatron dp (ZeRO-1, ZeRO-2, ep=2) and DualPipeV (pp=2) on one
2-rank gloo world, against the same precision in one process; the bf16 reduce option;
bf16-true resume.

Why most cells hold an fp32 bound even in bf16, fp16 and fp8: every run here takes microbatches
of one sample, so one process and each layout run every low-precision GEMM on the same rows
(a data-parallel rank reads samples 0 and 2 of a global batch, one process 0, 1, 2, 3; with
two samples per microbatch they would pair up differently, and a low-precision GEMM's rounded
output depends on which rows share it). The per-microbatch loss weights differ by exactly 2 (a
power of two, exact in every dtype). What is left is fp32 arithmetic in another order: the sum
of the four per-sample gradients (and, under ZeRO, the sharded grad norm): two orders of
summing four fp32 terms differ by at most about 6 u32 (u32 = 2^-24 = 6e-8) of the sum of their
magnitudes, which AdamW amplifies for elements whose gradient is ~0 (see
test_megatron.assert_matches).

Two kinds of cell round low-precision values differently, and take a bound of their dtype:
expert parallelism regroups tokens into other expert GEMMs, and DualPipeV computes the weight
gradients apart from the input gradients (its split backward), which rounds them differently
on some kernels (measured: bitwise equal in fp16 and fp8 on ATen's default kernels, 1e-4 apart
in fp8 on AVX2).
"""

from __future__ import annotations

import pytest
import torch

import nanotrain as nt
from nanotrain.parallel.data_parallel import GradBuckets
from nanotrain.precision import BF16Mixed, BF16True, FP16Mixed, resolve_precision
from nanotrain.strategies.ddp import DDPStrategy
from nanotrain.strategies.megatron import MegatronStrategy
from tests.distributed.selection import selected
from tests.distributed.spawn import run_world
from tests.precision_helpers import VOCAB, fit

# layout against one process under numerical bounds (.ci/run reruns the `kernels` subset)
pytestmark = [pytest.mark.distributed, pytest.mark.numerics]

STEPS = 3
# Same rows (fp32 order only): 1e-5, the suite's fp32 bound, where the weights the forward
# reads are fp32 (bf16-mixed, 16-mixed, fp8-emulated). Under bf16-true the weights are bf16
# copies of fp32 masters: a master that lands 1e-7 away from one process's flips to the
# neighbouring bf16 number now and then (one weight moves by 2^-8 of itself), so 1e-4.
# Measured worst relative loss difference over 3 steps, on ATen's default, AVX2 and AVX512
# kernels and with the reference on 1 and 2 threads (tests/numerics_log.py): fp32 weights
# 2.4e-6, bf16 weights 6.4e-6 (ZeRO-1); many cells are bitwise equal.
SAME, SAME_BF16_WEIGHTS = 1e-5, 1e-4
# Regrouped rows: each differently grouped GEMM output (and each gradient element from it)
# differs by up to one unit roundoff of its dtype (bf16 2^-8 = 3.9e-3, fp16 2^-11 = 4.9e-4 at
# its normal range, far more for gradients the loss scale leaves subnormal, e4m3 2^-4), and
# AdamW's per-element normalisation passes a relative gradient error straight into the next
# updates. Measured worst over the same settings: bf16 2.5e-4 (the bf16 wire), fp16 3.4e-4
# (ep=2, AVX512; 9.5e-5 on ATen's default kernels), fp8-emulated 1.7e-4 (ep=2). A wrong
# gradient or a lost update changes the loss by >1e-2: each bound sits 3-30x above what was
# measured and 2-10x below that.
BF16_TOL, FP16_TOL, FP8_TOL = 1e-3, 1e-3, 5e-3


def fp16_low_scale():
    # 2**16 sits at the edge of fp16 overflow for the MoE preset: whether step 1 overflows
    # then depends on how tokens are grouped into expert GEMMs, i.e. on the layout
    return FP16Mixed(init_scale=2.0**8)


def _dualpipev() -> MegatronStrategy:
    return MegatronStrategy(pp=2, schedule="dualpipev", pipeline_layout=[1, 0, 1, 0])


# (case, precision name, precision factory, strategy factory, preset, relative tolerance)
CASES = [
    ("ddp", "bf16-mixed", None, lambda: DDPStrategy(), "tiny-dense", SAME),
    ("ddp", "bf16-true", None, lambda: DDPStrategy(), "tiny-dense", SAME_BF16_WEIGHTS),
    ("ddp", "16-mixed", None, lambda: DDPStrategy(), "tiny-dense", SAME),
    # fp8-emulated keeps fp32 weights: under DDP it reduces as "ddp bf16-mixed" and "ddp
    # 16-mixed" do; its distributed cells are ep2's and dualpipev's below
    ("zero1", "bf16-true", None, lambda: MegatronStrategy(zero_stage=1), "tiny-dense", SAME_BF16_WEIGHTS),
    ("zero1", "16-mixed", None, lambda: MegatronStrategy(zero_stage=1), "tiny-dense", SAME),
    ("zero2", "bf16-mixed", None, lambda: MegatronStrategy(zero_stage=2), "tiny-dense", SAME),
    ("ep2", "bf16-true", None, lambda: MegatronStrategy(ep=2, zero_stage=1), "tiny", BF16_TOL),
    ("ep2", "16-mixed@2^8", fp16_low_scale, lambda: MegatronStrategy(ep=2), "tiny", FP16_TOL),
    ("ep2", "fp8-emulated", None, lambda: MegatronStrategy(ep=2), "tiny", FP8_TOL),
    # DualPipeV (pp=2, 4 microbatches of 1: its split backwards and V turn): the MoE preset's
    # two layers on stages 0 and 2, rank 0 also holding the head and MTP
    ("dualpipev", "bf16-true", None, lambda: _dualpipev(), "tiny", BF16_TOL),
    ("dualpipev", "16-mixed@2^8", fp16_low_scale, lambda: _dualpipev(), "tiny", FP16_TOL),
    ("dualpipev", "fp8-emulated", None, lambda: _dualpipev(), "tiny", FP8_TOL),
]  # fmt: skip
# one sample per microbatch everywhere (see the module docstring); DualPipeV needs at least
# 2·pp microbatches, which the global batch of 4 then gives
MICRO = 1


def make_precision(name, factory):
    return factory() if factory is not None else resolve_precision(name)


class SaveAtEnd(nt.Callback):
    """Writes a checkpoint when training ends (before the strategy is torn down)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_end(self, trainer, module) -> None:
        self.path = trainer.save_checkpoint(self.path)


class WithUnusedParameter(nt.LanguageModelModule):
    """The tiny dense model plus a trainable parameter that no loss depends on."""

    def __init__(self) -> None:
        super().__init__("tiny-dense", vocab_size=VOCAB, lr=1e-2, warmup_steps=2)
        self.spare = torch.nn.Parameter(torch.zeros(8))


# rerun by .ci/run on ATen's default kernels (marker `kernels`), one cell per kind of bound:
# fp32 order with fp32 weights (ddp 16-mixed, a loss scale and fp16 casts on top), with bf16
# weights (zero1 bf16-true), regrouped fp16 rows under ep (ep2 16-mixed: the bound most
# sensitive to the kernels, see FP16_TOL) and DualPipeV's split backward in fp8 (the one cell
# measured to round apart between kernels). The other cells' bounds are the same functions of
# the same arithmetic on other layouts.
KERNELS = ("ddp 16-mixed", "zero1 bf16-true", "ep2 16-mixed@2^8", "dualpipev fp8-emulated")
CELLS = {f"{c[0]} {c[1]}": c for c in CASES}
# the bf16 wire and bucket checks compare with these cells' runs
EXTRAS_NEED = ("ddp bf16-mixed", "ddp bf16-true", "zero2 bf16-mixed")


def _run_cases(rank: int, world: int, root: str, cells: list[str], extras: bool) -> dict:
    out = {}
    for cell in cells:
        _, name, factory, make, preset, _ = CELLS[cell]
        plugin = make_precision(name, factory)
        _, rec = fit(
            plugin, make(), steps=STEPS, root=f"{root}/{cell}", preset=preset, micro_batch=MICRO
        )
        out[cell] = rec.losses
    if not extras:
        return out
    # the bf16 wire dtype: close to the fp32 reduction, but not the same numbers
    for key, make in (
        ("reduce_bf16_megatron", lambda: MegatronStrategy(zero_stage=2)),
        ("reduce_bf16_ddp", lambda: DDPStrategy()),
    ):
        plugin = BF16Mixed(reduce_dtype=torch.bfloat16)
        _, rec = fit(plugin, make(), steps=STEPS, root=f"{root}/{key}", micro_batch=MICRO)
        out[key] = rec.losses
    # bf16-true under DDP: fp32 main grads in many small buckets, each launched from the
    # gradient hooks while backward still runs (recorded per run): with two microbatches per
    # rank (as CASES) on the fp32 and the bf16 wire, with one (two samples), and with a
    # parameter that never gets a gradient
    launches: list[bool] = []  # per bucket launch: inside backward?
    launch = GradBuckets._launch

    def recording_launch(self, b):
        launches.append(torch._C._current_graph_task_id() != -1)
        return launch(self, b)

    runs = {
        "ddp_buckets": ("bf16-true", MICRO, None),
        "ddp_buckets_bf16_wire": (BF16True(reduce_dtype=torch.bfloat16), MICRO, None),
        "ddp_buckets_one_microbatch": ("bf16-true", 2, None),
        "ddp_buckets_unused": ("bf16-true", 2, WithUnusedParameter()),
    }
    GradBuckets._launch = recording_launch
    try:
        for key, (plugin, micro, module) in runs.items():
            launches.clear()
            _, rec = fit(
                plugin,
                DDPStrategy(bucket_cap_mb=0.01),
                steps=STEPS,
                root=f"{root}/{key}",
                micro_batch=micro,
                module=module,
            )
            out[key] = (rec.losses, list(launches))
    finally:
        GradBuckets._launch = launch
    # bf16-true under ZeRO-2: 4 steps straight vs 2 + resume + 2 (fp32 masters restored)
    straight = fit("bf16-true", MegatronStrategy(zero_stage=2), steps=4, root=f"{root}/s")[1]
    saver = SaveAtEnd(f"{root}/r/ckpt")
    fit("bf16-true", MegatronStrategy(zero_stage=2), steps=2, root=f"{root}/r", callbacks=[saver])
    path = saver.path
    resumed = fit(
        "bf16-true", MegatronStrategy(zero_stage=2), steps=4, root=f"{root}/r", ckpt_path=path
    )[1]
    out["resume"] = (straight.losses, resumed.losses)
    return out


@pytest.fixture(scope="module")
def world(request, tmp_path_factory) -> list[dict]:
    cells = selected(request, "cell", CELLS)  # the selected tests' cells only
    extras = any(
        item.module is request.module and item.name == test_bf16_wire_buckets_and_resume.__name__
        for item in request.session.items
    )
    if extras:
        cells = [c for c in CELLS if c in cells or c in EXTRAS_NEED]
    root = str(tmp_path_factory.mktemp("w2"))
    return run_world(_run_cases, 2, root, cells, extras, timeout=600)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """`reference(name, preset, micro)`: one process's losses, each computed once."""
    root, done = str(tmp_path_factory.mktemp("ref")), {}

    def losses(name: str, preset: str = "tiny-dense", micro: int = MICRO, factory=None):
        if (name, preset, micro) not in done:
            plugin = make_precision(name, factory)
            _, rec = fit(plugin, "single", steps=STEPS, root=root, preset=preset, micro_batch=micro)
            done[(name, preset, micro)] = rec.losses
        return done[(name, preset, micro)]

    return losses


@pytest.mark.parametrize(
    "cell", [pytest.param(c, marks=[pytest.mark.kernels] if c in KERNELS else []) for c in CELLS]
)
def test_precisions_under_ddp_zero_and_ep_match_one_process(world, reference, cell):
    _, name, factory, _, preset, tol = CELLS[cell]
    assert world[0][cell] == world[1][cell], cell
    torch.testing.assert_close(
        torch.tensor(world[0][cell]),
        torch.tensor(reference(name, preset, MICRO, factory)),
        rtol=tol,
        atol=0,
        msg=cell,
    )


def test_bf16_wire_buckets_and_resume(world, reference):
    results = world
    ref = torch.tensor(reference("bf16-mixed"))
    # same layout with the fp32 wire (Megatron ZeRO-2 and DDP, bf16-mixed). The bf16 wire
    # rounds each summed gradient element once (relative 2^-8): bf16's bound
    for key, same_layout in (
        ("reduce_bf16_megatron", "zero2 bf16-mixed"),
        ("reduce_bf16_ddp", "ddp bf16-mixed"),
    ):
        got = torch.tensor(results[0][key])
        torch.testing.assert_close(got, ref, rtol=BF16_TOL, atol=0, msg=key)
        fp32_wire = torch.tensor(results[0][same_layout])
        assert not torch.equal(got[1:], fp32_wire[1:]), f"{key}: the bf16 wire changed nothing"
    # DDP bf16-true: small buckets sum the same fp32 values per element as the "ddp bf16-true"
    # cell's one 25 MB bucket; with two microbatches per rank the first only accumulates and
    # the last sends every bucket from backward's hooks, once per step
    losses, launched = results[0]["ddp_buckets"]
    assert losses == results[0]["ddp bf16-true"]
    one_microbatch, launched_once = results[0]["ddp_buckets_one_microbatch"]
    buckets = len(launched_once) // STEPS
    assert buckets >= 8 and len(launched_once) == buckets * STEPS and all(launched_once)
    assert len(launched) == buckets * STEPS and all(launched)
    ref = torch.tensor(reference("bf16-true"))
    got, _ = results[0]["ddp_buckets_bf16_wire"]
    torch.testing.assert_close(torch.tensor(got), ref, rtol=BF16_TOL, atol=0)
    assert not torch.equal(torch.tensor(got[1:]), torch.tensor(losses[1:])), "bf16 wire: no change"
    # one microbatch of two samples per rank: the rows pair up unlike one process's (bf16's bound)
    ref = torch.tensor(reference("bf16-true", micro=2))
    torch.testing.assert_close(torch.tensor(one_microbatch), ref, rtol=BF16_TOL, atol=0)
    # a parameter without a gradient holds its bucket back until after backward (`finish`)
    got, launched = results[0]["ddp_buckets_unused"]
    assert got == one_microbatch
    assert len(launched) > buckets * STEPS and not all(launched) and any(launched)
    straight, resumed = results[0]["resume"]
    assert resumed == straight[2:]  # exact: the fp32 masters came back from the checkpoint
