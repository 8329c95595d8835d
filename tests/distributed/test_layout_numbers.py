"""Every number a user reads is the same under every layout (issue 14).

Data that can tell: samples keep different numbers of labels (the rest -100), on the tiny
DeepSeek preset with MTP and a sizeable sequence-wise balance loss, so the LM, MTP and balance
terms each average over a different count (tokens, MTP targets, sequences). One process with
micro batch 2 is the reference; one process with micro batch 8, and DDP dp=2,
tp=2 (with and without sequence parallelism), pp=2 (stage 0 holds no MoE layer; split
backwards) (world 2), ep=2 × expert-dp=2 with ZeRO-1 and interleaved pp=2 × virtual 2
× dp=2 (world 4) must
give the same per-step loss and grad norm, the same logged `train/*` and `moe/*` scalars at
every step, the same weights after the run, and the same `val/loss` on a validation set of
13 samples read whole, with `limit_val_batches=1` (global batches) and with a fraction.
The same holds with a capacity factor that drops copies, under micro batch 8, tp=2
with sequence parallelism, pp=2 and ep=2 (the drops are decided per whole sequence).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import Dataset

import nanotrain as nt
from nanotrain.callbacks import MoELoadMonitor
from nanotrain.strategies.megatron import MegatronStrategy
from tests.distributed.spawn import run_world

pytestmark = pytest.mark.distributed

# 3 steps: every number is compared at every step, and the third step's update already
# uses Adam's moments of two steps; more steps run no other code
VOCAB, SEQ, STEPS = 257, 16, 3
# 1e-3, not 3e-3: with 4 MoE-heavy layers AdamW turns reduction-order noise (mb 2 vs 8, one
# thread) into 2e-5 relative grad-norm drift by step 4 at 3e-3; at 1e-3 it stays below 3e-6
LR = 1e-3
VAL_LIMITS = (None, 1, 0.5)  # whole set (13), one global batch (8), half the set (6)


class MaskedTokens(Dataset):
    """Random next-token items; sample i keeps its first ``(7 * i + 3) % (SEQ + 1)`` labels
    (0 to SEQ: some samples have no MTP target, one none at all)."""

    def __init__(self, n: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, VOCAB, (n, SEQ + 1), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        labels = self.ids[i, 1:].clone()
        labels[(7 * i + 3) % (SEQ + 1) :] = -100
        return {"input_ids": self.ids[i, :-1], "labels": labels}


class Logged(nt.Callback):
    """Per step: the step's loss and grad norm and every logged `train/*` and `moe/*` scalar
    (listed after MoELoadMonitor, so its scalars of the step are there)."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.grad_norms: list[float] = []
        self.scalars: list[dict[str, float]] = []

    def on_train_step_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(outputs.loss))
        self.grad_norms.append(float(outputs.grad_norm))
        self.scalars.append(
            {
                k: float(v)
                for k, v in trainer.callback_metrics.items()
                if k.startswith(("train/", "moe/"))
            }
        )


def _gather_over_stages(strategy: Any, named: dict[str, Any]) -> dict[str, Any]:
    mesh = strategy.mesh
    if not dist.is_initialized() or mesh is None or mesh.pp_size == 1:
        return named
    parts: list[dict] = [{} for _ in range(mesh.pp_size)]
    dist.all_gather_object(parts, named, group=mesh.pp_group)
    return {k: v for part in parts for k, v in part.items()}


