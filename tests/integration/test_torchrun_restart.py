"""Automatic restart under `torchrun --max-restarts` on CPU/gloo, and preemption of one rank.

The real `nanotrain fit` command under torchrun (`--max-restarts 1`) with 2 DDP workers on the
toy classifier (tests/unit/test_checkpoint.py's DropoutAdamClassifier: dropout, Adam, a step
LR schedule, shuffled data), checkpointing every 2 steps, always with `--ckpt_path last`,
inside docs/checkpointing.md's SLURM recipe:

* SIGKILL of rank 1 during step 5 of the first attempt: torchrun restarts both workers and
  they resume from step 4;
* SIGTERM to rank 1 only, during step 7 of that second attempt: both ranks finish step 7,
  save it and exit with 75, and the recipe requeues the job;
* the requeued command resumes at step 8, and every step's loss equals the uninterrupted
  run's. It runs the command's entry point on a forked 2-rank world with torchrun's variables
  (a second torchrun job would only add three fresh interpreters; the first job covers the
  launcher).
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


def write_config(config: Path) -> Path:
    """The job: SIGKILL of rank 1 in step 5 of the first attempt, SIGTERM to rank 1 in step 7
    of the second."""
    signal_at = "tests.integration.test_torchrun_restart.SignalRankAt"
    config.write_text(
        f"""
trainer: {{max_steps: 8, micro_batch_size: 4, global_batch_size: 16, seed: 3,
          loggers: [jsonl], log_every_n_steps: 1, limit_val_batches: 0}}
model: {{class_path: tests.unit.test_checkpoint.DropoutAdamClassifier}}
data: {{class_path: nanotrain.testing.BlobsData, init_args: {{num_train: 64, num_val: 16, batch_size: 4}}}}
callbacks:
  - {{class_path: nanotrain.callbacks.checkpoint.ModelCheckpoint, init_args: {{every_n_steps: 2}}}}
  - {{class_path: {signal_at}, init_args: {{step: 5, rank: 1, signum: {int(signal.SIGKILL)}, attempt: 0}}}}
  - {{class_path: {signal_at}, init_args: {{step: 7, rank: 1, signum: {int(signal.SIGTERM)}, attempt: 1}}}}
"""
    )
    return config


def fit_args(config: Path, root: Path) -> list[str]:
    """The job's `nanotrain` arguments."""
    return ["fit", "--config", str(config), "--strategy", "ddp",
            "--trainer.default_root_dir", str(root), "--ckpt_path", "last"]  # fmt: skip


def torchrun(
    config: Path, root: Path, *extra: str, recipe: Path | None = None, **env: str
) -> subprocess.CompletedProcess:
    """The job under torchrun; with `recipe` (a folder), inside docs/checkpointing.md's SLURM
    script (job id 4242, submitted from `recipe`, with a stand-in scontrol)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    command += [*extra, "--standalone", "-m", "nanotrain", *fit_args(config, root)]
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), **env}
    if recipe is not None:
        command = slurm_recipe(recipe, command)
        environment.update(SLURM_JOB_ID="4242", SLURM_SUBMIT_DIR=str(recipe),
                           PATH=f"{recipe / 'bin'}:{os.environ['PATH']}")  # fmt: skip
    return subprocess.run(
        command, cwd=REPO, env=environment, capture_output=True, text=True, timeout=300
    )


EXIT_ABORT = "terminate called without an active exception"


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


def test_torchrun_restarts_after_sigkill_then_sigterm_preempts_and_the_job_resumes_exactly(
    tmp_path,
):
    # One uninterrupted reference, in-process (a torchrun job of its own would only repeat
    # the start-up)
    run_world(_straight, 2, str(tmp_path / "straight"), timeout=120)
    expected = losses(tmp_path / "straight")
    config = write_config(tmp_path / "job.yaml")
    root = tmp_path / "runs"
    job = tmp_path / "job"
    job.mkdir()

    # attempt 0 loses rank 1 to SIGKILL in step 5; torchrun restarts both workers, which
    # resume from step 4; attempt 1 is preempted (SIGTERM to rank 1 only) in step 7: every
    # rank saves step 7 and exits with 75, and the recipe reads "preempted" and requeues
    first = torchrun(config, root, "--max-restarts", "1", recipe=job)
    assert "exitcode: -9" in first.stderr  # the first attempt really lost rank 1
    assert "connectFullMesh failed" not in first.stderr  # the restart joined (rendezvous.py)
    assert f"exitcode: {EXIT_PREEMPTED}" in first.stderr or EXIT_ABORT in first.stderr
    ckpts = root / "default" / "version_0" / "checkpoints"
    assert (ckpts / "last").read_text().strip() == "step-00000007", first.stderr[-3000:]
    assert json.loads((job / "exit-4242.json").read_text())["reason"] == "preempted"
    assert (job / "scontrol.log").read_text().split() == ["requeue", "4242"], first.stderr[-3000:]

    # the requeued job: the same command resumes at step 8 and ends cleanly on every rank
    resumed = run_world(_command_on_rank, 2, fit_args(config, root), {}, timeout=120)
    assert [code for code, _ in resumed] == [0, 0], resumed
    assert (ckpts / "last").read_text().strip() == "step-00000008"
    got = losses(root)
    assert sorted(got) == list(range(1, 9))
    assert all(got[step] == expected[step] for step in got), (got, expected)
