"""TrainState: the counters that say where a run is, saved in every checkpoint."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any


@dataclass
class TrainState:
    """Where training stands; identical on every rank.

    Attributes:
        global_step: optimizer steps taken (skipped steps included: they consumed data).
        epoch: passes over the training data started so far, minus one (0 in the first).
        steps_in_epoch: optimizer steps taken in the current epoch.
        steps_per_epoch: optimizer steps in one full epoch (set when fitting starts).
        consumed_samples: samples of all global batches so far.
        consumed_tokens: tokens of all global batches so far (0 for non-token data).
        skipped_steps: steps whose optimizer update a callback skipped.
    """

    global_step: int = 0
    epoch: int = 0
    steps_in_epoch: int = 0
    steps_per_epoch: int = 0
    consumed_samples: int = 0
    consumed_tokens: int = 0
    skipped_steps: int = 0

    @property
    def fractional_epoch(self) -> float:
        """Epochs completed as a real number, e.g. 1.25 a quarter into the second epoch."""
        if self.steps_per_epoch <= 0:
            return float(self.epoch)
        return self.epoch + self.steps_in_epoch / self.steps_per_epoch

    def state_dict(self) -> dict[str, Any]:
        """The counters as a plain dict (checkpoint-safe: ints only)."""
        return asdict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore counters saved by `state_dict`; unknown keys are an error."""
        known = {f.name for f in fields(self)}
        unknown = set(state) - known
        if unknown:
            raise ValueError(f"TrainState got unknown keys {sorted(unknown)}")
        for key, value in state.items():
            setattr(self, key, int(value))
