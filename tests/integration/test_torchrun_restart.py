"""Automatic restart under `torchrun --max-restarts` on CPU/gloo, a bug in user code on one
rank, and preemption of one rank.

The real `nanotrain fit` command under torchrun (`--max-restarts 1`) with 2 DDP workers on the
toy classifier (tests/unit/test_checkpoint.py's DropoutAdamClassifier: dropout, Adam, a step
LR schedule, shuffled data), checkpointing every 2 steps, always with `--ckpt_path last`,
inside docs/checkpointing.md's SLURM recipe:

* SIGKILL of rank 1 during step 5 of the first attempt: torchrun restarts both workers and
  they resume from step 4;
* in step 7 of that second attempt, a bug in the user's own code (a callback) raises on rank
  1 alone while rank 0 waits in the step's collective: its traceback is printed once (not as
  nanotrain's one-line user error, nor again by rank 0 or torchrun's report), the exit record
  says "crashed" although torchrun then stops rank 0, and the recipe does not requeue;
* the resubmitted job (the bug fixed) is preempted in step 7: SIGTERM to rank 1 only, both
  ranks finish step 7, save it and exit with 75, and the recipe reads "preempted" and
  requeues;
* the requeued command resumes at step 8, and every step's loss equals the uninterrupted
  run's.

The resubmitted and requeued jobs run the command's entry point on forked 2-rank worlds with
torchrun's variables (each torchrun job would only add three fresh interpreters; the first job
covers the launcher, its restart and the way it stops the other rank); the recipe then runs on
the record the preempted job left, its launch line a no-op.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import nanotrain as nt
from nanotrain.callbacks import ModelCheckpoint
from nanotrain.runtime.exit_codes import EXIT_PREEMPTED
from nanotrain.testing import BlobsData
from tests.distributed.spawn import run_world
from tests.integration.test_cli_errors import _command_on_rank, slurm_recipe

pytestmark = pytest.mark.distributed

REPO = Path(__file__).resolve().parents[2]


class SignalRankAt(nt.Callback):
    """Sends `signum` to rank `rank` at the start of step `step` of torchrun's attempt
    `attempt` (TORCHELASTIC_RESTART_COUNT) only."""

    def __init__(self, step: int, rank: int, signum: int, attempt: int) -> None:
        self.step, self.rank, self.signum, self.attempt = step, rank, signum, attempt

    def on_train_step_start(self, trainer, module, batch, batch_idx) -> None:
        this_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == str(self.attempt)
        at = trainer.global_step + 1 == self.step and trainer.global_rank == self.rank
        if this_attempt and at:
            os.kill(os.getpid(), self.signum)


class PlantedBug(nt.Callback):
    """A bug in the user's own code: raises on rank `rank` at the start of step `step` of
    torchrun's attempt `attempt`."""

    def __init__(self, step: int, rank: int, attempt: int) -> None:
        self.step, self.rank, self.attempt = step, rank, attempt

    def on_train_step_start(self, trainer, module, batch, batch_idx) -> None:
        this_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == str(self.attempt)
        at = trainer.global_step + 1 == self.step and trainer.global_rank == self.rank
        if this_attempt and at:
            raise ValueError(PLANTED)


PLANTED = "rank 1 found a shard it cannot read (planted by the test)"
JOB = "tests.integration.test_torchrun_restart"


def write_config(config: Path, *callbacks: str) -> Path:
    """The job's config: the run, and `callbacks` after the checkpoint callback."""
    config.write_text(
        """
trainer: {max_steps: 8, micro_batch_size: 4, global_batch_size: 16, seed: 3,
          loggers: [jsonl], log_every_n_steps: 1, limit_val_batches: 0}
model: {class_path: tests.unit.test_checkpoint.DropoutAdamClassifier}
data: {class_path: nanotrain.testing.BlobsData, init_args: {num_train: 64, num_val: 16, batch_size: 4}}
callbacks:
  - {class_path: nanotrain.callbacks.checkpoint.ModelCheckpoint, init_args: {every_n_steps: 2}}
"""
        + "".join(f"  - {c}\n" for c in callbacks)
    )
    return config


#: the first job: SIGKILL of rank 1 in step 5 of the first attempt, the bug on rank 1 in step 7
#: of the second
FIRST_JOB = (
    f"{{class_path: {JOB}.SignalRankAt, init_args: "
    f"{{step: 5, rank: 1, signum: {int(signal.SIGKILL)}, attempt: 0}}}}",
    f"{{class_path: {JOB}.PlantedBug, init_args: {{step: 7, rank: 1, attempt: 1}}}}",
)
#: the resubmitted job, the bug fixed: SIGTERM to rank 1 in step 7
RESUBMITTED = (
    f"{{class_path: {JOB}.SignalRankAt, init_args: "
    f"{{step: 7, rank: 1, signum: {int(signal.SIGTERM)}, attempt: 0}}}}",
)


def fit_args(config: Path, root: Path) -> list[str]:
    """The job's `nanotrain` arguments."""
    return ["fit", "--config", str(config), "--strategy", "ddp",
            "--trainer.default_root_dir", str(root), "--ckpt_path", "last"]  # fmt: skip


