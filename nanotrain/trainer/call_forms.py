"""Lightning's call forms of `fit`, `validate`, `test` and `predict`, read as Lightning reads
them: a datamodule given in the dataloaders' place, the module left out after a `fit`
(the fitted one, with `ckpt_path` defaulting to "best"), and `weights_only`.

Lightning's orders, which the nanotrain Trainer's methods share::

    fit(model, train_dataloaders, val_dataloaders, datamodule, ckpt_path, weights_only)
    validate(model, dataloaders, ckpt_path, verbose, datamodule, weights_only)
    test(model, dataloaders, ckpt_path, verbose, datamodule, weights_only)
    predict(model, dataloaders, datamodule, return_predictions, ckpt_path, weights_only)
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
from torch.utils.data import DataLoader, Dataset

if TYPE_CHECKING:
    from nanotrain.trainer import Trainer

_HOOKS = ("train_dataloader", "val_dataloader", "test_dataloader", "predict_dataloader")


def is_datamodule(obj: Any) -> bool:
    """Whether `obj` is a datamodule: a LightningDataModule, or an object (not a DataLoader,
    Dataset or collection of them) with one of its `*_dataloader()` methods."""
    if isinstance(obj, pl.LightningDataModule):
        return True
    if obj is None or isinstance(obj, DataLoader | Dataset | list | tuple | dict):
        return False
    return any(callable(getattr(obj, hook, None)) for hook in _HOOKS)


def data_arguments(stage: str, datamodule: Any, *loaders: Any) -> tuple[Any, ...]:
    """(datamodule, *loaders) as Lightning reads them: a datamodule in the first loader's
    place (`fit(model, dm)`, `test(model, dm)`) is the datamodule.

    Raises:
        ValueError: both a datamodule and dataloaders (Lightning's error too), naming the stage.
    """
    first, rest = loaders[0], loaders[1:]
    if is_datamodule(first):
        if datamodule is not None:
            raise ValueError(
                f"Trainer.{stage} got two datamodules (one in the dataloaders' place); pass one"
            )
        datamodule, first = first, None
    given = [loader for loader in (first, *rest) if loader is not None]
    if datamodule is not None and given:
        names = "train_dataloaders / val_dataloaders" if stage == "fit" else "dataloaders"
        raise ValueError(
            f"Trainer.{stage} got both {names} and a datamodule (Lightning refuses this too); "
            "pass one of them"
        )
    return (datamodule, first, *rest)


def stage_module(trainer: Trainer, model: Any, stage: str) -> tuple[Any, bool]:
    """(the module `stage` runs, whether it was passed): `model`, else the module of this
    Trainer's last stage (as Lightning's `trainer.lightning_module`).

    Raises:
        TypeError: no module given and none from an earlier stage (Lightning's error too).
    """
    if model is not None:
        return model, True
    if trainer.module is None:
        raise TypeError(
            f"Trainer.{stage}() needs a LightningModule when no earlier fit/validate/test/"
            f"predict of this Trainer had one: trainer.{stage}(model, ...)"
        )
    return trainer.module, False


def default_ckpt_path(trainer: Trainer, stage: str, ckpt_path: Any, model_given: bool) -> Any:
    """`ckpt_path` as Lightning defaults it for validate/test/predict: None with a module
    given (its weights as they are), "best" without one after a fit (with Lightning's
    warning); as given otherwise.

    Raises:
        ValueError: no module, no `ckpt_path` and no fit before (Lightning's "best" has no
            checkpoint to load then).
    """
    if ckpt_path is not None or model_given:
        return ckpt_path
    if trainer.state.global_step == 0:
        raise ValueError(
            f"Trainer.{stage}() without a model loads the best checkpoint of this Trainer's fit "
            f"(as Lightning), but it has not trained: pass the model, trainer.{stage}(model, "
            "...), or a checkpoint, ckpt_path=..."
        )
    warnings.warn(
        f"`.{stage}(ckpt_path=None)` was called without a model: the best model of the "
        f"previous `fit` call will be used (as Lightning). Pass `.{stage}(ckpt_path='best')` "
        f"or `.{stage}(ckpt_path='last')` to silence this warning.",
        UserWarning,
        stacklevel=3,
    )
    return "best"


def check_weights_only(weights_only: bool | None) -> None:
    """Lightning's `weights_only` argument: None and True read checkpoints as nanotrain always
    does (`torch.load(weights_only=True)`, or no pickle at all).

    Raises:
        ValueError: `weights_only=False` (loading that runs pickled code), with the reason.
    """
    if weights_only is False:
        raise ValueError(
            "weights_only=False asks to unpickle arbitrary objects from the checkpoint, which "
            "nanotrain never does (it can run code from the file); leave weights_only unset: "
            "nanotrain reads tensors and plain values only"
        )
