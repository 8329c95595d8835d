"""Precision plugins under DDP, Megatron dp (ZeRO-1, ZeRO-2, ep=2) and DualPipeV (pp=2) on one
2-rank gloo world, against the same precision in one process; the bf16 reduce option;
bf16-true resume.

Why fp32-level tolerances hold even for bf16 here: with the same global batch, one process
runs two microbatches and each of two data-parallel ranks runs one of them; every forward and
backward is the same computation on the same microbatch, and the per-microbatch loss weights
differ by exactly 2 (a power of two, exact in bf16). Only the fp32 summation of the two
microbatch gradients changes order. Expert parallelism regroups tokens into different GEMMs,
so ep cells use the bf16 tolerance.
"""

from __future__ import annotations

import pytest
import torch

import nanotrain as nt
from nanotrain.parallel.data_parallel import GradBuckets
from nanotrain.precision import BF16Mixed, BF16True, FP16Mixed, resolve_precision
from nanotrain.strategies.ddp import DDPStrategy
from nanotrain.strategies.megatron import MegatronStrategy
from tests.distributed.spawn import run_world
from tests.precision_helpers import VOCAB, fit

STEPS = 3
# Measured max relative loss differences against one process over 3 steps: bf16 ~1.5e-4
# (the data-parallel ranks batch different samples together, and bf16 CPU GEMMs do not give
# row results independent of the other rows), fp16 ~4e-6 (3e-5 under ep), emulated fp8 ~1.4e-3 (the same, plus
# per-tile scales rounding differently). Bounds: a few times the measured value; a wrong
# gradient or lost update changes the loss by >1e-2.
BF16_TOL, FP16_TOL, FP8_TOL = 1e-3, 1e-4, 5e-3


def fp16_low_scale():
    # 2**16 sits at the edge of fp16 overflow for the MoE preset: whether step 1 overflows
    # then depends on how tokens are grouped into expert GEMMs, i.e. on the layout
    return FP16Mixed(init_scale=2.0**8)


def _dualpipev() -> MegatronStrategy:
    return MegatronStrategy(pp=2, schedule="dualpipev", pipeline_layout=[1, 0, 1, 0])


# (case, precision name, precision factory, strategy factory, preset, relative tolerance)
CASES = [
    ("ddp", "bf16-mixed", None, lambda: DDPStrategy(), "tiny-dense", BF16_TOL),
    ("ddp", "bf16-true", None, lambda: DDPStrategy(), "tiny-dense", BF16_TOL),
    ("ddp", "16-mixed", None, lambda: DDPStrategy(), "tiny-dense", FP16_TOL),
    ("ddp", "fp8-emulated", None, lambda: DDPStrategy(), "tiny-dense", FP8_TOL),
    ("zero1", "bf16-true", None, lambda: MegatronStrategy(zero_stage=1), "tiny-dense", BF16_TOL),
    ("zero1", "16-mixed", None, lambda: MegatronStrategy(zero_stage=1), "tiny-dense", FP16_TOL),
    ("zero2", "bf16-mixed", None, lambda: MegatronStrategy(zero_stage=2), "tiny-dense", BF16_TOL),
    ("ep2", "bf16-true", None, lambda: MegatronStrategy(ep=2, zero_stage=1), "tiny", BF16_TOL),
    ("ep2", "16-mixed@2^8", fp16_low_scale, lambda: MegatronStrategy(ep=2), "tiny", FP16_TOL),
    ("ep2", "fp8-emulated", None, lambda: MegatronStrategy(ep=2), "tiny", FP8_TOL),
    # DualPipeV (pp=2, 4 microbatches of 1: its split backwards and V turn): the MoE preset's
    # two layers on stages 0 and 2, rank 0 also holding the head and MTP
    ("dualpipev", "bf16-true", None, lambda: _dualpipev(), "tiny", BF16_TOL),
    ("dualpipev", "16-mixed@2^8", fp16_low_scale, lambda: _dualpipev(), "tiny", FP16_TOL),
    ("dualpipev", "fp8-emulated", None, lambda: _dualpipev(), "tiny", FP8_TOL),
]  # fmt: skip
# DualPipeV needs at least 2·pp microbatches: the global batch of 4 in microbatches of 1
MICRO_BATCH = {"dualpipev": 1}


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


