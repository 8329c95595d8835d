"""nanotrain: Lightning hooks, Megatron parallelism, no global state.

Public API: `Trainer`, `NanoModule`, `LanguageModelModule`, `LossTerms`, `TrainState`,
`StepOutput`, the strategies, and the subpackages `nanotrain.strategies`,
`nanotrain.callbacks`, `nanotrain.data`, `nanotrain.models`, `nanotrain.precision`,
`nanotrain.planning` (memory / time planner, `nanotrain plan`) and `nanotrain.testing` (toy
modules and data for a user's own tests).

Names are imported on first use (PEP 562), so `import nanotrain` and the `nanotrain` command's
`--help` do not pay for torch and Lightning until something needs them.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# public name -> the module that defines it
_EXPORTS = {
    "Callback": "nanotrain.callbacks.base",
    "CollectiveTimeoutError": "nanotrain.runtime.collective_errors",
    "DDPStrategy": "nanotrain.strategies",
    "EXIT_NONFINITE": "nanotrain.runtime.exit_codes",
    "EXIT_PREEMPTED": "nanotrain.runtime.exit_codes",
    "FSDPStrategy": "nanotrain.strategies",
    "LanguageModelModule": "nanotrain.language_model",
    "LossTerms": "nanotrain.loss_terms",
    "MegatronStrategy": "nanotrain.strategies",
    "NanoModule": "nanotrain.module",
    "SingleDeviceStrategy": "nanotrain.strategies",
    "StepOutput": "nanotrain.strategies",
    "Strategy": "nanotrain.strategies",
    "TrainState": "nanotrain.trainer.state",
    "Trainer": "nanotrain.trainer",
    "TrainerConfig": "nanotrain.trainer.config",
}
_SUBPACKAGES = ("callbacks", "data", "models", "planning", "precision", "strategies", "testing")

__all__ = [
    "Callback",
    "CollectiveTimeoutError",
    "DDPStrategy",
    "EXIT_NONFINITE",
    "EXIT_PREEMPTED",
    "FSDPStrategy",
    "LanguageModelModule",
    "LossTerms",
    "MegatronStrategy",
    "NanoModule",
    "SingleDeviceStrategy",
    "StepOutput",
    "Strategy",
    "TrainState",
    "Trainer",
    "TrainerConfig",
    "callbacks",
    "data",
    "models",
    "planning",
    "precision",
    "strategies",
    "testing",
]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
    elif name in _SUBPACKAGES:
        value = importlib.import_module(f"nanotrain.{name}")
    else:
        raise AttributeError(f"module 'nanotrain' has no attribute {name!r}")
    globals()[name] = value  # the next access is a plain lookup
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:  # what type checkers and IDEs see
    from nanotrain import callbacks, data, models, planning, precision, strategies, testing
    from nanotrain.callbacks.base import Callback
    from nanotrain.language_model import LanguageModelModule
    from nanotrain.loss_terms import LossTerms
    from nanotrain.module import NanoModule
    from nanotrain.runtime.collective_errors import CollectiveTimeoutError
    from nanotrain.runtime.exit_codes import EXIT_NONFINITE, EXIT_PREEMPTED
    from nanotrain.strategies import (
        DDPStrategy,
        FSDPStrategy,
        MegatronStrategy,
        SingleDeviceStrategy,
        StepOutput,
        Strategy,
    )
    from nanotrain.trainer import Trainer
    from nanotrain.trainer.config import TrainerConfig
    from nanotrain.trainer.state import TrainState
