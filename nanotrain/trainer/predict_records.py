"""`trainer.predict_loop`: what Lightning's `BasePredictionWriter` reads of a running
`predict` (the sample indices of the batch now ending, those of every batch of the run, and
the run's predictions), kept as Lightning's prediction loop keeps them."""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.callbacks import BasePredictionWriter
from lightning.pytorch.utilities import move_data_to_device


class PredictRecords:
    """The part of Lightning's `_PredictionLoop` its `BasePredictionWriter` reads.

    Attributes:
        current_batch_indices: the dataset indices of the batch now in `predict_step` (set
            only while a writer writes per batch), [] before.
        epoch_batch_indices: per dataloader (one here), the dataset indices of each batch run
            so far (kept only while a writer writes per epoch), [] outside `predict`.
    """

    def __init__(self) -> None:
        self.current_batch_indices: list[int] = []
        self.epoch_batch_indices: list[list[list[int]]] = []
        self._predictions: list[list[Any]] = []
        self._on_batch = self._on_epoch = False

    def start(self, callbacks: list[Any]) -> None:
        """Begin a `predict` run with the Trainer's `callbacks` (its writers say what to keep)."""
        writers = [cb for cb in callbacks if isinstance(cb, BasePredictionWriter)]
        self._on_batch = any(w.interval.on_batch for w in writers)
        self._on_epoch = any(w.interval.on_epoch for w in writers)
        self.epoch_batch_indices = [[]]
        self._predictions = [[]]

    def before_batch(self, indices: list[int]) -> None:
        """Record the dataset `indices` of the batch about to run, as Lightning before
        `on_predict_batch_start`."""
        if self._on_epoch:
            self.epoch_batch_indices[0].append(list(indices))
        if self._on_batch:
            self.current_batch_indices = list(indices)

    def keep(self, prediction: Any, returning: bool) -> None:
        """Keep `prediction` (on the CPU, as Lightning) when the run returns its predictions
        (`returning`) or a writer writes them at the epoch's end."""
        if returning or self._on_epoch:
            self._predictions[0].append(move_data_to_device(prediction, torch.device("cpu")))

    @property
    def predictions(self) -> list[Any]:
        """The predictions kept so far, one per batch (Lightning's `predict_loop.predictions`
        for one dataloader)."""
        return self._predictions[0] if self._predictions else []

    def end(self, returning: bool) -> None:
        """End the run, as Lightning before `on_predict_end`: drop what is not returned."""
        if not returning:
            self._predictions = []
        self.epoch_batch_indices = []
