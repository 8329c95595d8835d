"""nanotrain: Lightning hooks, Megatron parallelism, no global state.

Public API: `Trainer`, `NanoModule`, `LossTerms`, `TrainState`, `StepOutput`, and the subpackages
`nanotrain.strategies`, `nanotrain.callbacks`, `nanotrain.data`, `nanotrain.models`,
`nanotrain.precision`, `nanotrain.planning` (memory / time planner, `nanotrain plan`).
"""

from nanotrain import callbacks, data, precision, strategies
from nanotrain.callbacks.base import Callback
from nanotrain.collective_errors import CollectiveTimeoutError
from nanotrain.exit_codes import EXIT_NONFINITE, EXIT_PREEMPTED
from nanotrain.language_model import LanguageModelModule
from nanotrain.loss_terms import LossTerms
from nanotrain.module import NanoModule
from nanotrain.state import TrainState
from nanotrain.strategies import (
    DDPStrategy,
    MegatronStrategy,
    SingleDeviceStrategy,
    StepOutput,
    Strategy,
)
from nanotrain.trainer import Trainer
from nanotrain.trainer_config import TrainerConfig

__version__ = "0.1.0"

__all__ = [
    "Callback",
    "CollectiveTimeoutError",
    "DDPStrategy",
    "EXIT_NONFINITE",
    "EXIT_PREEMPTED",
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
    "precision",
    "strategies",
]