def fit(
    strategy: Any, root: str, micro_batch_size: int = 2, capacity_factor: float | None = None
) -> dict[str, Any]:
    """`STEPS` steps (global batch 8, seed 3, log every step), then one validation per limit."""
    logged = Logged()
    module = nt.LanguageModelModule(
        "tiny",
        vocab_size=VOCAB,
        lr=LR,
        warmup_steps=1,
        # AdamW's default eps (1e-8) turns reduction-order noise in a near-zero gradient into
        # a step of up to lr (see `assert_same`); 1e-6 keeps such an element where it was
        eps=1e-6,
        # 4 layers (layer 0 dense, 1-3 MoE); a balance loss large enough that weighing it by
        # tokens instead of sequences shows
        model_overrides={
            "num_layers": 4,
            "aux_loss_alpha": 0.05,
            "capacity_factor": capacity_factor,
        },
    )
    trainer = nt.Trainer(
        strategy=strategy,
        max_steps=STEPS,
        global_batch_size=8,
        micro_batch_size=micro_batch_size,
        log_every_n_steps=1,
        callbacks=[MoELoadMonitor(heatmap_every_n_steps=0), logged],
        default_root_dir=root,
        enable_checkpointing=False,  # nothing reads a checkpoint: no final save
        enable_progress_bar=False,
        loggers=[],
        seed=3,
    )
    trainer.fit(module, train_dataloaders=MaskedTokens(24))
    params = {n: strategy.full_tensor(n, p.detach()).clone() for n, p in module.named_parameters()}
    val = []
    for limit in VAL_LIMITS:
        trainer.settings.limit_val_batches = limit
        val.append(trainer.validate(module, dataloaders=MaskedTokens(13, seed=1))[0]["val/loss"])
    return {
        "losses": logged.losses,
        "grad_norms": logged.grad_norms,
        "scalars": logged.scalars,
        "params": _gather_over_stages(strategy, params),
        "val": val,
    }


