"""TrainerConfig: the Trainer's numbers, validated before anything is built."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from typing import Any

from nanotrain.trainer.lightning_args import check_launch_arguments

LOGGER_NAMES = ("tensorboard", "csv", "jsonl")


@dataclass
class TrainerConfig:
    """Settings of the training loop, as given. Those left None that the data decides
    (micro_batch_size, global_batch_size, accumulate_grad_batches, seed, shuffle) are resolved
    when a stage starts; `trainer.settings` then holds the values the run uses (and records in
    config.yaml).

    Attributes:
        max_steps: stop after this many optimizer steps (None: no step limit).
        max_epochs: stop after this many passes over the training data (None: no limit).
        max_tokens: stop once this many tokens were consumed (needs `count_tokens`).
        global_batch_size: samples per optimizer step over all data-parallel replicas
            (default: accumulate_grad_batches × micro_batch_size × data-parallel size).
        micro_batch_size: samples per forward/backward pass on one process (default None: the
            training DataLoader's batch_size, 1 for a bare Dataset). Set on the Trainer, every
            DataLoader's batch_size must equal it.
        accumulate_grad_batches: as Lightning's: an optimizer step every this many
            microbatches, i.e. global_batch_size = accumulate_grad_batches × micro_batch_size ×
            data-parallel size (default None: 1, or what global_batch_size implies).
        gradient_clip_val: clip the gradients to this (None: measure the norm, don't clip).
        gradient_clip_algorithm: as Lightning's: "norm" (default) scales the gradients to a
            global norm of at most gradient_clip_val, "value" clamps each element to
            [-gradient_clip_val, gradient_clip_val].
        val_check_interval: validate every this many optimizer steps, counted as Lightning
            counts them: over the whole run when check_val_every_n_epoch is None, else within
            each epoch it selects (then not at epoch ends). A float in (0, 1]: after every
            int(fraction × the epoch's batches) batches of each epoch, as Lightning (1.0: at
            the epoch's end). None: at epoch ends only.
        check_val_every_n_epoch: validate in every this many epochs: at their end without
            val_check_interval, as Lightning does (None: val_check_interval counts over
            the whole run).
        limit_train_batches: as Lightning's: train on the first batches of each epoch only:
            an int n = n batches (per process, as Lightning counts them; a multiple of
            accumulate_grad_batches), a float in (0, 1] = int(fraction × the epoch's batches),
            None for all. The epoch then ends there (epoch-interval schedulers, validation
            and the epoch-end hooks run), and the next one draws its own order.
        overfit_batches: as Lightning's: > 0 trains on the first batches in order (shuffle
            off) and validates on as many: sets limit_train_batches and limit_val_batches to
            it (an int count or a float fraction; 0: off).
        fast_dev_run: as Lightning's: True (1) or n runs n training batches (one epoch, the
            epoch-end validation on n batches), n test / predict batches, with no logger and
            no checkpoint (ModelCheckpoint and EarlyStopping do nothing); False or 0: off.
        max_time: as Lightning's: stop training once this much time has passed since
            training started: "DD:HH:MM:SS", a dict of `datetime.timedelta` arguments, or a
            timedelta (added as `nanotrain.callbacks.Timer(max_time, interval="step")`
            unless a Timer is passed; checked after every optimizer step; the time is kept in
            checkpoints, so a resumed run counts on).
        reload_dataloaders_every_n_epochs: as Lightning's: call the training (and
            validation) DataLoader source again every this many epochs (0: never).
        limit_val_batches: how much validation data a run reads, the same samples under any
            layout: an int n = the first n global batches (n × global_batch_size samples),
            a float in (0, 1] = that fraction of the set, None for all, 0 to disable.
        log_every_n_steps: write training scalars every this many steps.
        default_root_dir / name / version: the run directory `<root>/<name>/version_N`
            (version None: the next free number).
        loggers: which built-in loggers rank 0 writes into the run directory: any of
            "tensorboard", "csv", "jsonl" (Lightning `Logger` objects: `Trainer(logger=...)`).
        seed: seeds Python, NumPy and torch when each stage starts, before the model is built
            and the data shuffled. Default None: the global RNGs are left as the user's code
            left them (as Lightning), and PL_GLOBAL_SEED (`lightning.seed_everything(n)`), else
            0, seeds the data order and nanotrain's modules' initial weights.
        deterministic: as Lightning: True uses only deterministic kernels (slower; errors on
            ops without one), "warn" warns on those ops instead, False turns it off, None
            (default) leaves torch's setting as it is.
        shuffle: whether the training data is shuffled every epoch (default None: as the
            training DataLoader's sampler says; a bare Dataset is shuffled). True or False
            must agree with a DataLoader's sampler.
        enable_checkpointing: add the default `ModelCheckpoint` (unless one is passed).
        enable_progress_bar: add the default `ProgressBar` (unless one is passed).
        enable_monitors: add the default LR, throughput, grad-norm and MoE-load monitors
            and the run report (`RunReport`).
        preemption_signals: signals that make `fit` finish the current step, save a
            checkpoint and return with `exit_code` 75 (`nanotrain.runtime.exit_codes.EXIT_PREEMPTED`);
            [] leaves signals alone.
        validate_at_start: also validate before the first step of a fresh run (step 0), so
            the validation curve starts at the untrained loss; the final validation at the
            last step runs either way.
        accelerator / devices / num_nodes: Lightning's; torchrun starts the processes, so
            they are accepted when they describe the job as launched ("auto", the processes
            per node, the node count) and refused otherwise; accelerator "cpu" or "gpu" picks
            the device of a strategy given by name (`nanotrain.trainer.lightning_args`).
        num_sanity_val_steps: None or 0 only: nanotrain runs no sanity-check validation
            (validate_at_start validates the untrained model at step 0 instead).
        enable_model_summary: print Lightning's model summary (layer table and parameter
            counts) on rank 0 when fit starts.
        enable_autolog_hparams: record the hyperparameters in every logger (as Lightning);
            False records them only in the run's config.yaml.
        precision: "32-true" (default), "bf16-mixed", "bf16-true", "16-mixed",
            "transformer-engine", "torchao-float8", "fp8-emulated" or "fp4-emulated" (see
            docs/precision.md);
            the Trainer also takes a `nanotrain.precision` plugin object.
    """

    max_steps: int | None = None
    max_epochs: int | None = None
    max_tokens: int | None = None
    global_batch_size: int | None = None
    micro_batch_size: int | None = None
    accumulate_grad_batches: int | None = None
    gradient_clip_val: float | None = None
    gradient_clip_algorithm: str | None = None
    val_check_interval: int | float | None = None
    check_val_every_n_epoch: int | None = 1
    limit_val_batches: int | float | None = None
    limit_train_batches: int | float | None = None
    overfit_batches: int | float = 0
    fast_dev_run: int | bool = False
    max_time: Any = None
    reload_dataloaders_every_n_epochs: int = 0
    log_every_n_steps: int = 50  # Lightning's default
    default_root_dir: str = "runs"
    name: str = "default"
    version: int | None = None
    loggers: list[str] = field(default_factory=lambda: ["tensorboard", "jsonl"])
    seed: int | None = None
    deterministic: bool | str | None = None
    shuffle: bool | None = None
    enable_checkpointing: bool = True
    enable_progress_bar: bool = True
    enable_monitors: bool = True
    preemption_signals: list[str] = field(default_factory=lambda: ["SIGTERM", "SIGUSR1"])
    validate_at_start: bool = False
    precision: str = "32-true"
    accelerator: str = "auto"
    devices: Any = "auto"
    num_nodes: int | None = None
    num_sanity_val_steps: int | None = None
    enable_model_summary: bool = False
    enable_autolog_hparams: bool = True

    def __post_init__(self) -> None:
        # Lightning's spellings: -1 is "no limit", a clip value of 0 "no clipping", a float
        # val_check_interval a fraction of the epoch (1.0: at its end, as None)
        for name in ("max_steps", "max_epochs"):
            if getattr(self, name) == -1 and type(getattr(self, name)) is int:
                setattr(self, name, None)
        if self.gradient_clip_val == 0:
            self.gradient_clip_val = None
        _check_val_fraction(self.val_check_interval, self.check_val_every_n_epoch)
        if self.val_check_interval == 1.0 and type(self.val_check_interval) is float:
            self.val_check_interval = None
        _apply_debug_switches(self)
        names = ("max_steps", "max_epochs", "max_tokens")
        if type(self.val_check_interval) is not float:
            names += ("val_check_interval",)
        for name in (*names, "check_val_every_n_epoch"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value <= 0):
                raise ValueError(f"{name} must be a positive integer or None, got {value!r}")
        for name in ("micro_batch_size", "global_batch_size", "accumulate_grad_batches"):
            value = getattr(self, name)
            if value is not None and (type(value) is not int or value <= 0):
                raise ValueError(f"{name} must be a positive integer or None, got {value!r}")
        micro, total = self.micro_batch_size, self.global_batch_size
        if micro is not None and total is not None and total % micro:
            raise ValueError(
                f"global_batch_size={total} is not a multiple of micro_batch_size={micro}; "
                f"e.g. use global_batch_size={(total // micro + 1) * micro}"
            )
        if self.seed is not None and (type(self.seed) is not int or not 0 <= self.seed < 2**32):
            raise ValueError(
                f"seed must be an integer in [0, 2**32) or None (PL_GLOBAL_SEED, else 0), got "
                f"{self.seed!r}"
            )
        if self.shuffle is not None and not isinstance(self.shuffle, bool):
            raise ValueError(
                f"shuffle must be True, False or None (the DataLoader's sampler decides), got "
                f"{self.shuffle!r}"
            )
        if not isinstance(self.default_root_dir, str | os.PathLike):
            raise TypeError(
                f"default_root_dir must be a path (str or pathlib.Path), got "
                f"{type(self.default_root_dir).__name__}"
            )
        self.default_root_dir = os.fspath(self.default_root_dir)  # recorded in config.yaml
        if self.deterministic not in (None, True, False, "warn"):
            raise ValueError(
                f"deterministic must be True, False, 'warn' or None (torch's setting left as it "
                f"is), got {self.deterministic!r}"
            )
        if self.log_every_n_steps <= 0:
            raise ValueError(f"log_every_n_steps must be positive, got {self.log_every_n_steps}")
        if self.gradient_clip_val is not None and self.gradient_clip_val <= 0:
            raise ValueError(f"gradient_clip_val must be positive, got {self.gradient_clip_val}")
        if self.gradient_clip_algorithm not in (None, "norm", "value"):
            raise ValueError(
                f"gradient_clip_algorithm must be 'norm', 'value' or None, got "
                f"{self.gradient_clip_algorithm!r}"
            )
        if self.num_sanity_val_steps not in (None, 0):
            raise ValueError(
                f"num_sanity_val_steps={self.num_sanity_val_steps!r}: nanotrain runs no "
                "sanity-check validation before training; pass 0 or drop it "
                "(validate_at_start=True validates the untrained model at step 0 instead)"
            )
        _check_limit_val_batches(self.limit_val_batches)
        _check_limit_val_batches(self.limit_train_batches, "limit_train_batches")
        if type(self.reload_dataloaders_every_n_epochs) is not int or (
            self.reload_dataloaders_every_n_epochs < 0
        ):
            raise ValueError(
                "reload_dataloaders_every_n_epochs must be an int >= 0 (0: never), got "
                f"{self.reload_dataloaders_every_n_epochs!r}"
            )
        if self.max_time is not None:
            from nanotrain.callbacks.timer import parse_duration

            parse_duration(self.max_time, "max_time")  # raises ValueError for a bad form
        check_launch_arguments(self.accelerator, self.devices, self.num_nodes)
        unknown = set(self.loggers) - set(LOGGER_NAMES)
        if unknown:
            raise ValueError(
                f"unknown loggers {sorted(unknown)}; choose from {', '.join(LOGGER_NAMES)} (for "
                "other Lightning loggers pass the object: Trainer(logger=...) or --trainer.logger)"
            )

        from nanotrain.trainer.preemption import signal_numbers

        signal_numbers(self.preemption_signals)  # raises ValueError for an unknown name

    def to_dict(self) -> dict:
        """The settings as a plain dict (for config.yaml; a timedelta max_time as its
        seconds)."""
        out = asdict(self)
        if isinstance(self.max_time, timedelta):
            out["max_time"] = {"seconds": self.max_time.total_seconds()}
        return out

    def check_stopping_rule(self) -> None:
        """Raise ValueError when fit has no stopping rule (validate, test and predict need
        none).

        Raises:
            ValueError: none of max_steps, max_epochs, max_tokens, max_time, fast_dev_run.
        """
        if all(
            getattr(self, name) is None
            for name in ("max_steps", "max_epochs", "max_tokens", "max_time")
        ):
            raise ValueError(
                "fit needs a stopping rule: set max_steps, max_epochs, max_tokens or max_time "
                "(lightning.Trainer would run max_epochs=1000 here: pass that for its run); "
                "validate, test and predict need none"
            )


def _apply_debug_switches(config: TrainerConfig) -> None:
    """Lightning's `fast_dev_run` and `overfit_batches`, resolved into the settings they
    stand for (as Lightning's `_init_debugging_flags`).

    Raises:
        ValueError: a negative or non-integer fast_dev_run, or a bad overfit_batches, or
            overfit_batches with shuffle=True.
    """
    fast = config.fast_dev_run
    if type(fast) not in (bool, int) or fast < 0:
        raise ValueError(f"fast_dev_run must be True, False or an int >= 0, got {fast!r}")
    overfit = config.overfit_batches
    if isinstance(overfit, bool) or not isinstance(overfit, int | float) or overfit < 0:
        raise ValueError(
            f"overfit_batches must be an int >= 0 (batches) or a float in [0, 1] (a fraction), "
            f"got {overfit!r}"
        )
    if isinstance(overfit, float) and overfit > 1:
        raise ValueError(
            f"overfit_batches={overfit!r}: a float is a fraction of the batches, in [0, 1]; "
            f"pass an int for a number of batches"
        )
    if fast:
        n = int(fast)
        if not overfit:
            config.limit_train_batches = config.limit_val_batches = n
        config.max_steps, config.max_epochs = n, 1
        config.val_check_interval, config.check_val_every_n_epoch = None, 1
        config.max_time = None  # Lightning keeps the Timer, which cannot fire in n steps
        config.enable_checkpointing = False
        config.loggers = []
    if overfit:
        if config.shuffle:
            raise ValueError(
                "overfit_batches trains on the first batches in order; shuffle=True "
                "contradicts it: drop one of them"
            )
        config.limit_train_batches = config.limit_val_batches = overfit


def resolve_seed(seed: int | None) -> int:
    """The run's seed: `seed` when given, else Lightning's global seed (the PL_GLOBAL_SEED
    environment variable that `lightning.seed_everything(n)` sets), else 0 (Lightning's
    default).

    Raises:
        ValueError: PL_GLOBAL_SEED is set but not an integer in [0, 2**32).
    """
    if seed is not None:
        return seed
    text = os.environ.get("PL_GLOBAL_SEED")
    if text is None:
        return 0
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value < 2**32:
        raise ValueError(
            f"the environment variable PL_GLOBAL_SEED={text!r} (lightning.seed_everything's "
            "seed, which the Trainer uses when it has no seed) is not an integer in [0, 2**32); "
            "unset it or pass Trainer(seed=...)"
        )
    return value


def _check_limit_val_batches(limit: int | float | None, name: str = "limit_val_batches") -> None:
    """An int >= 0 (a count), a float in (0, 1] (a fraction; 0.0 disables too) or None.

    Raises:
        ValueError: a negative count or a fraction outside (0, 1], with the fix.
    """
    if limit is None:
        return
    if isinstance(limit, float):
        if not 0.0 <= limit <= 1.0:
            raise ValueError(
                f"{name}={limit!r}: a float is a fraction of the batches and "
                "must lie in (0, 1] (1.0 = all); for a number of batches pass an int"
                + (f", e.g. {int(limit)}" if limit > 1 and limit == int(limit) else "")
            )
        return
    if not isinstance(limit, int) or limit < 0:
        raise ValueError(
            f"{name} must be an int >= 0 (a count), a float in (0, 1] (a fraction) "
            f"or None (all), got {limit!r}"
        )


def _check_val_fraction(value: Any, every_n_epochs: int | None) -> None:
    """A float `val_check_interval` is Lightning's fraction of an epoch: in (0, 1], and it
    needs epochs to be a fraction of (`check_val_every_n_epoch` set).

    Raises:
        ValueError: naming the value and what to pass instead.
    """
    if type(value) is not float:
        return
    if not 0.0 < value <= 1.0:
        raise ValueError(
            f"val_check_interval={value!r}: a float is a fraction of the training epoch, in "
            "(0, 1]; pass an int to validate every that many optimizer steps"
        )
    if every_n_epochs is None:
        raise ValueError(
            f"val_check_interval={value!r} is a fraction of an epoch, which needs "
            "check_val_every_n_epoch (as Lightning); pass an int number of steps instead"
        )
