"""Lightning habits of issue 53 (round two, continued) run side by side under
`lightning.Trainer` and `nanotrain.Trainer` with the same seed and data: a stage with
`ckpt_path="last"` and no checkpoint, a module copied or pickled in the middle of a stage
whose steps have no `batch_idx`."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
import torch.nn.functional as F

from tests.unit.test_lightning_round2_a import Data, Evaluated, NoBatchIdx, _both

NO_LAST = r'\.{stage}\(ckpt_path="last"\) is set, but there is no last checkpoint available'


def test_a_stage_with_ckpt_path_last_and_no_checkpoint_warns_and_uses_the_weights(tmp_path):
    results = {}

    def run(trainer, module):
        found = {}
        for stage in ("validate", "test", "predict"):
            with pytest.warns(UserWarning, match=NO_LAST.format(stage=stage)):
                kwargs = {} if stage == "predict" else {"verbose": False}
                found[stage] = getattr(trainer, stage)(module, Data(), ckpt_path="last", **kwargs)
        with pytest.warns(UserWarning, match=NO_LAST.format(stage="fit")):
            trainer.fit(module, Data(), ckpt_path="last")
        results[type(trainer).__module__.split(".")[0]] = found

    _both(Evaluated(), tmp_path, run=run)  # each stage on the module's own weights
    for stage in ("validate", "test"):
        assert results["nanotrain"][stage] == pytest.approx(results["lightning"][stage], abs=1e-6)
    assert torch.allclose(
        torch.cat(results["nanotrain"]["predict"]), torch.cat(results["lightning"]["predict"]),
        atol=1e-6,
    )  # fmt: skip


class CopiesItself(NoBatchIdx):
    """Steps without `batch_idx`; at each batch's end a deep copy with zeroed weights and a
    pickled round trip of the module run `training_step` on the batch (as an averaging or
    EMA callback would copy the module mid-stage)."""

    def __init__(self) -> None:
        super().__init__()
        self.copied: list[tuple[float, float, float]] = []

    def on_train_batch_end(self, outputs, batch, batch_idx):
        clone = copy.deepcopy(self)
        with torch.no_grad():
            for p in clone.parameters():
                p.zero_()
        unpickled = pickle.loads(pickle.dumps(self))
        self.copied.append(
            (
                float(clone.training_step(batch)),
                float(unpickled.training_step(batch)),
                float(self.training_step(batch)),
            )
        )


def test_a_module_copied_or_pickled_mid_stage_runs_its_own_steps_as_under_lightning(tmp_path):
    reference, ours = _both(CopiesItself(), tmp_path)
    assert len(ours.copied) == len(reference.copied) == 4
    assert ours.copied == pytest.approx(reference.copied, abs=1e-6)
    _, y = Data().train_dataloader().dataset.tensors
    assert ours.copied[0][0] == pytest.approx(float(F.mse_loss(torch.zeros_like(y[:8]), y[:8])))
    assert "training_step" not in vars(ours)
