"""Lightning's tuner (`Tuner(trainer).lr_find`, `Tuner(trainer).scale_batch_size`, and their
callbacks `LearningRateFinder`, `BatchSizeFinder`) drives `lightning.Trainer`'s own loops from
inside `fit`; under the nanotrain Trainer it is refused at fit start, naming what to run
instead."""

from __future__ import annotations

from typing import Any

from lightning.pytorch.callbacks import BatchSizeFinder, LearningRateFinder

_INSTEAD = {
    LearningRateFinder: (
        "Tuner(trainer).lr_find / LearningRateFinder",
        "lightning.pytorch.tuner.Tuner(lightning.pytorch.Trainer(...)).lr_find(model, ...) "
        "on the same module and data, then set the rate its .suggestion() gives in your "
        "module (e.g. model.lr = ...) before nanotrain's fit",
    ),
    BatchSizeFinder: (
        "Tuner(trainer).scale_batch_size / BatchSizeFinder",
        "lightning.pytorch.tuner.Tuner(lightning.pytorch.Trainer(...)).scale_batch_size("
        "model, ...) on the same module and data, then give the batch size it returns to your "
        "DataLoader (or Trainer(micro_batch_size=...))",
    ),
}


def tuner_refusal(kind: type) -> str:
    """The refusal of Lightning's tuner `kind` (LearningRateFinder or BatchSizeFinder)."""
    habit, instead = _INSTEAD[kind]
    return (
        f"{habit} is not run by the nanotrain Trainer (it drives lightning.Trainer's own "
        f"loops); run it with lightning.Trainer instead: {instead}"
    )


class TunerRefusal(AttributeError):
    """Raised where Lightning's `Tuner.scale_batch_size` first reads a lightning.Trainer
    internal (`_accelerator_connector`), before it adds its callback: an AttributeError, so
    that `hasattr` still answers False."""


def refuse_tuner_callbacks(callbacks: list[Any]) -> None:
    """Raise for a Lightning tuner callback among `callbacks`.

    Raises:
        ValueError: naming the tuner habit and how to run it with lightning.Trainer.
    """
    for callback in callbacks:
        for kind in _INSTEAD:
            if isinstance(callback, kind):
                raise ValueError(tuner_refusal(kind))
