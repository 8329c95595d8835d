"""What a checkpoint holds for an exact resume, gathered from and restored into a Trainer."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from nanotrain.runtime.rng import capture_rng_state, restore_rng_state

if TYPE_CHECKING:
    from nanotrain.trainer import Trainer


def make_payload(trainer: Trainer) -> dict[str, Any]:
    """This rank's resume state: "model", "optimizer", "lr_scheduler", "train_state", "data"
    (sampler position), "rng", "callbacks" ({state_key: state}), "config", and "datamodule"
    (a datamodule's `state_dict`, when it has one, as Lightning saves it); then
    `on_save_checkpoint` hooks may add keys (plain values and tensors only)."""
    strategy = trainer.strategy
    setup = strategy.optimizer_setup
    scheduler = setup.scheduler.scheduler if setup and setup.scheduler else None
    sampler = trainer._train_sampler
    payload: dict[str, Any] = {
        "model": strategy.model_state_dict(),
        "optimizer": strategy.optimizer_state_dict() if setup else None,
        "lr_scheduler": scheduler.state_dict() if scheduler is not None else None,
        "train_state": trainer.state.state_dict(),
        "data": sampler.state_dict() if sampler is not None else None,
        "rng": capture_rng_state(),
        "callbacks": {cb.state_key: cb.state_dict() for cb in trainer.callbacks},
        "config": trainer.resolved_config(),
    }
    datamodule_state = trainer.datamodule.state_dict() if trainer.datamodule is not None else None
    if datamodule_state:
        payload["datamodule"] = datamodule_state
    trainer._call("on_save_checkpoint", payload)
    return payload


def restore_payload(trainer: Trainer, payload: dict[str, Any], weights_only: bool = False) -> None:
    """Run the `on_load_checkpoint` hooks, then load a `make_payload` result into the trainer
    (only the model when weights_only). As Lightning, the hooks run before anything loads and
    see the checkpoint under Lightning's names too: the weights as "state_dict" (what a hook
    renames or replaces there is what loads), "epoch" and "global_step"."""
    strategy = trainer.strategy
    payload["state_dict"] = payload.pop("model")
    train_state = payload.get("train_state") or {}
    for key in ("epoch", "global_step"):
        if key not in payload and key in train_state:
            payload[key] = train_state[key]
    trainer._call("on_load_checkpoint", payload)
    payload["model"] = payload.pop("state_dict")
    strategy.load_model_state_dict(payload["model"])
    if not weights_only:
        if payload.get("datamodule") is not None and trainer.datamodule is not None:
            trainer.datamodule.load_state_dict(payload["datamodule"])
        setup = strategy.optimizer_setup
        if payload.get("optimizer") is not None and setup is not None:
            strategy.load_optimizer_state_dict(payload["optimizer"])
        if payload.get("lr_scheduler") is not None and setup and setup.scheduler:
            setup.scheduler.scheduler.load_state_dict(payload["lr_scheduler"])
        trainer.state.load_state_dict(payload["train_state"])
        if payload.get("data") is not None and trainer._train_sampler is not None:
            trainer._load_sampler_state(payload["data"])
        saved_callbacks = payload.get("callbacks", {})
        for cb in trainer.callbacks:
            if cb.state_key in saved_callbacks:
                cb.load_state_dict(saved_callbacks[cb.state_key])
        restore_rng_state(payload["rng"])
