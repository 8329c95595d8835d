"""A callback of your own: it logs something and saves something.

`LossSpikeRecorder` keeps an exponential moving average of the training loss, logs it and the
ratio loss / average (a spike detector worth watching in TensorBoard), and saves every step
whose loss jumped above `threshold` × average to `<run_dir>/loss_spikes.json` at the end.

    python examples/custom_callback.py --max_steps 100

Callbacks run on every rank; `trainer.step_output.loss` is the global loss (identical on every
rank), so every rank decides alike; only rank 0 writes files. See docs/callbacks.md for what
holds at each hook.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import nanotrain as nt
from nanotrain.callbacks import LearningRateMonitor


class LossSpikeRecorder(nt.Callback):
    """Logs `spikes/loss_ema` and `spikes/ratio`; saves the spike steps as JSON.

    Args:
        decay: weight of the old average in the EMA (0.9: about the last 10 steps count).
        threshold: a step is a spike when its loss exceeds threshold × the average before it.
    """

    def __init__(self, decay: float = 0.9, threshold: float = 1.5) -> None:
        if not 0.0 < decay < 1.0 or threshold <= 1.0:
            raise ValueError(f"need 0 < decay < 1 and threshold > 1, got {decay}, {threshold}")
        self.decay, self.threshold = decay, threshold
        self.ema: float | None = None
        self.spikes: list[dict[str, float]] = []

    def on_train_step_end(self, trainer, module, outputs, batch, batch_idx):
        loss = float(outputs.loss)  # one host sync per step: fine for a small model
        if self.ema is not None and loss > self.threshold * self.ema:
            self.spikes.append({"step": trainer.global_step, "loss": loss, "ema": self.ema})
        self.ema = loss if self.ema is None else self.decay * self.ema + (1 - self.decay) * loss
        trainer.log_metrics({"spikes/loss_ema": self.ema, "spikes/ratio": loss / self.ema})

    def on_fit_end(self, trainer, module):
        if trainer.is_global_zero:
            path = Path(trainer.run_dir) / "loss_spikes.json"
            path.write_text(
                json.dumps({"threshold": self.threshold, "spikes": self.spikes}, indent=2)
            )
            print(f"{len(self.spikes)} loss spike(s) saved to {path}")

    # A callback's state goes into checkpoints, so a resumed run continues the same average.
    def state_dict(self):
        return {"ema": self.ema, "spikes": self.spikes}

    def load_state_dict(self, state_dict):
        self.ema, self.spikes = state_dict["ema"], list(state_dict["spikes"])


def main(argv: list[str] | None = None) -> nt.Trainer:
    parser = argparse.ArgumentParser(description="train the tiny model with a custom callback")
    parser.add_argument("--max_steps", type=int, default=100)
    parser.add_argument("--seq_len", type=int, default=128)
    parser.add_argument("--demo_max_bytes", type=int, default=2_000_000)
    parser.add_argument("--root", default="runs")
    args = parser.parse_args(argv)
    trainer = nt.Trainer(
        max_steps=args.max_steps,
        global_batch_size=8,
        micro_batch_size=8,
        log_every_n_steps=max(1, min(10, args.max_steps)),
        default_root_dir=args.root,
        name="custom_callback",
        callbacks=[LossSpikeRecorder(), LearningRateMonitor()],
    )
    data = nt.data.TokenDataModule(seq_len=args.seq_len, demo_max_bytes=args.demo_max_bytes)
    trainer.fit(nt.LanguageModelModule(model="tiny", warmup_steps=2), data)
    return trainer


if __name__ == "__main__":
    main()
