"""Ranks agree on a preemption signal that reached only one of them, at once or (as on CUDA,
where an immediate read would make the host wait for the device) one step later, and every
rank gets the same answer at the same step."""

from __future__ import annotations

import signal
from types import SimpleNamespace

import torch

from nanotrain.checkpoint.preemption import PreemptionWatch
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
