"""Sequence parallelism through the real models, and how much tensor parallelism communicates.

1. MegatronStrategy with ``sequence_parallel=True`` (tp=2 x dp=2 with ZeRO-1 or ZeRO-2)
   trains the ``tiny`` DeepSeek preset (MLA + MoE + MTP) and ``tiny-dense`` for 3 steps exactly
   like one process: losses, grad norms (global and per parameter), gathered parameters (via
   the helpers of ``test_megatron``) and the aux-loss-free router biases.
2. One forward of a sharded model equals the unsharded model's: logits, loss, the (tiny)
   sequence-wise balance loss, MTP loss, and the expert loads the bias update counts.
3. Counting the collectives a model issues: a dense transformer layer costs 2 all-reduces
   forward and 2 backward under tensor parallelism (Megatron-LM), and 2 all-gathers plus 2
   reduce-scatters each way under sequence parallelism, with no all-reduce left.
"""

from __future__ import annotations

from collections import Counter
from contextlib import contextmanager
from typing import Any

import pytest
import torch
import torch.distributed as dist

import nanotrain as nt
import nanotrain.parallel.collectives as collectives
from nanotrain.models import build_model, presets
from nanotrain.parallel import ParallelMesh
from nanotrain.parallel.collectives import all_gather_along_dim
from nanotrain.strategies.megatron import MegatronStrategy
from tests.distributed.spawn import run_world
from tests.distributed.test_megatron import LM_VOCAB, assert_matches, fit

pytestmark = pytest.mark.distributed

SP = {"sequence_parallel": True}
# name -> (model kind, MegatronStrategy kwargs). No training layout on 2 ranks: tp=2 with sp
# alone is a part of each layout below (the partial grads and the expert loads summed over tp,
# then over dp), and dp=1 with sp trains like one process in test_layout_numbers ("tp=2 sp",
# the MoE preset) and test_document_mask_layouts (both presets); the 2-rank world runs the
# model checks
WORLD2: dict = {}
# sequence parallelism next to a dp axis, through ZeRO's reduce-scatter of the dp grads; the
# plain dp all-reduce under tp=2 is test_megatron's "tp=2 x dp=2" (both presets)
WORLD4 = {
    "deepseek zero2 tp=2 x dp=2 sp": ("tiny", dict(tp=2, zero_stage=2, **SP)),
    "dense zero1 tp=2 x dp=2 sp": ("tiny-dense", dict(tp=2, zero_stage=1, **SP)),
}
BIAS = "e_score_correction_bias"


def fit_with_biases(kind: str, strategy: Any, root: str) -> dict:
    """`test_megatron.fit`, plus the router biases the run ended with."""
    result = fit(kind, strategy, root)
    buffers = strategy.module.named_buffers()
    result["biases"] = {name: b.clone() for name, b in buffers if name.endswith(BIAS)}
    return result


# --------------------------------------------------------------------------------------------
# Counting collectives
# --------------------------------------------------------------------------------------------


@contextmanager
def counting_collectives():
    """Count the collectives nanotrain issues by kind ("all_reduce", "all_gather",
    "reduce_scatter"), into the yielded Counter. Patches this (forked) process only."""
    counts: Counter = Counter()
    patched = [
        (dist, "all_reduce", "all_reduce"),
        (collectives, "_all_gather_single", "all_gather"),
        (collectives, "_reduce_scatter_single", "reduce_scatter"),
    ]
    saved = [(mod, attr, getattr(mod, attr)) for mod, attr, _ in patched]

    def counted(fn, kind):
        def wrapper(*args, **kwargs):
            counts[kind] += 1
            return fn(*args, **kwargs)

        return wrapper

    for (mod, attr, fn), (_, _, kind) in zip(saved, patched, strict=True):
        setattr(mod, attr, counted(fn, kind))
    try:
        yield counts
    finally:
        for mod, attr, fn in saved:
            setattr(mod, attr, fn)