def recipe_environment(recipe: Path) -> dict[str, str]:
    """The variables of docs/checkpointing.md's SLURM script as run in `recipe` (a folder):
    job id 4242, submitted from `recipe`, with its stand-in scontrol first on PATH."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO),
            "SLURM_JOB_ID": "4242", "SLURM_SUBMIT_DIR": str(recipe),
            "PATH": f"{recipe / 'bin'}:{os.environ['PATH']}"}  # fmt: skip


def torchrun(config: Path, root: Path, *extra: str, recipe: Path) -> subprocess.CompletedProcess:
    """The job under torchrun inside docs/checkpointing.md's SLURM script (`recipe_environment`)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    command += [*extra, "--standalone", "-m", "nanotrain", *fit_args(config, root)]
    return subprocess.run(
        slurm_recipe(recipe, command), cwd=REPO, env=recipe_environment(recipe),
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip


def _error_lines(output: str) -> list[str]:
    return [ln for ln in output.splitlines() if ln.startswith("nanotrain: error: ")]


def losses(root: Path) -> dict[int, float]:
    """train/loss by step number (its record is at the 0-based step, Lightning's convention)."""
    records = (root / "default" / "version_0" / "metrics.jsonl").read_text().splitlines()
    return {r["step"] + 1: r["train/loss"] for r in map(json.loads, records) if "train/loss" in r}


def _straight(rank: int, world_size: int, root: str) -> None:
    """The configs' run without any signal, on a forked 2-rank world: what torchrun's workers
    build from the config (same module, data, settings, callbacks and DDP)."""
    from tests.unit.test_checkpoint import DropoutAdamClassifier

    trainer = nt.Trainer(
        strategy=nt.DDPStrategy(), max_steps=8, micro_batch_size=4, global_batch_size=16,
        seed=3, loggers=["jsonl"], log_every_n_steps=1, limit_val_batches=0,
        default_root_dir=root, callbacks=[ModelCheckpoint(every_n_steps=2)],
    )  # fmt: skip
    trainer.fit(DropoutAdamClassifier(), BlobsData(num_train=64, num_val=16, batch_size=4))


def test_torchrun_restarts_after_sigkill_a_user_bug_crashes_sigterm_preempts_and_it_resumes_exactly(
    tmp_path,
):
    # One uninterrupted reference, in-process (a torchrun job of its own would only repeat
    # the start-up)
    run_world(_straight, 2, str(tmp_path / "straight"), timeout=120)
    expected = losses(tmp_path / "straight")
    root = tmp_path / "runs"
    ckpts = root / "default" / "version_0" / "checkpoints"
    job = tmp_path / "job"
    job.mkdir()
    record = job / "exit-4242.json"  # where the recipe's NANOTRAIN_EXIT_FILE points

    # attempt 0 loses rank 1 to SIGKILL in step 5; torchrun restarts both workers, which
    # resume from step 4; in step 7 of attempt 1 the user's callback raises on rank 1 alone
    config = write_config(tmp_path / "job.yaml", *FIRST_JOB)
    first = torchrun(config, root, "--max-restarts", "1", recipe=job)
    output = first.stdout + first.stderr
    assert "exitcode: -9" in first.stderr, output[-3000:]  # the first attempt really lost rank 1
    assert "connectFullMesh failed" not in first.stderr  # the restart joined (rendezvous.py)
    assert (ckpts / "last").read_text().strip() == "step-00000006", output[-3000:]
    # as under Lightning a bug in user code keeps its traceback down to that frame instead of
    # the one-line form; rank 0, whose collective lost rank 1, and torchrun's report of the
    # failed workers do not repeat it
    assert _error_lines(output) == [], output[-3000:]
    assert output.count("raise ValueError(PLANTED)") == 1, output[-3000:]
    assert f"ValueError: {PLANTED}" in output
    # the record says "crashed" (torchrun stopping rank 0 did not make it a preemption), and
    # the recipe requeues only "preempted"
    crashed = json.loads(record.read_text())
    assert crashed["reason"] == "crashed" and "planted by the test" in crashed["message"]
    assert not (job / "scontrol.log").exists()

    # resubmitted with the bug fixed, preempted in step 7 (SIGTERM to rank 1 only): every rank
    # saves step 7 and exits with 75; the recipe reads "preempted" and requeues
    config = write_config(tmp_path / "resubmitted.yaml", *RESUBMITTED)
    env = {"NANOTRAIN_EXIT_FILE": str(record)}
    preempted = run_world(_command_on_rank, 2, fit_args(config, root), env, timeout=120)
    assert [code for code, _ in preempted] == [EXIT_PREEMPTED] * 2, preempted
    assert (ckpts / "last").read_text().strip() == "step-00000007"
    assert json.loads(record.read_text())["reason"] == "preempted"
    recipe = subprocess.run(slurm_recipe(job, ["true"]), cwd=REPO, env=recipe_environment(job),
                            capture_output=True, text=True, timeout=120)  # fmt: skip
    assert recipe.returncode == 0, recipe.stderr
    assert (job / "scontrol.log").read_text().split() == ["requeue", "4242"], recipe.stderr

    # the requeued job: the same command resumes at step 8 and ends cleanly on every rank
    resumed = run_world(_command_on_rank, 2, fit_args(config, root), env, timeout=120)
    assert [code for code, _ in resumed] == [0, 0], resumed
    assert (ckpts / "last").read_text().strip() == "step-00000008"
    assert json.loads(record.read_text())["reason"] == "finished"
    got = losses(root)
    assert sorted(got) == list(range(1, 9))
    assert all(got[step] == expected[step] for step in got), (got, expected)
