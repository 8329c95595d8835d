"""The Trainer's per-stage setup of the run itself: its seed (Lightning's PL_GLOBAL_SEED
rules) and its directory (planned before anything is validated, written after), with the
config and hyperparameters recorded there."""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.utilities.seed import seed_everything

from nanotrain.runtime.run_files import run_files_error
from nanotrain.trainer.config import resolve_seed
from nanotrain.trainer.loggers import make_loggers
from nanotrain.trainer.run_dir import default_config, write_config


class RunSetupMethods:
    """Mixin of `nanotrain.Trainer`: seed the stage, plan and make the run directory."""

    def _seed(self) -> None:
        """Seed the stage, as Lightning: the global RNGs only when asked. With
        `Trainer(seed=n)`, `seed_everything(n)` at each stage's start (it sets PL_GLOBAL_SEED
        for the stage, which Lightning code inside it reads, e.g. worker seeding; `_teardown`
        puts back what was there, so that one Trainer's seed does not become a later
        Trainer's default). Without it the global RNGs are left as your code left them
        (seeded by your `seed_everything(n)`, your `torch.manual_seed`, or not at all), as
        under lightning.Trainer.

        nanotrain's own randomness stays deterministic either way: the data order and the
        loaders' generators use the run's seed (`settings.seed`: the Trainer's, else
        PL_GLOBAL_SEED, else 0), and nanotrain's modules draw their initial weights under
        `model_init_rng`."""
        requested = self.requested_settings.seed
        self.settings.seed = resolve_seed(requested)
        if not self._seed_env_saved:
            self._seed_env_saved, self._seed_env_before = True, os.environ.get("PL_GLOBAL_SEED")
        self._global_rng_seeded = requested is not None or self._seed_env_before is not None
        if requested is not None:
            seed_everything(self.settings.seed, verbose=False)

    def model_init_rng(self) -> contextlib.AbstractContextManager:
        """Where nanotrain's own modules (`LanguageModelModule.configure_model`) draw their
        initial weights: the global RNG as seeded when you seeded it (`Trainer(seed=...)`,
        `seed_everything`); else a fork of the global torch RNG seeded with the run's seed
        and put back afterwards, so that the weights are the same on every rank and in every
        run while your RNG stream stays untouched."""
        if getattr(self, "_global_rng_seeded", True):
            return contextlib.nullcontext()
        return _seeded_fork(self.settings.seed)

    def _restore_global_seed(self) -> None:
        if not self._seed_env_saved:
            return
        if self._seed_env_before is None:
            os.environ.pop("PL_GLOBAL_SEED", None)
        else:
            os.environ["PL_GLOBAL_SEED"] = self._seed_env_before
        self._seed_env_saved = False

    def _plan_run_dir(self, ckpt_path: Any, stage: str) -> None:
        # Decide only (nothing is written until the inputs and the checkpoint are validated).
        from nanotrain.checkpoint.resume import plan_on_rank_zero

        s = self.settings
        experiment = Path(s.default_root_dir) / s.name
        plan = plan_on_rank_zero(self.strategy, experiment, s, ckpt_path, self.callbacks)
        self.run_dir, self._resume_path = plan.run_dir, plan.checkpoint
        if str(ckpt_path) == "last" and plan.checkpoint is None and self.is_global_zero:
            # as Lightning: not an error (set and forget before the first fit); the stage
            # runs with the weights the module has
            warnings.warn(
                f'.{stage}(ckpt_path="last") is set, but there is no last checkpoint '
                "available. No checkpoint will be loaded. HINT: Set "
                "`ModelCheckpoint(..., save_last=True)`.",
                UserWarning,
                stacklevel=4,
            )

    def _make_run_dir(self) -> None:
        # Only now, with inputs and the resumed checkpoint validated, is anything written.
        from nanotrain.checkpoint.collective import attempt, raise_first_failure

        def make() -> None:
            try:
                (self.run_dir / "checkpoints").mkdir(parents=True, exist_ok=True)
                write_config(self.run_dir, self.resolved_config())
                self.strategy.precision.write_record(self.run_dir)
            except OSError as err:  # read-only, no permission, a file in the way, disk full
                raise run_files_error(
                    err, self.run_dir, "the run directory", "--trainer.default_root_dir"
                ) from err
            names = self.settings.loggers if self._use_named_loggers else []
            self.loggers = make_loggers(self.run_dir, names, self._user_loggers)
            if self.settings.enable_autolog_hparams:
                self.loggers.log_hyperparams(self.hyperparameters())

        error = attempt(make)[1] if self.is_global_zero else None
        raise_first_failure(self.strategy, error, f"creating the run directory {self.run_dir}")

    def hyperparameters(self) -> dict[str, Any]:
        """What the loggers record as hyperparameters: the module's `hparams` merged with the
        datamodule's (as Lightning), else the resolved config."""
        params: dict[str, Any] = {}
        for obj in (self.module, self.datamodule):
            params.update(dict(getattr(obj, "hparams", {}) or {}))
        return params or dict(self.resolved_config())

    def resolved_config(self) -> dict[str, Any]:
        """The config recorded in `config.yaml` and in checkpoints: what was passed as `config`,
        else the trainer settings and the module's and datamodule's plain hyperparameters."""
        if self._user_config is not None:
            return self._user_config
        return default_config(self.settings.to_dict(), self.strategy, self.module, self.datamodule)


@contextlib.contextmanager
def _seeded_fork(seed: int) -> Iterator[None]:
    """The global torch RNGs (CPU and every CUDA device) seeded with `seed` inside, as they
    were afterwards."""
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        yield