def traffic(config: Any, mesh: ParallelMesh, sp: bool) -> dict[str, Counter]:
    """Collectives of one training forward and of its backward, by kind."""
    model = build_model(config, mesh, sequence_parallel=sp).train()
    ids = torch.randint(0, config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
    with counting_collectives() as forward:
        out = model(ids, labels=ids)
    with counting_collectives() as backward:
        out.total_loss.backward()
    return {"forward": forward, "backward": backward}


def per_layer_traffic(kind: str, mesh: ParallelMesh, sp: bool, layers: int) -> dict[str, dict]:
    """Collectives per added decoder layer: the difference between `layers` and `layers + 2`
    layers, halved (the embedding, head, loss and MTP costs cancel out)."""
    small = traffic(presets.get(kind, num_layers=layers), mesh, sp)
    large = traffic(presets.get(kind, num_layers=layers + 2), mesh, sp)
    return {
        phase: {k: (large[phase][k] - small[phase][k]) / 2 for k in large[phase] | small[phase]}
        for phase in ("forward", "backward")
    }


# --------------------------------------------------------------------------------------------
# One forward of the sharded model against the unsharded one
# --------------------------------------------------------------------------------------------


FORWARD_CASES = {
    "tiny": {},
    "tiny-dense": {},
    # V2-style MLA: q_proj reads the hidden state (no query latent to gather with the others)
    "tiny q_lora_rank=None": {"q_lora_rank": None},
}


def sharded_forward_matches(case: str, mesh: ParallelMesh, sp: bool) -> dict[str, Any]:
    """Unsharded and tp-sharded models from the same seed on the same batch: the largest
    relative difference of each output, and the expert loads both count."""
    config = presets.get(case.split()[0], vocab_size=LM_VOCAB, **FORWARD_CASES[case])
    ids = torch.randint(0, LM_VOCAB, (3, 8), generator=torch.Generator().manual_seed(1))
    labels = ids.roll(-1, dims=1)
    models = [
        build_model(config, None, generator=torch.Generator().manual_seed(5)).train(),
        build_model(
            config, mesh, generator=torch.Generator().manual_seed(5), sequence_parallel=sp
        ).train(),
    ]
    outs = [m(ids, labels=labels) for m in models]
    logits = all_gather_along_dim(outs[1].logits.detach(), -1, mesh.tp_group)[..., :LM_VOCAB]
    rel = {"logits": float((logits - outs[0].logits).abs().max() / outs[0].logits.abs().max())}
    for name in ("loss", "aux_loss", "mtp_loss"):
        ref, got = getattr(outs[0], name), getattr(outs[1], name)
        if ref is not None:
            rel[name] = float((got - ref).abs() / ref.abs().clamp_min(1e-30))
            rel[f"{name} value"] = float(ref)
    loads = [m.update_router_biases() for m in models]
    return {
        "rel": rel,
        "loads": loads,
        "tokens_x_topk": ids.numel() * getattr(config, "num_experts_per_tok", 0),
    }


def _model_checks(rank: int, world_size: int) -> dict[str, Any]:
    mesh = ParallelMesh.build(tp=2)
    torch.manual_seed(0)
    out: dict[str, Any] = {}
    for sp in (False, True):
        out[f"dense sp={sp}"] = per_layer_traffic("tiny-dense", mesh, sp, layers=1)
        # first_k_dense_replace=1: every added layer is MLA + MoE (shared experts split over tp)
        out[f"deepseek sp={sp}"] = per_layer_traffic("tiny", mesh, sp, layers=2)
        for case in FORWARD_CASES:
            out[f"forward {case} sp={sp}"] = sharded_forward_matches(case, mesh, sp)
    model = build_model(presets.get("tiny-dense"), mesh, sequence_parallel=True)
    try:
        model(torch.zeros(1, 7, dtype=torch.long))
    except ValueError as err:
        out["odd length refused"] = str(err)
    return out


def _run_layouts(rank: int, world_size: int, root: str, layouts: dict) -> dict:
    results = {}
    for i, (name, (kind, kwargs)) in enumerate(layouts.items()):
        results[name] = fit_with_biases(kind, MegatronStrategy(**kwargs), f"{root}/{i}")
    if world_size == 2:
        results["model checks"] = _model_checks(rank, world_size)
    return results


# --------------------------------------------------------------------------------------------
# Fixtures: one single-process reference per preset, one forked world per size
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def references(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("reference")
    return {
        kind: fit_with_biases(kind, nt.SingleDeviceStrategy("cpu"), str(root / kind))
        for kind in ("tiny", "tiny-dense")
    }


@pytest.fixture(scope="module")
def world2(tmp_path_factory) -> list[dict]:
    return run_world(_run_layouts, 2, str(tmp_path_factory.mktemp("w2")), WORLD2, timeout=180)


@pytest.fixture(scope="module")
def world4(tmp_path_factory) -> list[dict]:
    return run_world(_run_layouts, 4, str(tmp_path_factory.mktemp("w4")), WORLD4, timeout=240)


def _assert_layout(result: dict, reference: dict, what: str) -> None:
    assert_matches(result, reference, what)
    assert result["biases"].keys() == reference["biases"].keys(), what
    for name, bias in reference["biases"].items():
        torch.testing.assert_close(result["biases"][name], bias, rtol=0, atol=0, msg=what)


# --------------------------------------------------------------------------------------------
# Tests
# --------------------------------------------------------------------------------------------


def test_reference_router_biases_moved(references):
    # otherwise comparing them below would prove nothing
    biases = references["tiny"]["biases"]
    assert biases and all(b.abs().sum() > 0 for b in biases.values())


@pytest.mark.parametrize("layout", list(WORLD4))
def test_sequence_parallel_with_dp_and_zero_matches_single_process(world4, references, layout):
    kind = WORLD4[layout][0]
    for rank, result in enumerate(world4):
        _assert_layout(result[layout], references[kind], f"{layout}, rank {rank}")


@pytest.mark.parametrize("case", list(FORWARD_CASES))
@pytest.mark.parametrize("sp", [False, True])
def test_sharded_forward_equals_unsharded(world2, case, sp):
    for rank, result in enumerate(world2):
        check = result["model checks"][f"forward {case} sp={sp}"]
        rel = check["rel"]
        for name in ("logits", "loss", "aux_loss", "mtp_loss"):
            if name in rel:
                assert rel[name] < 1e-5, f"rank {rank}, {name}: {rel}"
        if case.split()[0] == "tiny":  # the MoE models
            # the balance loss is compared on its own: it is ~1e-4 of the total loss
            assert rel["aux_loss value"] > 0
            reference_loads, loads = check["loads"]
            # every token copy of the batch is counted once per MoE layer (main stack + MTP)
            expected = torch.full((2,), check["tokens_x_topk"], dtype=reference_loads.dtype)
            assert torch.equal(reference_loads.sum(-1), expected)
            assert torch.equal(loads, reference_loads), f"rank {rank}"


def test_tensor_parallel_layer_communicates_twice_forward_and_twice_backward(world2):
    for result in world2:
        for kind in ("dense", "deepseek"):
            per_layer = result["model checks"][f"{kind} sp=False"]
            assert per_layer["forward"] == {"all_reduce": 2}, kind
            assert per_layer["backward"] == {"all_reduce": 2}, kind


def test_sequence_parallel_layer_replaces_all_reduces_by_gather_and_reduce_scatter(world2):
    for result in world2:
        per_layer = result["model checks"]["dense sp=True"]
        two_each = {"all_gather": 2, "reduce_scatter": 2}
        # backward gathers again each input its layers saved as this rank's shard
        regathered = {"all_gather": 4, "reduce_scatter": 2}
        assert {k: v for k, v in per_layer["forward"].items() if v} == two_each
        assert {k: v for k, v in per_layer["backward"].items() if v} == regathered
        # A DeepSeek MoE layer adds one small all-reduce: the per-sequence statistics of the
        # balance loss ([2, batch, experts]), which span both ranks' tokens.
        per_layer = result["model checks"]["deepseek sp=True"]
        assert {k: v for k, v in per_layer["forward"].items() if v} == {**two_each, "all_reduce": 1}
        assert {k: v for k, v in per_layer["backward"].items() if v} == regathered


def test_sequence_length_not_divisible_by_tp_is_refused(world2):
    for result in world2:
        assert "length 7 is not divisible by 2" in result["model checks"]["odd length refused"]
