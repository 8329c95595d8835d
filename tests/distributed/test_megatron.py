"""MegatronStrategy (tp, tp+sp, dp, tp x dp, ZeRO-1/2) matches one process step for step.

Two forked gloo worlds (2 and 4 ranks) each train several layouts one after another; every
layout is then checked against the single-process reference (SingleDeviceStrategy) with the
same seed, data and global batch: per-step losses and grad norms, the first step's per-parameter
grad norms, and the final parameters gathered over tp.
"""

from __future__ import annotations

import io
from collections import defaultdict
from typing import Any

import pytest
import torch
from torch.utils.data import Dataset

import nanotrain as nt
from nanotrain.models.layers import RMSNorm
from nanotrain.parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    vocab_parallel_cross_entropy,
)
from nanotrain.strategies.megatron import MegatronStrategy
from tests.distributed.spawn import run_world

VOCAB = 256  # of the sequence-parallel test model
# Not a multiple of tp: the vocab-parallel head is padded, which must change neither the init
# nor the loss.
LM_VOCAB = 257
SEQ = 16
STEPS = 3


class RandomTokens(Dataset):
    """`n` fixed random sequences of `SEQ` token ids as {"input_ids", "labels"} (shifted by one)."""

    def __init__(self, n: int = 48, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, VOCAB, (n, SEQ + 1), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i, :-1], "labels": self.ids[i, 1:]}


class SequenceParallelLM(nt.NanoModule):
    """embed -> norm -> Column -> gelu -> Row(+bias) residual -> norm -> head, built with the
    strategy's `sequence_parallel`: a model whose replicated params (norm weights, the Row bias)
    see only this rank's part of the sequence, which the strategy must sum over tp.
    `follow_strategy=False` builds the layers without sequence parallelism whatever the strategy
    asks, to check that such a mismatch is refused."""

    def __init__(self, follow_strategy: bool = True) -> None:
        super().__init__()
        self.follow_strategy = follow_strategy

    def configure_model(self) -> None:
        mesh = self.mesh
        tp_group = None if mesh is None else mesh.tp_group
        asked = bool(getattr(self._nano_trainer.strategy, "sequence_parallel", False))
        sp = asked and self.follow_strategy
        kw = {"tp_group": tp_group, "sequence_parallel": sp}
        self.embed = VocabParallelEmbedding(VOCAB, 32, **kw)
        self.norm1 = RMSNorm(32)
        self.up = ColumnParallelLinear(32, 64, bias=True, **kw)
        self.down = RowParallelLinear(64, 32, bias=True, **kw)
        self.norm2 = RMSNorm(32)
        self.head = ColumnParallelLinear(32, VOCAB, **kw)
        self.tp_group = tp_group

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        h = self.embed(batch["input_ids"])  # (B, T / tp, 32) under sequence parallelism
        h = h + self.down(torch.nn.functional.gelu(self.up(self.norm1(h))))
        logits = self.head(self.norm2(h))  # (B, T, V / tp)
        ce = vocab_parallel_cross_entropy(logits, batch["labels"], self.tp_group, vocab_size=VOCAB)
        return ce.mean()

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.1)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def count_tokens(self, batch: dict[str, torch.Tensor]) -> int:
        return batch["labels"].numel()


class Recorder(nt.Callback):
    """Per step: the strategy's global loss and grad norm, and the named grad norms once."""

    def __init__(self, roundtrip_at: int | None = None) -> None:
        self.losses: list[float] = []
        self.grad_norms: list[float] = []
        self.named: dict[str, float] = {}
        self.roundtrip_at = roundtrip_at

    def on_before_optimizer_step(self, trainer, module, optimizer) -> None:
        if not self.named:
            self.named = {k: float(v) for k, v in trainer.strategy.named_grad_norms().items()}

    def on_train_step_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(outputs.loss))
        self.grad_norms.append(float(outputs.grad_norm))
        if trainer.global_step == self.roundtrip_at:
            roundtrip_state(trainer.strategy, module)


