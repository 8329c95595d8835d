"""Every Lightning Trainer argument and hook nanotrain refuses is refused with its own error,
naming it and what to do instead, before any step runs."""

from __future__ import annotations

import pytest

import nanotrain as nt
from nanotrain.testing import BlobsData, Classifier
from nanotrain.trainer.hook_checks import UNSUPPORTED_CALLBACK_HOOKS, UNSUPPORTED_MODULE_HOOKS
from nanotrain.trainer.lightning_args import REFUSED_ARGUMENTS


@pytest.mark.parametrize("name", sorted(REFUSED_ARGUMENTS))
def test_each_refused_argument_names_itself_and_what_to_do(name):
    with pytest.raises(TypeError) as info:
        nt.Trainer(max_steps=1, **{name: 1})
    message = str(info.value)
    assert f"'{name}', which nanotrain does not take" in message
    assert REFUSED_ARGUMENTS[name] in message


class _Stepless(Exception):
    pass


def _fit_with(tmp_path, module, callbacks=()):
    class Stop(nt.Callback):
        def on_train_step_start(self, *args):
            raise _Stepless  # a refusal must come before the first step

    trainer = nt.Trainer(
        max_steps=1, default_root_dir=str(tmp_path), loggers=[], enable_progress_bar=False,
        enable_checkpointing=False, callbacks=[*callbacks, Stop()],
    )  # fmt: skip
    trainer.fit(module, BlobsData())


@pytest.mark.parametrize("hook", sorted(UNSUPPORTED_MODULE_HOOKS))
def test_each_refused_module_hook_fails_at_fit_start(tmp_path, hook):
    module_class = type("Hooked", (Classifier,), {hook: lambda self, *a, **k: None})
    with pytest.raises(ValueError, match=rf"Hooked\.{hook} is a Lightning hook") as info:
        _fit_with(tmp_path, module_class())
    assert UNSUPPORTED_MODULE_HOOKS[hook] in str(info.value)


@pytest.mark.parametrize("hook", sorted(UNSUPPORTED_CALLBACK_HOOKS))
def test_each_refused_callback_hook_fails_at_fit_start(tmp_path, hook):
    callback = type("Hooked", (nt.Callback,), {hook: lambda self, *a, **k: None})()
    with pytest.raises(ValueError, match=rf"Hooked\.{hook} is a Lightning callback hook"):
        _fit_with(tmp_path, Classifier(), [callback])
