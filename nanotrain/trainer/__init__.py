"""The Trainer's room: the fixed loop and everything it runs between hook events.

One concern per file:

- `trainer.py`: `Trainer`: its construction and state, hook dispatch, the `fit` entry point;
- `epoch_loop.py`: the loop over epochs and optimizer steps, and when it stops;
- `stage_lifecycle.py`: what every stage does at its start (setup hooks, loaders) and end;
- `train_step.py`: one optimizer step's hook sequence and bookkeeping;
- `validation.py` / `evaluation.py`: `validate` and the validation pass, and test / predict
  with the end of an epoch's logging;
- `config.py`: `TrainerConfig`, the Trainer's validated numbers;
- `state.py`: `TrainState`, the counters saved in every checkpoint;
- `loaders.py`: a user's DataLoader re-batched into microbatches in resumable order;
- `metric_book.py`: `self.log` values with Lightning's semantics;
- `loggers.py`: Lightning `Logger` objects written by rank 0;
- `run_dir.py`: the run directory and its saved config;
- `preemption.py`: SIGTERM / SIGUSR1 -> save and exit with "resume me";
- `checkpoint_methods.py`: `save_checkpoint` / `load_checkpoint` behind Lightning's names;
- `properties.py`: the read-only properties Lightning code reads off a trainer.
"""

from nanotrain.trainer.config import TrainerConfig
from nanotrain.trainer.state import TrainState
from nanotrain.trainer.trainer import Trainer

__all__ = ["Trainer", "TrainerConfig", "TrainState"]
