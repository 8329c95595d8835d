"""Toy modules and data for tests of code that runs under the nanotrain Trainer (callbacks,
modules, strategies), as Lightning's `BoringModel`:

    from nanotrain.testing import BlobsData, Classifier, HookRecorder, make_trainer

    def test_my_callback(tmp_path):
        recorder = HookRecorder()
        trainer = make_trainer(tmp_path, callbacks=[MyCallback(), recorder])
        trainer.fit(Classifier(), BlobsData())
        assert "on_fit_end" in recorder.calls
"""

from nanotrain.testing.toy import BlobsData, Classifier, HookRecorder, blobs, make_trainer

__all__ = ["BlobsData", "Classifier", "HookRecorder", "blobs", "make_trainer"]