def roundtrip_state(strategy: Any, module: Any) -> None:
    """Save model + optimizer state, wreck both, load them back: training must not notice."""
    blob = io.BytesIO()
    torch.save(
        {"model": strategy.model_state_dict(), "optim": strategy.optimizer_state_dict()}, blob
    )
    with torch.no_grad():
        for p in module.parameters():
            p.add_(1.0)
    strategy.optimizer.state = defaultdict(dict)
    blob.seek(0)
    state = torch.load(blob, weights_only=True)
    strategy.load_model_state_dict(state["model"])
    strategy.load_optimizer_state_dict(state["optim"])


def make_module(kind: str) -> nt.NanoModule:
    """ "tiny" / "tiny-dense": LanguageModelModule on the preset; "sp": SequenceParallelLM;
    "sp-ignored": SequenceParallelLM that never builds sequence-parallel layers."""
    if kind == "sp":
        return SequenceParallelLM()
    if kind == "sp-ignored":
        return SequenceParallelLM(follow_strategy=False)
    return nt.LanguageModelModule(kind, vocab_size=LM_VOCAB, lr=1e-2, warmup_steps=2)


def fit(kind: str, strategy: Any, root: str, roundtrip_at: int | None = None) -> dict:
    """Train `STEPS` steps (global batch 8, microbatch 2, clip 0.5); gather the results."""
    recorder = Recorder(roundtrip_at)
    module = make_module(kind)
    trainer = nt.Trainer(
        strategy=strategy,
        max_steps=STEPS,
        global_batch_size=8,
        micro_batch_size=2,
        gradient_clip_val=0.5,
        callbacks=[recorder],
        default_root_dir=root,
        enable_checkpointing=False,  # nothing reads a checkpoint: no final save
        enable_progress_bar=False,
        loggers=[],
        seed=3,
    )
    trainer.fit(module, train_dataloaders=RandomTokens())
    params = {
        name: strategy.full_tensor(name, p.detach()).clone()
        for name, p in module.named_parameters()
    }
    state_bytes = sum(
        v.numel() * v.element_size()
        for s in strategy.optimizer.state.values()
        for v in s.values()
        if isinstance(v, torch.Tensor)
    )
    return {
        "losses": recorder.losses,
        "grad_norms": recorder.grad_norms,
        "named": recorder.named,
        "params": params,
        "state_bytes": state_bytes,
    }


def assert_matches(result: dict, reference: dict, what: str) -> None:
    """Losses, grad norms (global and per parameter) at rtol 1e-5; final gathered parameters
    within 2e-5 absolute.

    Why the parameters get an absolute bound: AdamW divides each element's gradient by its own
    RMS, so an element whose gradient is ~0 turns reduction-order noise (1e-7 relative) into a
    step of up to lr. 2e-5 is 0.05% of the ~4e-2 each parameter can move in these 5 steps;
    a wrong gradient or a lost update moves parameters by ~1e-2.
    """
    assert len(result["losses"]) == STEPS, what
    torch.testing.assert_close(result["losses"], reference["losses"], rtol=1e-5, atol=0, msg=what)
    torch.testing.assert_close(
        result["grad_norms"], reference["grad_norms"], rtol=1e-5, atol=0, msg=what
    )
    assert result["named"].keys() == reference["named"].keys(), what
    for name, value in reference["named"].items():
        assert abs(result["named"][name] - value) <= 1e-5 * value + 1e-7, f"{what}: {name}"
    assert result["params"].keys() == reference["params"].keys(), what
    for name, value in reference["params"].items():
        gathered = result["params"][name]
        # a vocab-parallel head is padded to a multiple of tp; its padding rows never train
        assert not gathered[value.shape[0] :].any(), f"{what}: {name} padding rows changed"
        torch.testing.assert_close(
            gathered[: value.shape[0]], value, rtol=1e-4, atol=1e-4, msg=f"{what}: {name}"
        )


pytestmark = pytest.mark.distributed

