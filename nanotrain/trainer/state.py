"""TrainState: the counters that say where a run is, saved in every checkpoint."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

import torch


def _settled_counter(index: int, doc: str) -> property:
    """A property over entry `index` of `TrainState._settle()` ([samples, tokens])."""

    def get(state: TrainState) -> int:
        return state._settle()[index]

    def set_(state: TrainState, value: int) -> None:
        state._settle()[index] = int(value)

    return property(get, set_, doc=doc)


@dataclass
class TrainState:
    """Where training stands; identical on every rank.

    Attributes:
        global_step: optimizer steps taken (skipped steps included: they consumed data).
        epoch: passes over the training data started so far, minus one (0 in the first).
        steps_in_epoch: optimizer steps taken in the current epoch.
        steps_per_epoch: optimizer steps in one full epoch (set when fitting starts).
        consumed_samples: samples of all global batches so far (a property, see below).
        consumed_tokens: tokens of all global batches so far (0 for non-token data).
        skipped_steps: steps whose optimizer update a callback skipped.
        batches_stepped: training batches run in manual optimization, where a batch may
            take several optimizer steps (Lightning's `_batches_that_stepped`: the step its
            logger rows carry there); 0 under automatic optimization.

    The step's token and sample totals are device tensors (the strategy counts them with a
    collective), so `add_consumed` only adds them up on the device; `consumed_samples` and
    `consumed_tokens` turn the pending sum into Python ints when they are *read* (one
    device read, then free until the next step). A training step that nobody asks about
    them (no logging, no `max_tokens`, no checkpoint) never waits for the device.
    """

    global_step: int = 0
    epoch: int = 0
    steps_in_epoch: int = 0
    steps_per_epoch: int = 0
    skipped_steps: int = 0
    batches_stepped: int = 0
    # host totals [samples, tokens] and the device-side sum not yet read into them
    _settled: list[int] = field(default_factory=lambda: [0, 0], repr=False, compare=False)
    _pending: list[torch.Tensor | int] | None = field(default=None, repr=False, compare=False)

    def add_consumed(self, samples: torch.Tensor | int, tokens: torch.Tensor | int) -> None:
        """Count one step's global samples and tokens without reading them on the host."""
        step = (samples, tokens)
        if self._pending is None:
            self._pending = [0, 0]
        # a device tensor plus a number (or tensor) stays on the device: no host read
        self._pending = [total + value for total, value in zip(self._pending, step, strict=True)]

    def _settle(self) -> list[int]:
        if self._pending is not None:
            pending = [torch.as_tensor(v, dtype=torch.float64).reshape(()) for v in self._pending]
            devices = {t.device for t in pending}
            if len(devices) > 1:  # a count given as a Python number lives on the host
                pending = [t.cpu() for t in pending]
            samples, tokens = torch.stack(pending).round().long().tolist()  # one device read
            self._settled = [self._settled[0] + samples, self._settled[1] + tokens]
            self._pending = None
        return self._settled

    consumed_samples = _settled_counter(
        0, "Samples of all global batches so far (reads the device if a step is pending)."
    )
    consumed_tokens = _settled_counter(
        1, "Tokens of all global batches so far (reads the device if a step is pending)."
    )

    @property
    def fractional_epoch(self) -> float:
        """Epochs completed as a real number, e.g. 1.25 a quarter into the second epoch."""
        if self.steps_per_epoch <= 0:
            return float(self.epoch)
        return self.epoch + self.steps_in_epoch / self.steps_per_epoch

    def state_dict(self) -> dict[str, Any]:
        """The counters as a plain dict (checkpoint-safe: ints only)."""
        names = [f.name for f in fields(self) if not f.name.startswith("_")]
        counters = {name: getattr(self, name) for name in names}
        counters["consumed_samples"], counters["consumed_tokens"] = self._settle()
        return counters

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore counters saved by `state_dict`; unknown keys are an error."""
        known = set(self.state_dict())
        unknown = set(state) - known
        if unknown:
            raise ValueError(f"TrainState got unknown keys {sorted(unknown)}")
        for key, value in state.items():
            setattr(self, key, int(value))