def assert_same(got: dict, ref: dict, what: str) -> None:
    """Losses, grad norms, every logged scalar and val/loss at rtol 1e-5; the weights: all but
    one in a thousand elements (at least 2 allowed) within 1e-5 + 1e-4 relative, none further
    than AdamW can move two runs apart (2 · lr · steps). Why a few elements may differ: AdamW
    divides each element's gradient by its own RMS, so an element whose gradient is ~0 (e.g.
    an embedding entry of a token seen once) turns reduction-order noise into a step of up to
    lr (measured: one element of the embedding at tp=2, by 4e-4). A wrongly weighed loss term
    changes the direction of the whole gradient and moves most elements."""
    torch.testing.assert_close(got["losses"], ref["losses"], rtol=1e-5, atol=0, msg=what)
    torch.testing.assert_close(got["grad_norms"], ref["grad_norms"], rtol=1e-5, atol=0, msg=what)
    for step, (mine, theirs) in enumerate(zip(got["scalars"], ref["scalars"], strict=True)):
        assert mine.keys() == theirs.keys(), (
            f"{what} step {step + 1}: {mine.keys() ^ theirs.keys()}"
        )
        for name, value in theirs.items():
            assert mine[name] == pytest.approx(value, rel=1e-5, abs=1e-9), (
                f"{what} step {step + 1}: {name} {mine[name]} vs {value}"
            )
    torch.testing.assert_close(got["val"], ref["val"], rtol=1e-5, atol=0, msg=what)
    assert got["params"].keys() == ref["params"].keys(), what
    for name, value in ref["params"].items():
        mine = got["params"][name][: value.shape[0]]
        assert mine.shape == value.shape, f"{what}: {name} {mine.shape} vs {value.shape}"
        diff = (mine - value).abs()
        off = int((diff > 1e-5 + 1e-4 * value.abs()).sum())
        assert off <= max(2, value.numel() // 1000), f"{what}: {name}: {off} elements off"
        assert float(diff.max()) <= 2 * LR * STEPS, f"{what}: {name} by {float(diff.max())}"


def _world2(rank: int, world_size: int, root: str) -> dict[str, dict]:
    layouts = {
        # Megatron's dp reductions of every number: world 4's two layouts (dp=4 with ZeRO-1,
        # plain dp=2 under pp)
        "ddp dp=2": nt.strategies.DDPStrategy,
        "tp=2": lambda: MegatronStrategy(tp=2),
        "tp=2 sp": lambda: MegatronStrategy(tp=2, sequence_parallel=True),
        # stage 0 holds only the dense layer 0: MoE statistics come from stage 1 alone; the
        # backwards split into input and weight halves (1F1B itself: the capacity world below)
        "pp=2 zb_1f1b": lambda: MegatronStrategy(pp=2, pipeline_layout=[1, 3], schedule="zb_1f1b"),
        # ep=2: world 4's "ep=2 x dp=4" (the same ep group of 2, every number reduced over it)
        # and the capacity world's ep=2 on 2 ranks
    }
    return {name: fit(make(), f"{root}/{i}") for i, (name, make) in enumerate(layouts.items())}


def _world4(rank: int, world_size: int, root: str) -> dict[str, dict]:
    layouts = {
        "ep=2 x dp=4": lambda: MegatronStrategy(ep=2, zero_stage=1),
        "pp=2 x vpp=2 x dp=2": lambda: MegatronStrategy(pp=2, virtual_pp=2),
    }
    return {name: fit(make(), f"{root}/{i}") for i, (name, make) in enumerate(layouts.items())}


def test_every_logged_number_is_layout_independent(tmp_path):
    torch.set_num_threads(1)
    reference = fit(nt.SingleDeviceStrategy("cpu"), str(tmp_path / "ref"))
    # the parts add up to the total exactly: train/loss = lm + aux + λ · mtp
    for step in reference["scalars"]:
        parts = step["train/lm_loss"] + step["train/aux_loss"] + 0.3 * step["train/mtp_loss"]
        assert step["train/loss"] == pytest.approx(parts, rel=1e-6)
        assert step["train/aux_loss"] > 1e-3  # the balance term is really on
    assert "moe/max_over_mean" in reference["scalars"][0]
    assert "moe/layer1/max_over_mean" in reference["scalars"][0]
    assert "moe/layer4/max_over_mean" in reference["scalars"][0]  # the MTP block's MoE
    assert_same(fit(nt.SingleDeviceStrategy("cpu"), str(tmp_path / "m8"), 8), reference, "mb=8")
    for world, fn in ((2, _world2), (4, _world4)):
        results = run_world(fn, world, str(tmp_path / f"w{world}"), timeout=400)
        for rank, result in enumerate(results):
            assert len(result) == (4 if world == 2 else 2)
            for layout, got in result.items():
                assert_same(got, reference, f"{layout}, rank {rank}")


def _world2_capacity(rank: int, world_size: int, root: str) -> dict[str, dict]:
    # no DDP here: its ranks run the one-process MoE on their own whole sequences (as ep=2's
    # data-parallel split and micro batch 8 do), and the dropped copies are summed in the
    # same collective as the loads (`reduce_load`), which the DDP layout of the world above
    # checks through every moe/* scalar
    layouts = {
        # each rank holds half of every sequence: the MoE gathers whole sequences to drop
        "tp=2 sp": lambda: MegatronStrategy(tp=2, sequence_parallel=True),
        "pp=2": lambda: MegatronStrategy(pp=2, pipeline_layout=[1, 3]),
        "ep=2": lambda: MegatronStrategy(ep=2),
    }
    return {
        name: fit(make(), f"{root}/{i}", capacity_factor=0.5)
        for i, (name, make) in enumerate(layouts.items())
    }


def test_capacity_drops_are_layout_independent(tmp_path):
    # Which copies a capacity drops depends on which tokens compete for the slots; the MoE
    # layer makes each whole sequence its own group, so microbatching, dp/ep/pp sharding and
    # sequence parallelism do not change the drops
    torch.set_num_threads(1)
    reference = fit(nt.SingleDeviceStrategy("cpu"), str(tmp_path / "ref"), capacity_factor=0.5)
    dropped = [v for k, v in reference["scalars"][0].items() if k.endswith("dropped_fraction")]
    assert dropped and max(dropped) > 0.05  # the capacity really drops copies
    mb8 = fit(nt.SingleDeviceStrategy("cpu"), str(tmp_path / "m8"), 8, capacity_factor=0.5)
    assert_same(mb8, reference, "capacity, mb=8")
    for rank, result in enumerate(run_world(_world2_capacity, 2, str(tmp_path), timeout=300)):
        assert len(result) == 3
        for layout, got in result.items():
            assert_same(got, reference, f"capacity, {layout}, rank {rank}")