# name -> (model kind, MegatronStrategy kwargs, step after which state is saved and reloaded)
WORLD2 = {
    "dense tp=2": ("tiny-dense", dict(tp=2), None),
    "deepseek tp=2": ("tiny", dict(tp=2), None),
    "sp-toy tp=2 sequence_parallel": ("sp", dict(tp=2, sequence_parallel=True), None),
    "dense dp=2": ("tiny-dense", dict(dp=2), None),
    "deepseek dp=2": ("tiny", dict(dp=2), None),
    "deepseek zero1 dp=2": ("tiny", dict(zero_stage=1), None),
    "dense zero2 dp=2 + state round trip": ("tiny-dense", dict(zero_stage=2), 3),
    "deepseek zero2 dp=2": ("tiny", dict(zero_stage=2), None),
}
WORLD4 = {
    "dense tp=2 x dp=2": ("tiny-dense", dict(tp=2, dp=2), None),
    "deepseek tp=2 x dp=2": ("tiny", dict(tp=2, dp=2), None),
    "dense zero2 tp=2 x dp=2 + state round trip": ("tiny-dense", dict(tp=2, zero_stage=2), 3),
    "sp-toy zero1 tp=2 x dp=2 sequence_parallel": (
        "sp",
        dict(tp=2, zero_stage=1, sequence_parallel=True),
        None,
    ),
    "dense zero1 dp=4": ("tiny-dense", dict(zero_stage=1), None),
}


def _run_layouts(rank: int, world_size: int, root: str, layouts: dict) -> dict:
    results = {}
    for name, (kind, kwargs, roundtrip_at) in layouts.items():
        results[name] = fit(
            kind, MegatronStrategy(**kwargs), f"{root}/{len(results)}", roundtrip_at
        )
    # sequence_parallel=True on a model without sequence-parallel layers must refuse to train
    # (its replicated grads would be summed over tp twice over).
    try:
        fit("sp-ignored", MegatronStrategy(tp=2, sequence_parallel=True), f"{root}/sp-refused")
    except ValueError as err:
        results["sp refused"] = str(err)
    return results


@pytest.fixture(scope="module")
def references(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("reference")
    kinds = ("tiny-dense", "tiny", "sp")
    return {kind: fit(kind, nt.SingleDeviceStrategy("cpu"), str(root / kind)) for kind in kinds}


@pytest.fixture(scope="module")
def world2(tmp_path_factory) -> list[dict]:
    return run_world(_run_layouts, 2, str(tmp_path_factory.mktemp("w2")), WORLD2, timeout=180)


@pytest.fixture(scope="module")
def world4(tmp_path_factory) -> list[dict]:
    return run_world(_run_layouts, 4, str(tmp_path_factory.mktemp("w4")), WORLD4, timeout=240)


@pytest.mark.parametrize("layout", list(WORLD2))
def test_two_rank_layout_matches_single_process(world2, references, layout):
    kind = WORLD2[layout][0]
    for rank, result in enumerate(world2):
        assert_matches(result[layout], references[kind], f"{layout}, rank {rank}")


@pytest.mark.parametrize("layout", list(WORLD4))
def test_four_rank_layout_matches_single_process(world4, references, layout):
    kind = WORLD4[layout][0]
    for rank, result in enumerate(world4):
        assert_matches(result[layout], references[kind], f"{layout}, rank {rank}")


@pytest.mark.parametrize(
    ("world", "layout", "dp"),
    [
        ("world2", "deepseek zero1 dp=2", 2),
        ("world2", "deepseek zero2 dp=2", 2),
        ("world4", "dense zero1 dp=4", 4),
    ],
)
def test_zero_shards_optimizer_state_over_dp(request, references, world, layout, dp):
    results = request.getfixturevalue(world)
    kind = {**WORLD2, **WORLD4}[layout][0]
    full = references[kind]["state_bytes"]  # AdamW's moments + step counters, unsharded
    for result in results:
        assert result[layout]["state_bytes"] == pytest.approx(full / dp, rel=0.01)


def test_sequence_parallel_without_sequence_parallel_layers_is_refused(world2):
    for result in world2:
        assert "no sequence-parallel tensor-parallel layer" in result["sp refused"]
