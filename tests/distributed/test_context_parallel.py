"""Context parallelism (issue 52): every layout with cp > 1 trains, logs and validates as one
process does.

Data that can tell: samples keep different numbers of labels (the rest -100), so each
rank's chunks hold different numbers of live tokens and a chunk-local mean would weigh them
wrongly; the tiny DeepSeek (MLA, MoE with a sizeable sequence-wise balance loss, MTP whose
inputs and targets lie beyond a chunk's end) and the tiny dense model (GQA). One process
with micro batch 2 is the reference. ONE 2-rank world runs cp=2 with, on one model each,
ZeRO-3, recompute "light" and "full", bf16-mixed, 16-mixed and fp8-emulated (dense, each
against a reference in the same precision) and packed documents with document masking, eod
loss masking and MTP (MLA). ONE 4-rank world runs cp=4 (MLA), cp=2 x tp=2 with sequence
parallelism, cp=2 x pp=2 (zero-bubble 1F1B on MLA, DualPipeV on dense), cp=2 x ep=2 x dp=2
(MLA) and cp=2 x dp=2 with ZeRO-1 (dense). Per-step loss and grad norm, every logged `train/*` scalar, `val/loss`
over a validation set read whole, and the final weights must match.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import Dataset

import nanotrain as nt
from nanotrain.models import presets
from nanotrain.models.attention import DenseAttention, MLAttention
from nanotrain.models.layers import rope_cos_sin
from nanotrain.parallel import ParallelMesh
from nanotrain.parallel.context import causal_mask, chunk_positions
from nanotrain.planning.comm_meter import CommMeter
from nanotrain.strategies.megatron import MegatronStrategy
from tests.distributed.spawn import run_world

pytestmark = [pytest.mark.distributed, pytest.mark.numerics]

# 2 steps: step 2's loss reads the first update, the final weights the second, which reads
# AdamW's moments and the MoE biases that step 1 left; a third step would run the same code
# again. The measured figures below are worsts over 3 steps (steps 1-2 are the same numbers).
VOCAB, SEQ, STEPS, LR = 257, 16, 2, 1e-3
# bf16-mixed under cp regroups the GEMMs' rows (a rank multiplies its chunks' queries by all
# keys, its projections run on T / cp rows): each output moves by up to bf16's unit roundoff
# (2^-8), as for the regrouped rows of test_precision_layouts, whose bound this is (measured on
# the dense model: 2.9e-4 worst grad norm); a lost gradient term moves the loss by >1e-2
BF16_TOL = 1e-3
# fp16 (unit roundoff 2^-11) regroups the same rows: bf16's bound holds with margin; fp8
# (emulated e4m3, unit roundoff 2^-4) scales each tensor by the amax of what the rank holds, as
# test_precision_layouts' ep/DualPipeV fp8 cells do, and takes their bound (measured worst:
# fp16 1.3e-4, fp8 2.8e-3 under ATEN_CPU_CAPABILITY avx512 and avx2, 2.2e-3 under default)
LOW_PRECISION_TOL = {"dense-bf16": BF16_TOL, "dense-fp16": BF16_TOL, "dense-fp8": 5e-3}
MODELS = {
    "mla": ("tiny", {"aux_loss_alpha": 0.05}),
    "dense": ("tiny-dense", {}),
}


class MaskedTokens(Dataset):
    """Random next-token items; sample i keeps its first ``(7 * i + 3) % (SEQ + 1)`` labels."""

    def __init__(self, n: int, seed: int = 0, eod: int | None = None) -> None:
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(1, VOCAB, (n, SEQ + 1), generator=g)
        if eod is not None:  # two documents' ends per sample, anywhere in the window
            for i in range(n):
                self.ids[i, [(5 * i + 2) % (SEQ + 1), (11 * i + 7) % (SEQ + 1)]] = eod

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        labels = self.ids[i, 1:].clone()
        labels[(7 * i + 3) % (SEQ + 1) :] = -100
        return {"input_ids": self.ids[i, :-1], "labels": labels}


class Logged(nt.Callback):
    """Per step: loss, grad norm and every logged `train/*` scalar."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.grad_norms: list[float] = []
        self.scalars: list[dict[str, float]] = []

    def on_train_step_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(outputs.loss))
        self.grad_norms.append(float(outputs.grad_norm))
        metrics = trainer.callback_metrics.items()
        self.scalars.append({k: float(v) for k, v in metrics if k.startswith("train/")})


