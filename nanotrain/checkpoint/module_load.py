"""A module rebuilt from a nanotrain checkpoint, as `LightningModule.load_from_checkpoint`
rebuilds one from a `.ckpt` file: its hyperparameters from the run's recorded config, its
weights from the checkpoint (merged from the shards of any layout it was saved under)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from nanotrain.checkpoint import files
from nanotrain.checkpoint.merge import merge_model_shards
from nanotrain.checkpoint.resume import resolve_path
from nanotrain.checkpoint.save_load import load_model_weights
from nanotrain.models.config import config_from_dict

__all__ = ["load_module", "saved_hparams"]


def saved_hparams(payload: dict[str, Any]) -> dict[str, Any]:
    """The module's constructor arguments a checkpoint's recorded config holds: the CLI's
    `model.init_args`, or the module's `hparams` recorded when none was given."""
    model = (payload.get("config") or {}).get("model") or {}
    if isinstance(model.get("init_args"), dict):
        return dict(model["init_args"])
    return {k: v for k, v in model.items() if k != "class_path"}


def load_module(cls: type, path: str | Path, strict: bool = True, **kwargs: Any) -> Any:
    """`cls` built with the hyperparameters recorded in the checkpoint at `path` (a checkpoint
    directory, a folder of checkpoints or its `last` file; `kwargs` override them), its
    model built (`configure_model`), `on_load_checkpoint(checkpoint)` called (the weights under
    "state_dict", as Lightning's), then loaded with those weights, on the CPU, left in the
    mode it was built in (as Lightning: call `.eval()` for inference). Works for checkpoints of every layout
    (sharded ones are merged in this process).

    Raises:
        FileNotFoundError / ValueError: a missing or corrupt checkpoint, or weights that do
            not fit the module (with `strict`, the names that differ).
    """
    ckpt = resolve_path(Path(path))
    meta = files.read_meta(ckpt)
    payload = files.read_torch(ckpt / files.TRAINER_STATE_FILE)
    module = cls(**{**saved_hparams(payload), **kwargs})
    if getattr(module, "config", "absent") is None and payload.get("model_config"):
        # a LanguageModelModule takes its vocabulary from the data it trained on: the
        # checkpoint records the config that resulted
        module.config = config_from_dict(payload["model_config"])
    configure = getattr(module, "configure_model", None)
    if callable(configure):
        configure()
    if meta.get("layout") is None:
        state = load_model_weights(ckpt)
    else:
        state = merge_model_shards(ckpt, module)
    # as Lightning: the hook runs before the weights load, on the checkpoint under Lightning's
    # names ("state_dict": what it renames or replaces there is what loads)
    train_state = payload.get("train_state") or {}
    checkpoint = {
        "epoch": train_state.get("epoch"),
        "global_step": train_state.get("global_step"),
        **payload,
        "state_dict": state,
    }
    hook = getattr(module, "on_load_checkpoint", None)
    if callable(hook):
        hook(checkpoint)
    state = checkpoint["state_dict"]
    own = module.state_dict()
    shapes = [
        f"{name} {tuple(state[name].shape)} vs {tuple(own[name].shape)}"
        for name in own.keys() & state.keys()
        if hasattr(state[name], "shape") and tuple(state[name].shape) != tuple(own[name].shape)
    ]
    if shapes:
        raise ValueError(
            f"the weights of {ckpt} do not fit {cls.__name__} (checkpoint vs module): "
            f"{'; '.join(sorted(shapes)[:8])}; build the module with the hyperparameters it "
            "was trained with (keyword arguments override the recorded ones)"
        )
    missing, unexpected = module.load_state_dict(state, strict=False)
    if strict and (missing or unexpected):
        raise ValueError(
            f"the weights of {ckpt} do not fit {cls.__name__}: missing {sorted(missing)[:8]}, "
            f"unexpected {sorted(unexpected)[:8]}; build the module with the hyperparameters "
            "it was trained with (keyword arguments override the recorded ones), or pass "
            "strict=False"
        )
    return module
