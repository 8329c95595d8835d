"""Decisions every rank takes at the same step (`nanotrain.checkpoint.step_flag`): a preemption
signal that reached one rank, and rank 0's clock for timed checkpoints. Read at once or (as on
CUDA, where an immediate read would make the host wait for the device) one step later, every
rank gets the same answer at the same step."""

from __future__ import annotations

import signal
from types import SimpleNamespace

import torch

from nanotrain.trainer.preemption import PreemptionWatch
from tests.distributed.spawn import run_world


def _answers(rank: int, world_size: int, defer: bool) -> list[int | None]:
    trainer = SimpleNamespace(
        world_size=world_size, strategy=SimpleNamespace(root_device=torch.device("cpu"))
    )
    watch = PreemptionWatch(["SIGTERM"], defer_reads=defer)
    answers = []
    for step in range(1, 6):
        if rank == 1 and step == 3:
            watch.received = signal.SIGTERM  # what the handler records, on rank 1 only
        answers.append(watch.agreed(trainer))
    return answers


def _last_step_signal(rank: int, world_size: int) -> list[int | None]:
    trainer = SimpleNamespace(
        world_size=world_size, strategy=SimpleNamespace(root_device=torch.device("cpu"))
    )
    watch = PreemptionWatch(["SIGTERM"], defer_reads=True)
    answers = [watch.agreed(trainer), watch.agreed(trainer)]
    if rank == 0:
        watch.received = signal.SIGTERM  # during the last step
    answers.append(watch.agreed(trainer))  # after the last step: read a step late...
    answers.append(watch.agreed(trainer, final=True))  # ...so the Trainer's final check reads it
    return answers


def test_a_signal_in_the_last_step_is_read_by_the_final_check():
    for answers in run_world(_last_step_signal, 2):
        assert answers == [None, None, None, int(signal.SIGTERM)]


def test_ranks_agree_on_a_signal_at_once_or_one_step_later():
    term = int(signal.SIGTERM)
    at_once = [None, None, term, term, term]
    for answers in run_world(_answers, 2, False):
        assert answers == at_once
    for answers in run_world(_answers, 2, True):
        assert answers == [None, *at_once[:-1]]


def _timed_saves(rank: int, world_size: int, root: str) -> list[str]:
    import nanotrain as nt
    from nanotrain.checkpoint.step_flag import StepFlag
    from nanotrain.testing import Classifier
    from tests.unit.test_checkpoint import data, make_trainer
    from tests.unit.test_checkpoint_callback import timed_checkpoint

    clock, ckpt = timed_checkpoint()  # step s ends at 40·s seconds, save every 90 s
    ckpt._time_due = StepFlag(defer_reads=True)  # as on GPUs
    trainer = make_trainer(root, 8, [clock, ckpt], strategy=nt.DDPStrategy())
    trainer.fit(Classifier(), data())
    return sorted(p.name for p in trainer.checkpoint_dir.iterdir() if p.is_dir())


def test_timed_checkpoints_read_a_step_late_save_once_each(tmp_path):
    # rank 0's clock first says "save" at step 3 (120 s), read after step 4, which saves (160 s);
    # the flag rank 0 posted at step 4, before that save, is moot; the clock next says "save"
    # at step 7 (280 s), read after step 8
    for saved in run_world(_timed_saves, 2, str(tmp_path)):
        assert saved == ["step-00000004", "step-00000008"]