def _gather_over_stages(strategy: Any, named: dict[str, Any]) -> dict[str, Any]:
    mesh = getattr(strategy, "mesh", None)
    if not dist.is_initialized() or mesh is None or mesh.pp_size == 1:
        return named
    parts: list[dict] = [{} for _ in range(mesh.pp_size)]
    dist.all_gather_object(parts, named, group=mesh.pp_group)
    return {k: v for part in parts for k, v in part.items()}


def fit(
    strategy: Any,
    model: str,
    root: str,
    validate: bool = True,
    precision: str = "32-true",
    micro_batch_size: int = 2,
    documents: bool = False,
    **module_kwargs: Any,
) -> dict[str, Any]:
    """`STEPS` steps (global batch 4, micro batch 2, seed 3), then validation of 5 samples
    (`validate`); `documents`: packed documents (end id 0) masked in attention and loss."""
    eod = 0 if documents else None
    if documents:
        module_kwargs.update(document_mask=True, eod_mask_loss=True, eod_token_id=0)
    preset, overrides = MODELS[model]
    logged = Logged()
    module = nt.LanguageModelModule(
        preset,
        vocab_size=VOCAB,
        lr=LR,
        warmup_steps=1,
        eps=1e-6,  # as test_layout_numbers: keeps near-zero gradients' noise from moving weights
        model_overrides=overrides,
        **module_kwargs,
    )
    trainer = nt.Trainer(
        strategy=strategy,
        max_steps=STEPS,
        global_batch_size=4,
        micro_batch_size=micro_batch_size,
        log_every_n_steps=1,
        callbacks=[logged],
        default_root_dir=root,
        loggers=[],
        seed=3,
        enable_progress_bar=False,
        precision=precision,
    )
    trainer.fit(module, train_dataloaders=MaskedTokens(12, eod=eod))
    params = {n: strategy.full_tensor(n, p.detach()).clone() for n, p in module.named_parameters()}
    val = None
    if validate:
        val = trainer.validate(module, dataloaders=MaskedTokens(5, seed=1, eod=eod))[0]["val/loss"]
    return {
        "losses": logged.losses,
        "grad_norms": logged.grad_norms,
        "scalars": logged.scalars,
        "params": _gather_over_stages(strategy, params),
        "val": val,
    }


def assert_same(got: dict, ref: dict, what: str, rtol: float = 1e-5) -> None:
    """Losses, grad norms, logged scalars and val/loss at rtol 1e-5: under cp the attention
    sums over the same keys in another order of operations (gathered K/V, an explicit mask
    instead of the causal kernel), and the loss and gradients are summed over more ranks, which
    moves fp32 results by reduction-order noise (~1e-7 relative per op). The weights as in
    test_layout_numbers: all but one element in a thousand (at least 2) within 1e-5 + 1e-4
    relative, none further than AdamW can move two runs apart (2 · lr · steps), because AdamW
    turns noise in a ~0 gradient element into a step of up to lr. `rtol` for bf16-mixed:
    BF16_TOL."""
    torch.testing.assert_close(got["losses"], ref["losses"], rtol=rtol, atol=0, msg=what)
    torch.testing.assert_close(got["grad_norms"], ref["grad_norms"], rtol=rtol, atol=0, msg=what)
    for step, (mine, theirs) in enumerate(zip(got["scalars"], ref["scalars"], strict=True)):
        assert mine.keys() == theirs.keys(), f"{what} step {step + 1}"
        for name, value in theirs.items():
            assert mine[name] == pytest.approx(value, rel=rtol, abs=1e-9), (
                f"{what} step {step + 1}: {name} {mine[name]} vs {value}"
            )
    if got["val"] is not None:
        assert got["val"] == pytest.approx(ref["val"], rel=rtol), what
    assert got["params"].keys() == ref["params"].keys(), what
    for name, value in ref["params"].items():
        mine = got["params"][name][: value.shape[0]]
        assert mine.shape == value.shape, f"{what}: {name} {mine.shape} vs {value.shape}"
        diff = (mine - value).abs()
        off = int((diff > rtol + 1e-4 * value.abs()).sum())
        # bf16: a regrouped GEMM moves every gradient element by up to 2^-8 of itself, and
        # AdamW turns that into a different step wherever an element's gradient is small
        # against its RMS (measured: 4 of 2048 elements of one v_proj): one in a hundred
        allowed = value.numel() // (1000 if rtol <= 1e-5 else 100)
        assert off <= max(2, allowed), f"{what}: {name}: {off} elements off"
        assert float(diff.max()) <= 2 * LR * STEPS, f"{what}: {name} by {float(diff.max())}"


