"""TrainerConfig: the Trainer's numbers, validated before anything is built."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


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
        limit_val_batches: validation batches per run: an int count, a float fraction,
            None for all, 0 to disable validation.
        log_every_n_steps: write training scalars every this many steps.
        default_root_dir / name / version: the run directory `<root>/<name>/version_N`
            (version None: the next free number).
        loggers: which loggers rank 0 writes: "tensorboard" and/or "jsonl".
        seed: seeds Python, NumPy and torch before the model is built and the data shuffled.
        deterministic: use only deterministic kernels (slower; errors on ops without one).
        shuffle: shuffle the training data every epoch.
        precision: "32-true" (default), "bf16-mixed", "bf16-true", "16-mixed",
            "transformer-engine", "fp8-emulated" or "fp4-emulated" (see docs/precision.md);
            the Trainer also takes a `nanotrain.precision` plugin object.
    """

    max_steps: int | None = None
    max_epochs: int | None = None
    max_tokens: int | None = None
    global_batch_size: int | None = None
    micro_batch_size: int = 1
    gradient_clip_val: float | None = None
    val_check_interval: int | None = None
    limit_val_batches: int | float | None = None
    log_every_n_steps: int = 10
    default_root_dir: str = "runs"
    name: str = "default"
    version: int | None = None
    loggers: list[str] = field(default_factory=lambda: ["tensorboard", "jsonl"])
    seed: int = 0
    deterministic: bool = False
    shuffle: bool = True
    precision: str = "32-true"

    def __post_init__(self) -> None:
        if self.max_steps is None and self.max_epochs is None and self.max_tokens is None:
            raise ValueError(
                "the Trainer needs a stopping rule: set max_steps, max_epochs or max_tokens"
            )
        for name in ("max_steps", "max_epochs", "max_tokens", "val_check_interval"):
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
        if self.log_every_n_steps <= 0:
            raise ValueError(f"log_every_n_steps must be positive, got {self.log_every_n_steps}")
        if self.gradient_clip_val is not None and self.gradient_clip_val <= 0:
            raise ValueError(f"gradient_clip_val must be positive, got {self.gradient_clip_val}")
        if self.limit_val_batches is not None and self.limit_val_batches < 0:
            raise ValueError(f"limit_val_batches must be >= 0, got {self.limit_val_batches}")
        unknown = set(self.loggers) - {"tensorboard", "jsonl"}
        if unknown:
            raise ValueError(
                f"unknown loggers {sorted(unknown)}; choose from 'tensorboard', 'jsonl'"
            )

    def to_dict(self) -> dict:
        """The settings as a plain dict (for config.yaml)."""
        return asdict(self)