def _run_cases(rank: int, world: int, root: str) -> dict:
    out = {}
    for i, (case, name, factory, make, preset, _) in enumerate(CASES):
        plugin = make_precision(name, factory)
        micro = MICRO_BATCH.get(case, 2)
        _, rec = fit(
            plugin, make(), steps=STEPS, root=f"{root}/{i}", preset=preset, micro_batch=micro
        )
        out[i] = rec.losses
    # the bf16 wire dtype: close to the fp32 reduction, but not the same numbers
    for key, make in (
        ("reduce_bf16_megatron", lambda: MegatronStrategy(zero_stage=2)),
        ("reduce_bf16_ddp", lambda: DDPStrategy()),
    ):
        plugin = BF16Mixed(reduce_dtype=torch.bfloat16)
        _, rec = fit(plugin, make(), steps=STEPS, root=f"{root}/{key}")
        out[key] = rec.losses
    # bf16-true under DDP: fp32 main grads in many small buckets, each launched from the
    # gradient hooks while backward still runs (recorded per run): on the fp32 and the bf16
    # wire, with two microbatches per rank, and with a parameter that never gets a gradient
    launches: list[bool] = []  # per bucket launch: inside backward?
    launch = GradBuckets._launch

    def recording_launch(self, b):
        launches.append(torch._C._current_graph_task_id() != -1)
        return launch(self, b)

    runs = {
        "ddp_buckets": ("bf16-true", 2, None),
        "ddp_buckets_bf16_wire": (BF16True(reduce_dtype=torch.bfloat16), 2, None),
        "ddp_buckets_accumulated": ("bf16-true", 1, None),
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
def references(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("ref"))
    refs = {}
    wanted = {(c[1], c[2], c[4]) for c in CASES} | {("bf16-mixed", None, "tiny-dense")}
    for name, factory, preset in wanted:
        plugin = make_precision(name, factory)
        refs[(name, preset)] = fit(plugin, "single", steps=STEPS, root=root, preset=preset)[
            1
        ].losses
    return refs


def test_precisions_under_ddp_zero_and_ep_match_one_process(tmp_path, references):
    results = run_world(_run_cases, 2, str(tmp_path), timeout=600)
    for i, (case, name, _, _, preset, tol) in enumerate(CASES):
        assert results[0][i] == results[1][i], (case, name)
        torch.testing.assert_close(
            torch.tensor(results[0][i]),
            torch.tensor(references[(name, preset)]),
            rtol=tol,
            atol=0,
            msg=f"{case} {name}",
        )
    ref = torch.tensor(references[("bf16-mixed", "tiny-dense")])
    # same layout with the fp32 wire: CASES 6 (Megatron ZeRO-2) and 0 (DDP), bf16-mixed
    for key, same_layout in (("reduce_bf16_megatron", 6), ("reduce_bf16_ddp", 0)):
        got = torch.tensor(results[0][key])
        torch.testing.assert_close(got, ref, rtol=BF16_TOL, atol=0, msg=key)
        fp32_wire = torch.tensor(results[0][same_layout])
        assert not torch.equal(got[1:], fp32_wire[1:]), f"{key}: the bf16 wire changed nothing"
    # DDP bf16-true: small buckets sum the same two fp32 values per element as CASES 1's one
    # 25 MB bucket, and every bucket is sent from backward's hooks, once per step
    losses, launched = results[0]["ddp_buckets"]
    assert losses == results[0][1]
    assert len(launched) >= 2 * 4 * STEPS and all(launched), "buckets waited for backward"
    buckets = len(launched) // STEPS
    ref = torch.tensor(references[("bf16-true", "tiny-dense")])
    got, _ = results[0]["ddp_buckets_bf16_wire"]
    torch.testing.assert_close(torch.tensor(got), ref, rtol=BF16_TOL, atol=0)
    assert not torch.equal(torch.tensor(got[1:]), torch.tensor(losses[1:])), "bf16 wire: no change"
    # two microbatches per rank: the first only accumulates, the last sends each bucket once
    got, launched = results[0]["ddp_buckets_accumulated"]
    torch.testing.assert_close(torch.tensor(got), ref, rtol=BF16_TOL, atol=0)
    assert len(launched) == buckets * STEPS and all(launched)
    # a parameter without a gradient holds its bucket back until after backward (`finish`)
    got, launched = results[0]["ddp_buckets_unused"]
    assert got == losses
    assert len(launched) > buckets * STEPS and not all(launched) and any(launched)
    straight, resumed = results[0]["resume"]
    assert resumed == straight[2:]  # exact: the fp32 masters came back from the checkpoint
