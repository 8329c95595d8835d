"""Shared by the precision tests: random token data and a short fit that records losses."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import Dataset

import nanotrain as nt

VOCAB = 128
SEQ = 16


class RandomTokens(Dataset):
    """`n` fixed random sequences as {"input_ids", "labels"} (shifted by one)."""

    def __init__(self, n: int = 64, seed: int = 0, vocab: int = VOCAB) -> None:
        g = torch.Generator().manual_seed(seed)
        # a learnable pattern (each token mostly followed by token+1) so the loss falls
        start = torch.randint(0, vocab, (n, 1), generator=g)
        ids = (start + torch.arange(SEQ + 1)) % vocab
        noise = torch.rand(n, SEQ + 1, generator=g) < 0.1
        ids = torch.where(noise, torch.randint(0, vocab, ids.shape, generator=g), ids)
        self.ids = ids

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i, :-1], "labels": self.ids[i, 1:]}


class Losses(nt.Callback):
    """Records every step's global loss, grad norm and StepOutput metrics."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.grad_norms: list[float] = []
        self.metrics: list[dict[str, float]] = []

    def on_train_step_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(outputs.loss))
        self.grad_norms.append(float(outputs.grad_norm))
        self.metrics.append({k: float(v) for k, v in outputs.metrics.items()})


def fit(
    precision: Any,
    strategy: Any = "single",
    steps: int = 5,
    root: str = "runs",
    preset: str = "tiny-dense",
    lr: float = 1e-2,
    global_batch: int = 4,
    micro_batch: int = 2,
    callbacks: list | None = None,
    ckpt_path: Any = None,
    module: Any = None,
) -> tuple[nt.Trainer, Losses]:
    """Train `steps` steps of `preset` under `precision`; returns the trainer and recorder."""
    rec = Losses()
    module = module or nt.LanguageModelModule(preset, vocab_size=VOCAB, lr=lr, warmup_steps=2)
    trainer = nt.Trainer(
        strategy=strategy,
        precision=precision,
        max_steps=steps,
        global_batch_size=global_batch,
        micro_batch_size=micro_batch,
        gradient_clip_val=1.0,
        callbacks=[rec, *(callbacks or [])],
        default_root_dir=root,
        loggers=[],
        seed=3,
    )
    trainer.fit(module, train_dataloaders=RandomTokens(), ckpt_path=ckpt_path)
    return trainer, rec
