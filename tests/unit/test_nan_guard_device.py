"""NaNGuard deciding on the device (fused optimizer): the same weights as the host check,
no host read in a non-logging step, and a stop that takes effect at the next logging step."""

from __future__ import annotations

import functools
import json

import pytest
import torch

import nanotrain as nt
from nanotrain import testing as toy
from nanotrain.callbacks.nan_guard import NaNGuard
from nanotrain.runtime.sync_guard import HostSyncCounter
from nanotrain.strategies.base import skip_on_device
from nanotrain.testing import BlobsData
from tests.unit.test_callbacks_control import NaNLossAt, ParamSnapshots, fake_save
from tests.unit.test_host_syncs import ALLOWED

make_trainer = functools.partial(toy.make_trainer, max_steps=6)


class FusedNaNLossAt(NaNLossAt):
    """`NaNLossAt` trained by a fused AdamW (which can skip an update on the device)."""

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.05, fused=True)


class LoopNaNLossAt(FusedNaNLossAt):
    """The same AdamW without `fused`: the guard must check on the host."""

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.05, foreach=False)


class StepSyncs(nt.Callback):
    """Host reads recorded from the start of each step to its end (the hooks included)."""

    def __init__(self) -> None:
        self.by_step: dict[int, list] = {}
        self._counter = None

    def on_train_step_start(self, trainer, module, batch, batch_idx):
        self._counter = HostSyncCounter().__enter__()

    def on_train_step_end(self, trainer, module, outputs, batch, batch_idx):
        self._counter.__exit__(None, None, None)
        # a CPU count turned into a tensor is a host read only on CPU (tests/unit/test_host_syncs)
        records = [r for r in self._counter.records if not r[1].endswith(ALLOWED)]
        self.by_step[trainer.global_step] = records


def _fit(tmp_path, module, guard, **settings):
    snaps = ParamSnapshots()
    torch.manual_seed(0)
    trainer = make_trainer(tmp_path, callbacks=[guard, snaps], **settings)
    trainer.fit(module, BlobsData())
    return trainer, snaps


def test_device_check_skips_the_same_updates_as_the_host_check(tmp_path):
    torch.manual_seed(1)
    device_run, device_snaps = _fit(tmp_path / "d", FusedNaNLossAt({3, 5}), NaNGuard())
    torch.manual_seed(1)
    host_guard = NaNGuard(on_device=False)
    host_run, host_snaps = _fit(tmp_path / "h", FusedNaNLossAt({3, 5}), host_guard)
    assert device_run.strategy.can_skip_on_device
    for a, b in zip(device_snaps.final, host_snaps.final, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    for a, b in zip(device_snaps.before[3], device_snaps.before[4], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)  # step 3's update was dropped
    assert device_run.state.skipped_steps == host_run.state.skipped_steps == 2
    assert all(torch.isfinite(p).all() for p in device_snaps.final)
    # AdamW's own step count skipped the bad steps too (4 real updates of 6)
    state = next(iter(device_run.strategy.optimizer.state.values()))
    assert int(state["step"]) == 4


def test_device_check_reads_nothing_outside_logging_steps(tmp_path):
    syncs = StepSyncs()
    trainer = make_trainer(
        tmp_path, log_every_n_steps=3, callbacks=[NaNGuard(), syncs], max_steps=6
    )
    trainer.fit(FusedNaNLossAt({2}), BlobsData())
    quiet = {step: recs for step, recs in syncs.by_step.items() if step % 3}
    assert sorted(quiet) == [1, 2, 4, 5]
    assert all(recs == [] for recs in quiet.values()), quiet
    # the bad step 2 is found when step 3 logs, and logged at its own step's record (1:
    # Lightning's 0-based step, where step 2's train/loss is)
    lines = [json.loads(x) for x in (trainer.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines if "nan_guard/skipped_steps" in x] == [1]
    assert trainer.state.skipped_steps == 1


def test_device_stop_happens_at_the_next_logging_step_with_good_weights(tmp_path):
    guard, saved = NaNGuard(action="stop"), []
    snaps = ParamSnapshots()
    trainer = make_trainer(tmp_path, max_steps=10, log_every_n_steps=4, callbacks=[guard, snaps])
    trainer.save_checkpoint = fake_save(trainer, saved)
    trainer.fit(FusedNaNLossAt({2}), BlobsData())
    assert trainer.global_step == 4  # found when step 4 logged
    assert [(p.name, step) for p, step in saved] == [("nan-step-4", 4)]
    assert "non-finite values in 1 step(s) up to step 4, the last at step 2" in guard.stop_reason
    assert trainer.exit_code == nt.EXIT_NONFINITE
    assert all(torch.isfinite(p).all() for p in snaps.final)


def test_device_check_falls_back_to_the_host_without_a_fused_optimizer(tmp_path):
    syncs = StepSyncs()
    trainer = make_trainer(tmp_path, log_every_n_steps=10, callbacks=[NaNGuard(), syncs])
    trainer.fit(LoopNaNLossAt({3}), BlobsData())
    assert not trainer.strategy.can_skip_on_device
    assert trainer.state.skipped_steps == 1
    assert any("on_before_optimizer_step" in where for _, where in syncs.by_step[1])
    with pytest.raises(ValueError, match="fused"):
        make_trainer(tmp_path / "x", callbacks=[NaNGuard(on_device=True)]).fit(
            LoopNaNLossAt(set()), BlobsData()
        )


def test_skip_on_device_refuses_an_optimizer_that_cannot():
    p = torch.nn.Parameter(torch.ones(2))
    with pytest.raises(ValueError, match="cannot skip an update on the device"):
        with skip_on_device(torch.optim.SGD([p], lr=0.1), torch.tensor(True)):
            pass
