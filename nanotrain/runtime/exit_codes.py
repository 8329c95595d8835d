"""Exit codes of `nanotrain fit` that say why a run ended early, so that a scheduler script
(SLURM, torchrun, a shell loop) can tell "resume me" from "something is wrong".

- 0: training reached its stopping rule (or a callback stopped it normally).
- `EXIT_NONFINITE` (3): NaNGuard stopped on a non-finite loss or gradient; the last good
  state is checkpointed, but resuming as is will likely hit the same values.
- `EXIT_PREEMPTED` (75, `EX_TEMPFAIL` of sysexits.h: "try again later"): a preemption signal
  (SIGTERM/SIGUSR1 by default) arrived; the current step finished and was checkpointed, and
  the same command with `--ckpt_path last` resumes exactly.

A Python caller reads `trainer.exit_code` after `fit` returns.
"""

EXIT_OK = 0
EXIT_NONFINITE = 3
EXIT_PREEMPTED = 75

__all__ = ["EXIT_NONFINITE", "EXIT_OK", "EXIT_PREEMPTED"]