def _run_layouts(layouts: dict[str, Any], root: str) -> dict[str, dict]:
    out = {}
    for i, (name, (make, models)) in enumerate(layouts.items()):
        for model in models:
            out[f"{name} {model}"] = fit(make(), model, f"{root}/{i}{model}")
    return out


def exchanged_bytes(kind: str) -> tuple[float, float]:
    """Wire bytes this rank sends on its cp group through one attention layer of the tiny
    preset (one sequence of SEQ tokens, fp32): (forward, backward)."""
    mesh = ParallelMesh.build(cp=dist.get_world_size())
    config = presets.get(MODELS[kind][0])
    layer = (MLAttention if kind == "mla" else DenseAttention)(config, cp_group=mesh.cp_group)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.02)
    positions = chunk_positions(SEQ, mesh.cp_size, mesh.cp_rank)
    rope = config.qk_rope_head_dim if kind == "mla" else config.head_dim
    cos, sin = rope_cos_sin(SEQ, rope, config.rope_theta, config.rope_scaling, "cpu")
    x = torch.randn(1, SEQ // mesh.cp_size, config.hidden_size)
    meter = CommMeter({"cp": mesh.cp_group})
    with meter:
        y = layer(x, cos[positions], sin[positions], causal_mask(positions, SEQ))
        forward = meter.bytes["cp"]
        y.sum().backward()
    return forward, meter.bytes["cp"] - forward


def _world2(rank: int, world_size: int, root: str) -> dict[str, dict]:
    both = ("mla", "dense")
    exchange = {kind: exchanged_bytes(kind) for kind in both}
    # plain cp=2 is no run of its own: each model runs cp=2 below under options that change
    # no number, against the plain reference at the plain bound (MLA: recompute "light",
    # whose forward is the plain one; dense: ZeRO-3, whose model and backward are, and
    # recompute "full"); MLA's plain backward under cp=2 runs with packed documents below
    out = {}
    # ZeRO-3 shards over the two cp ranks; validate after fit reuses the wrapped model. The
    # strategy is told it created the process group, as under torchrun: its teardown after
    # fit must keep the group the shards live on for the validation
    zero3 = MegatronStrategy(cp=2, zero_stage=3)
    zero3._owns_process_group = True
    # the dense model: FSDP2's units and their gather and reduce-scatter over dp x cp do not
    # depend on the attention (MLA under cp: the layouts above and below)
    out["cp=2 zero3 dense"] = fit(zero3, "dense", f"{root}/z3")
    assert torch.distributed.is_initialized()
    # recomputation reruns the K/V (latent) all-gather in backward, on every cp rank alike
    light = fit(MegatronStrategy(cp=2), "mla", f"{root}/rl", recompute="light")
    out["cp=2 recompute-light mla"] = light
    full = fit(MegatronStrategy(cp=2), "dense", f"{root}/rf", recompute="full")
    out["cp=2 recompute-full dense"] = full
    bf16 = fit(MegatronStrategy(cp=2), "dense", f"{root}/bf", precision="bf16-mixed")
    out["cp=2 bf16-mixed dense-bf16"] = bf16
    # the other precision plugins: fp16 with its loss scaler, and fp8 (emulated) whose
    # per-tensor scales see a rank's chunks
    out["cp=2 16-mixed dense-fp16"] = fit(
        MegatronStrategy(cp=2), "dense", f"{root}/f16", precision="16-mixed"
    )
    out["cp=2 fp8-emulated dense-fp8"] = fit(
        MegatronStrategy(cp=2), "dense", f"{root}/f8", precision="fp8-emulated"
    )
    # document masking: the block-causal mask and restarting positions of the whole sequences
    out["cp=2 documents mla-docs"] = fit(MegatronStrategy(cp=2), "mla", f"{root}/d", documents=True)
    return out, exchange


def _world4(rank: int, world_size: int, root: str) -> dict[str, dict]:
    both = ("mla", "dense")
    layouts = {
        # one model: four chunks per sequence change the positions and the masks, not the
        # attention's K/V exchange (the dense one: cp=2, cp=2 x tp=2 and the pp layouts)
        "cp=4": (lambda: MegatronStrategy(cp=4), ("mla",)),
        "cp=2 x tp=2 sp": (lambda: MegatronStrategy(cp=2, tp=2, sequence_parallel=True), both),
        "cp=2 x ep=2 x dp=2": (lambda: MegatronStrategy(cp=2, ep=2), ("mla",)),
        # the step's reduction over dp x cp does not depend on the attention: one model (MLA
        # with dp is the ep layout above)
        "cp=2 x dp=2 zero1": (lambda: MegatronStrategy(cp=2, zero_stage=1), ("dense",)),
        # cp x pp: MLA under split backwards (input and weight halves) here, the dense model
        # under DualPipeV below; the plain 1F1B schedule adds nothing to either (its whole
        # backwards run the cp collectives as cp=2 and cp=4 do)
        "cp=2 x pp=2 zb_1f1b": (lambda: MegatronStrategy(cp=2, pp=2, schedule="zb_1f1b"), ("mla",)),
    }
    out = _run_layouts(layouts, root)
    # DualPipeV needs 2 * pp microbatches per step: micro batch 1
    v = MegatronStrategy(cp=2, pp=2, schedule="dualpipev", pipeline_layout=[1, 0, 1, 0])
    out["cp=2 x pp=2 dualpipev dense"] = fit(v, "dense", f"{root}/v", micro_batch_size=1)
    return out


def test_context_parallel_layouts_match_one_process(tmp_path):
    torch.set_num_threads(1)
    reference = {
        model: fit(nt.SingleDeviceStrategy("cpu"), model, str(tmp_path / f"ref{model}"))
        for model in MODELS
    }
    bf16_root = str(tmp_path / "refbf16")
    one = nt.SingleDeviceStrategy("cpu")
    reference["dense-bf16"] = fit(one, "dense", bf16_root, True, "bf16-mixed")
    reference["dense-fp16"] = fit(one, "dense", str(tmp_path / "ref16"), True, "16-mixed")
    reference["dense-fp8"] = fit(one, "dense", str(tmp_path / "ref8"), True, "fp8-emulated")
    reference["mla-docs"] = fit(one, "mla", str(tmp_path / "refdocs"), documents=True)
    assert reference["mla"]["scalars"][0]["train/aux_loss"] > 1e-3  # the balance term is on
    for world, fn, count in ((2, _world2, 7), (4, _world4, 7)):
        results = run_world(fn, world, str(tmp_path / f"w{world}"), timeout=400)
        if world == 2:
            # bytes a rank sends (= receives) per layer: the other rank's 8 tokens, fp32, of
            # MLA's latent + rope key (kv_lora_rank 32 + rope 8) and dense K + V (2 x 2 kv heads
            # x head_dim 16); the backward's reduce-scatter moves as much
            for _, exchange in results:
                assert exchange["mla"] == (8 * (32 + 8) * 4, 8 * (32 + 8) * 4)
                assert exchange["dense"] == (8 * 2 * 2 * 16 * 4, 8 * 2 * 2 * 16 * 4)
            results = [result for result, _ in results]
        for rank, result in enumerate(results):
            assert len(result) == count
            for layout, got in result.items():
                model = layout.split()[-1]
                rtol = LOW_PRECISION_TOL.get(model, 1e-5)
                assert_same(got, reference[model], f"{layout}, rank {rank}", rtol)
