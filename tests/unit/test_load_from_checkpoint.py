"""`Module.load_from_checkpoint(path)` on a nanotrain checkpoint, as Lightning users call it:
the module rebuilt with its recorded hyperparameters and its trained weights."""

from __future__ import annotations

import pytest
import torch

import nanotrain as nt
from nanotrain.testing import BlobsData, Classifier
from tests.precision_helpers import RandomTokens


def _fit(tmp_path, module, **data):
    trainer = nt.Trainer(
        max_steps=3, micro_batch_size=8, default_root_dir=str(tmp_path), loggers=[],
        enable_progress_bar=False, enable_monitors=False,
    )  # fmt: skip
    trainer.fit(module, **data)
    return trainer


def _same_weights(a, b) -> bool:
    return a.state_dict().keys() == b.state_dict().keys() and all(
        torch.equal(x, y)
        for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True)
    )


def test_hyperparameters_and_weights_come_back_from_every_form_of_path(tmp_path):
    module = Classifier(lr=0.07, hidden=12)
    trainer = _fit(tmp_path, module, datamodule=BlobsData())
    ckpt_dir = trainer.checkpoint_dir
    for path in (ckpt_dir / "step-00000003", ckpt_dir, ckpt_dir / "last", str(ckpt_dir)):
        loaded = Classifier.load_from_checkpoint(path)
        assert loaded.hparams.lr == 0.07 and loaded.hparams.hidden == 12
        assert loaded.training and _same_weights(loaded, module)  # as Lightning: not eval()
    # keyword arguments override the recorded hyperparameters, as in Lightning
    assert Classifier.load_from_checkpoint(ckpt_dir, lr=0.5).hparams.lr == 0.5


def test_a_language_model_takes_the_vocabulary_it_trained_with(tmp_path):
    module = nt.LanguageModelModule("tiny", lr=1e-2)
    trainer = _fit(tmp_path, module, train_dataloaders=RandomTokens(16, vocab=100))
    loaded = nt.LanguageModelModule.load_from_checkpoint(trainer.checkpoint_dir)
    assert loaded.config == module.config and _same_weights(loaded, module)


def test_weights_that_do_not_fit_and_missing_checkpoints_are_clear_errors(tmp_path):
    trainer = _fit(tmp_path, Classifier(hidden=12), datamodule=BlobsData())
    with pytest.raises(
        ValueError, match=r"do not fit Classifier.*net.0.weight \(12, 8\) vs \(10, 8\)"
    ):
        Classifier.load_from_checkpoint(trainer.checkpoint_dir, hidden=10)
    with pytest.raises(FileNotFoundError):
        Classifier.load_from_checkpoint(tmp_path / "nope")
