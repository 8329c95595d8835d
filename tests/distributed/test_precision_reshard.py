"""bf16-true checkpoints carry their fp32 master weights and loss-scaler state to another layout.

A forked world of 2 ranks trains the tiny DeepSeek in bf16-true under ZeRO-2 (each rank holds
the fp32 masters of its half) and saves at the end of training; each rank also reports its
master pieces by parameter name. The test process resumes the checkpoint on one process in
bf16-true: every master there must equal the saved fp32 values exactly, which the bf16
weights alone could not give (they hold 8 bits of mantissa, the masters 24).
"""

from __future__ import annotations

import pytest
import torch

import nanotrain as nt
from nanotrain.checkpoint import optim_state
from tests.distributed.spawn import run_world
from tests.unit.test_language_model import RandomTokens

pytestmark = pytest.mark.distributed


class SaveAtEnd(nt.Callback):
    """Saves when training ends (the strategy still holds its ZeRO shards) and keeps this
    rank's master pieces: {name: [(start, values)]}."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.pieces: dict[str, list[tuple[int, list[float]]]] = {}

    def on_train_end(self, trainer, module) -> None:
        self.path = str(trainer.save_checkpoint(self.path))
        pieces, _ = optim_state.export_state(trainer.strategy)
        for text, values in pieces.items():
            key, start, name = optim_state.parse_piece_key(text)
            if key == optim_state.MASTER_KEY:
                self.pieces.setdefault(name, []).append((start, values.tolist()))


class ReadMasters(nt.Callback):
    """Reads the masters and bf16 weights by parameter name once a resume has loaded them."""

    def on_train_start(self, trainer, module) -> None:
        names = {id(p): n for n, p in module.named_parameters()}
        holder = trainer.strategy._master_holder
        self.masters = {names[id(p)]: m.detach().clone() for p, m in holder.pairs}
        self.weights = {n: p.detach().float().clone() for n, p in module.named_parameters()}


def fit(root: str, strategy, max_steps: int, callbacks, ckpt_path=None) -> nt.Trainer:
    trainer = nt.Trainer(
        strategy=strategy,
        precision="bf16-true",
        max_steps=max_steps,
        global_batch_size=4,
        micro_batch_size=1,
        default_root_dir=root,
        loggers=[],
        seed=3,
        callbacks=callbacks,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_monitors=False,
    )
    module = nt.LanguageModelModule(
        model="tiny", vocab_size=257, lr=1e-2, warmup_steps=1, decay_steps=8
    )
    trainer.fit(module, train_dataloaders=RandomTokens(32, 257), ckpt_path=ckpt_path)
    return trainer


def _save_world(rank: int, world_size: int, root: str) -> dict:
    saver = SaveAtEnd(f"{root}/ckpt")
    fit(f"{root}/run", nt.MegatronStrategy(zero_stage=2), 2, [saver])
    return {"path": saver.path, "pieces": saver.pieces}


def test_bf16_true_masters_reshard_from_zero2_to_one_process(tmp_path):
    ranks = run_world(_save_world, 2, str(tmp_path), timeout=300)
    saved: dict[str, torch.Tensor] = {}
    for name in ranks[0]["pieces"].keys() | ranks[1]["pieces"].keys():
        pieces = ranks[0]["pieces"].get(name, []) + ranks[1]["pieces"].get(name, [])
        numel = max(start + len(values) for start, values in pieces)
        flat = torch.full((numel,), float("nan"))
        for start, values in pieces:
            flat[start : start + len(values)] = torch.tensor(values)
        saved[name] = flat
    assert saved and all(torch.isfinite(v).all() for v in saved.values())  # pieces cover all

    reader = ReadMasters()
    fit(
        str(tmp_path / "one"),
        nt.SingleDeviceStrategy("cpu"),
        3,
        [reader],
        ckpt_path=ranks[0]["path"],
    )
    assert reader.masters.keys() == saved.keys()
    for name, master in reader.masters.items():
        assert master.dtype == torch.float32
        assert torch.equal(master.reshape(-1), saved[name]), name
    # the masters hold bits the bf16 weights do not: they were restored, not re-derived
    differs = [n for n, m in reader.masters.items() if not torch.equal(m, reader.weights[n])]
    assert len(differs) > len(reader.masters) // 2
