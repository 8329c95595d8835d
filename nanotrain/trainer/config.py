"""TrainerConfig: the Trainer's numbers, validated before anything is built."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field, fields

LOGGER_NAMES = ("tensorboard", "csv", "jsonl")


@dataclass
class TrainerConfig:
    """Settings of the training loop.

    Attributes:
        max_steps: stop after this many optimizer steps (None: no step limit).
        max_epochs: stop after this many passes over the training data (None: no limit).
        max_tokens: stop once this many tokens were consumed (needs `count_tokens`).
        global_batch_size: samples per optimizer step over all data-parallel replicas
            (default: micro_batch_size, i.e. no accumulation on one process).
        micro_batch_size: samples per forward/backward pass on one process. Gradient
            accumulation = global_batch_size / (micro_batch_size × data-parallel size).
        gradient_clip_val: clip the global grad norm to this (None: measure, don't clip).
        val_check_interval: validate every this many optimizer steps (None: only at the end).
        check_val_every_n_epoch: also validate at the end of every this many completed
            epochs, as Lightning does (None: not at epoch ends).
        limit_val_batches: how much validation data a run reads, the same samples under any
            layout: an int n = the first n global batches (n × global_batch_size samples),
            a float in (0, 1] = that fraction of the set, None for all, 0 to disable.
        log_every_n_steps: write training scalars every this many steps.
        default_root_dir / name / version: the run directory `<root>/<name>/version_N`
            (version None: the next free number).
        loggers: which built-in loggers rank 0 writes into the run directory: any of
            "tensorboard", "csv", "jsonl" (Lightning `Logger` objects: `Trainer(logger=...)`).
        seed: seeds Python, NumPy and torch before the model is built and the data shuffled.
        deterministic: use only deterministic kernels (slower; errors on ops without one).
        shuffle: shuffle the training data every epoch.
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
        precision: "32-true" (default), "bf16-mixed", "bf16-true", "16-mixed",
            "transformer-engine", "torchao-float8", "fp8-emulated" or "fp4-emulated" (see
            docs/precision.md);
            the Trainer also takes a `nanotrain.precision` plugin object.
    """

    max_steps: int | None = None
    max_epochs: int | None = None
    max_tokens: int | None = None
    global_batch_size: int | None = None
    micro_batch_size: int = 1
    gradient_clip_val: float | None = None
    val_check_interval: int | None = None
    check_val_every_n_epoch: int | None = 1
    limit_val_batches: int | float | None = None
    log_every_n_steps: int = 10
    default_root_dir: str = "runs"
    name: str = "default"
    version: int | None = None
    loggers: list[str] = field(default_factory=lambda: ["tensorboard", "jsonl"])
    seed: int = 0
    deterministic: bool = False
    shuffle: bool = True
    enable_checkpointing: bool = True
    enable_progress_bar: bool = True
    enable_monitors: bool = True
    preemption_signals: list[str] = field(default_factory=lambda: ["SIGTERM", "SIGUSR1"])
    validate_at_start: bool = False
    precision: str = "32-true"

    def __post_init__(self) -> None:
        if self.max_steps is None and self.max_epochs is None and self.max_tokens is None:
            raise ValueError(
                "the Trainer needs a stopping rule: set max_steps, max_epochs or max_tokens"
            )
        names = ("max_steps", "max_epochs", "max_tokens", "val_check_interval")
        for name in (*names, "check_val_every_n_epoch"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value <= 0):
                raise ValueError(f"{name} must be a positive integer or None, got {value!r}")
        if not isinstance(self.micro_batch_size, int) or self.micro_batch_size <= 0:
            raise ValueError(
                f"micro_batch_size must be a positive integer, got {self.micro_batch_size!r}"
            )
        if self.global_batch_size is None:
            self.global_batch_size = self.micro_batch_size
        if not isinstance(self.global_batch_size, int) or self.global_batch_size <= 0:
            raise ValueError(
                f"global_batch_size must be a positive integer, got {self.global_batch_size!r}"
            )
        if self.global_batch_size % self.micro_batch_size:
            raise ValueError(
                f"global_batch_size={self.global_batch_size} is not a multiple of "
                f"micro_batch_size={self.micro_batch_size}; e.g. use global_batch_size="
                f"{(self.global_batch_size // self.micro_batch_size + 1) * self.micro_batch_size}"
            )
        if not isinstance(self.default_root_dir, str | os.PathLike):
            raise TypeError(
                f"default_root_dir must be a path (str or pathlib.Path), got "
                f"{type(self.default_root_dir).__name__}"
            )
        self.default_root_dir = os.fspath(self.default_root_dir)  # recorded in config.yaml
        if self.log_every_n_steps <= 0:
            raise ValueError(f"log_every_n_steps must be positive, got {self.log_every_n_steps}")
        if self.gradient_clip_val is not None and self.gradient_clip_val <= 0:
            raise ValueError(f"gradient_clip_val must be positive, got {self.gradient_clip_val}")
        _check_limit_val_batches(self.limit_val_batches)
        unknown = set(self.loggers) - set(LOGGER_NAMES)
        if unknown:
            raise ValueError(
                f"unknown loggers {sorted(unknown)}; choose from {', '.join(LOGGER_NAMES)} (for "
                "other Lightning loggers pass the object: Trainer(logger=...) or --trainer.logger)"
            )

        from nanotrain.trainer.preemption import signal_numbers

        signal_numbers(self.preemption_signals)  # raises ValueError for an unknown name

    def to_dict(self) -> dict:
        """The settings as a plain dict (for config.yaml)."""
        return asdict(self)


def _check_limit_val_batches(limit: int | float | None) -> None:
    """An int >= 0 (a count), a float in (0, 1] (a fraction; 0.0 disables too) or None.

    Raises:
        ValueError: a negative count or a fraction outside (0, 1], with the fix.
    """
    if limit is None:
        return
    if isinstance(limit, float):
        if not 0.0 <= limit <= 1.0:
            raise ValueError(
                f"limit_val_batches={limit!r}: a float is a fraction of the validation batches and "
                "must lie in (0, 1] (1.0 = all); for a number of batches pass an int"
                + (f", e.g. {int(limit)}" if limit > 1 and limit == int(limit) else "")
            )
        return
    if not isinstance(limit, int) or limit < 0:
        raise ValueError(
            f"limit_val_batches must be an int >= 0 (a count), a float in (0, 1] (a fraction) "
            f"or None (all), got {limit!r}"
        )


# Lightning Trainer arguments that nanotrain spells differently, with what to use instead
LIGHTNING_ARGUMENTS = {
    "accelerator": "pick a strategy: strategy=SingleDeviceStrategy('cuda'|'cpu'), 'ddp' or "
    "MegatronStrategy(...); devices come from torchrun",
    "devices": "start one process per device with torchrun --nproc-per-node N",
    "num_nodes": "start the processes with torchrun (--nnodes)",
    "accumulate_grad_batches": "set global_batch_size = micro_batch_size × data-parallel "
    "size × accumulation",
    "num_sanity_val_steps": "nanotrain runs no sanity validation; drop it",
    "limit_train_batches": "use max_steps",
    "gradient_clip_algorithm": "gradient_clip_val clips the global norm; drop it",
    "enable_model_summary": "add nanotrain.callbacks.ModelDump for a summary; drop it",
}


def unknown_setting_error(name: str) -> TypeError:
    """The TypeError for a Trainer keyword nanotrain does not know, with the nanotrain way
    for the Lightning arguments that have one."""
    hint = LIGHTNING_ARGUMENTS.get(name)
    known = ", ".join(f.name for f in fields(TrainerConfig))
    if hint:
        return TypeError(
            f"Trainer got Lightning's argument {name!r}, which nanotrain spells differently: {hint}"
        )
    return TypeError(f"Trainer got an unknown argument {name!r}; settings are: {known}")
