"""A NanoModule that is not a language model: a small MLP learns y = sin(x) from noisy points,
with callbacks of its own choosing (keep the best checkpoint by validation error, stop early
when it stops improving, and a callback written here that reports the fit).

    python examples/custom_module.py --max_steps 300

Everything the Trainer does for language models works for any NanoModule: strategies,
checkpoints, logging, the run report. Run it under torchrun with `--strategy ddp` unchanged.
"""

from __future__ import annotations

import argparse
import math

import torch
from torch import nn
from torch.utils.data import TensorDataset

import nanotrain as nt
from nanotrain.callbacks import EarlyStopping, ModelCheckpoint, RunReport


def sine_data(num: int, seed: int) -> TensorDataset:
    """`num` points x ~ U(-π, π) with y = sin(x) + noise; x and y are [num, 1]."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.rand(num, 1, generator=g) * 2 - 1) * math.pi
    return TensorDataset(x, torch.sin(x) + 0.05 * torch.randn(num, 1, generator=g))


class SineRegressor(nt.NanoModule):
    """A 1 → hidden → hidden → 1 MLP trained with mean squared error."""

    def __init__(self, hidden: int = 32, lr: float = 1e-2) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net: nn.Module | None = None

    def configure_model(self) -> None:
        if self.net is None:
            h = self.hparams.hidden
            self.net = nn.Sequential(
                nn.Linear(1, h), nn.Tanh(), nn.Linear(h, h), nn.Tanh(), nn.Linear(h, 1)
            )

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("train/mse", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log(
            "val/mse", nn.functional.mse_loss(self.net(x), y), sync_dist=True, batch_size=len(x)
        )

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=self.hparams.lr)


class FitReport(nt.Callback):
    """Prints the validation error after every validation (rank 0) and, at the end, how far
    the learned curve is from sin(x) on a grid."""

    def on_validation_end(self, trainer, module):
        if trainer.is_global_zero and "val/mse" in trainer.callback_metrics:
            print(
                f"step {trainer.global_step}: val/mse {float(trainer.callback_metrics['val/mse']):.4f}"
            )

    def on_fit_end(self, trainer, module):
        grid = torch.linspace(-math.pi, math.pi, 101).unsqueeze(1)
        with torch.no_grad():
            error = (
                (module.net(grid.to(trainer.strategy.root_device)).cpu() - torch.sin(grid))
                .abs()
                .max()
            )
        if trainer.is_global_zero:
            print(f"max |net(x) - sin(x)| on [-π, π]: {float(error):.3f}")


def main(argv: list[str] | None = None) -> nt.Trainer:
    parser = argparse.ArgumentParser(description="fit sin(x) with a NanoModule")
    parser.add_argument("--max_steps", type=int, default=300)
    parser.add_argument("--strategy", default="auto", help="auto, single or ddp")
    parser.add_argument("--root", default="runs")
    args = parser.parse_args(argv)
    trainer = nt.Trainer(
        strategy=args.strategy,
        max_steps=args.max_steps,
        global_batch_size=32,
        micro_batch_size=32,
        val_check_interval=max(1, args.max_steps // 10),
        log_every_n_steps=max(1, args.max_steps // 10),
        validate_at_start=True,
        default_root_dir=args.root,
        name="sine",
        callbacks=[
            ModelCheckpoint(monitor="val/mse", save_top_k=1),
            EarlyStopping(monitor="val/mse", patience=5),
            FitReport(),
            RunReport(),
        ],
    )
    trainer.fit(
        SineRegressor(), train_dataloaders=sine_data(2048, 0), val_dataloaders=sine_data(256, 1)
    )
    return trainer


if __name__ == "__main__":
    main()
