"""The Trainer calls a hook only on the callbacks that define it beyond their base's no-op,
over the live callback list, as Lightning does: a callback appended by a hook runs at once."""

from __future__ import annotations

import lightning.pytorch as pl

import nanotrain as nt
from nanotrain import testing as toy
from nanotrain.testing import BlobsData, Classifier


class StepEnds(nt.Callback):
    """Counts `on_train_step_end` calls."""

    def __init__(self) -> None:
        self.calls = 0

    def on_train_step_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        self.calls += 1


class AddsAtStep(nt.Callback):
    """Appends `extra` to the Trainer's callbacks at the end of step `step`."""

    def __init__(self, step: int, extra: nt.Callback) -> None:
        self.step, self.extra = step, extra

    def on_train_step_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            trainer.callbacks.append(self.extra)


class LightningBatchEnds(pl.Callback):
    """A callback written against Lightning: counts `on_train_batch_end`."""

    def __init__(self) -> None:
        self.calls = 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.calls += 1


def test_hooks_reach_overriding_callbacks_and_callbacks_added_mid_run(tmp_path):
    plain, late, lightning_style = StepEnds(), StepEnds(), LightningBatchEnds()
    on_instance: list[int] = []
    assigned = nt.Callback()  # the base class, its hook set on the instance
    assigned.on_train_step_end = lambda trainer, *args: on_instance.append(trainer.global_step)
    callbacks = [plain, AddsAtStep(2, late), lightning_style, assigned]
    trainer = toy.make_trainer(tmp_path, max_steps=5, callbacks=callbacks)
    trainer.fit(Classifier(), BlobsData())
    assert plain.calls == 5
    assert late.calls == 4  # added while step 2 ended, after its adder: steps 2 to 5
    assert lightning_style.calls == 5  # one microbatch per step
    assert on_instance == [1, 2, 3, 4, 5]


def test_the_kept_answer_follows_every_change_of_the_list():
    from nanotrain.trainer.hook_dispatch import CallbackHooks

    first, second, third = StepEnds(), StepEnds(), StepEnds()
    callbacks = [first, nt.Callback(), second]
    hooks = CallbackHooks()
    args = (None, None, None, None, 0)
    hooks.call(callbacks, "on_train_step_end", *args)
    callbacks.remove(second)  # removed: no longer reached
    hooks.call(callbacks, "on_train_step_end", *args)
    callbacks[1] = third  # replaced in place, same length: reached
    hooks.call(callbacks, "on_train_step_end", *args)
    hooks.call(callbacks, "on_train_epoch_end", None, None)  # a hook none of them defines
    assert (first.calls, second.calls, third.calls) == (3, 1, 1)


def test_a_hook_assigned_on_a_callback_mid_run_is_called_from_then_on():
    from nanotrain.trainer.hook_dispatch import CallbackHooks

    late, before = nt.Callback(), StepEnds()
    callbacks, calls = [before, late], []
    hooks = CallbackHooks()
    args = (None, None, None, None, 0)
    hooks.call(callbacks, "on_train_step_end", *args)
    late.on_train_step_end = lambda *a: calls.append(before.calls)  # in its place: after `before`
    hooks.call(callbacks, "on_train_step_end", *args)
    hooks.call(callbacks, "on_train_step_end", *args)
    assert calls == [2, 3]
