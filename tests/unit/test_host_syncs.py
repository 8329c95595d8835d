"""A non-logging training step never waits for the device (`nanotrain.runtime.sync_guard`)."""

from __future__ import annotations

from collections import Counter

import torch
import torchmetrics

import nanotrain as nt
import nanotrain.models.expert_compute as expert_compute
from nanotrain.runtime.sync_guard import HostSyncCounter
from tests.unit.test_callbacks_moe_load import RandomTokens

# Reads allowed in a non-logging step, each a known and documented one (docs/performance.md):
# `_host_values` reads counts that are *CPU* tensors (the host branch of the step's
# weighing); on a GPU the counts `count_tokens` returns are device tensors and take the
# branch that reads nothing (on this CPU-only test every tensor is a host tensor, so the
# counter sees the CPU branch). The step's token and
# sample totals stay on the device (`TrainState.add_consumed`), and the default NaNGuard
# decides on the device with the fused optimizer, so neither is allowed here.
ALLOWED = ("(_host_values)",)


class _Record(nt.Callback):
    """Counts host syncs during the steps whose batch_idx is in `steps`."""

    def __init__(self, steps: tuple[int, ...]) -> None:
        self.steps, self.counter, self.records = steps, None, []

    def on_train_step_start(self, trainer, module, batch, batch_idx):
        if batch_idx in self.steps:
            self.counter = HostSyncCounter().__enter__()

    def on_train_step_end(self, trainer, module, outputs, batch, batch_idx):
        if self.counter is not None:
            self.counter.__exit__(None, None, None)
            self.records += self.counter.records
            self.counter = None


def test_counter_sees_item_bool_tolist_and_nonzero():
    t = torch.arange(4)
    with HostSyncCounter() as c:
        t.sum().item()
        bool(t[1] > 0)
        t.tolist()
        t.nonzero()
        t + 1  # not a sync
        torch.bincount(t, minlength=4)  # CUDA reads the max
        torch.repeat_interleave(t, t)  # CUDA reads the sum of the repeats
        torch.repeat_interleave(t, t, output_size=6)  # not a sync: the size is given
        t.repeat_interleave(2)  # not a sync: integer repeats
    assert [name for name, _ in c.records] == [
        "aten._local_scalar_dense",
        "aten._local_scalar_dense",
        "Tensor.tolist",
        "aten.nonzero",
        "aten.bincount",
        "aten.repeat_interleave",
    ]
    assert torch.Tensor.tolist is not None and "patched" not in torch.Tensor.tolist.__name__


def test_non_logging_steps_of_the_tiny_moe_have_no_host_sync(tmp_path, monkeypatch):
    # Take the device-offset expert path (the one CUDA bf16 takes) on CPU, and the fused AdamW
    # that "auto" picks on CUDA (torch's loop AdamW reads its CPU step counter by design).
    monkeypatch.setattr(expert_compute, "grouped_mm_available", lambda x, w: True)
    monkeypatch.setattr(expert_compute, "reads_sizes_first", lambda x: False)
    module = nt.LanguageModelModule(model="tiny", vocab_size=257, optimizer_impl="fused")
    record = _Record(steps=(1, 2))  # steps 2 and 3 of 4: 1 and 4 log
    trainer = nt.Trainer(
        strategy=nt.SingleDeviceStrategy("cpu"),
        max_steps=4,
        global_batch_size=4,
        micro_batch_size=2,
        default_root_dir=str(tmp_path),
        loggers=["jsonl"],
        log_every_n_steps=100,
        callbacks=[record],
    )
    trainer.fit(module, train_dataloaders=RandomTokens(16))
    found = Counter(r for r in record.records if not r[1].endswith(ALLOWED))
    assert not found, f"host syncs in a non-logging step: {dict(found)}"


def test_logged_means_are_weighted_by_batch_size_without_reading_the_device():
    from nanotrain.trainer.metric_book import WeightedMean

    mean = WeightedMean()
    with HostSyncCounter() as c:
        mean.update(torch.tensor(1.0), 2.0)  # e.g. a batch of 2 with mean loss 1
        mean.update(torch.tensor(3.0), 6.0)  # a batch of 6 with mean loss 3
    assert c.records == []
    assert float(mean.compute()) == (1.0 * 2 + 3.0 * 6) / 8


def test_train_state_counts_on_the_device_and_reads_once_when_asked():
    from nanotrain.trainer.state import TrainState

    state = TrainState()
    steps = [(torch.tensor(8.0, dtype=torch.float64), torch.tensor(96.0, dtype=torch.float64))]
    steps.append((8, torch.tensor(100.0, dtype=torch.float64)))  # samples may come as an int
    with HostSyncCounter() as c:
        for samples, tokens in steps:
            state.add_consumed(samples, tokens)
    assert c.records == []
    with HostSyncCounter() as c:
        assert (state.consumed_samples, state.consumed_tokens) == (16, 196)
    assert len(c.records) == 1  # both totals in one read, then nothing pending
    saved = state.state_dict()
    assert saved["consumed_samples"] == 16 and saved["consumed_tokens"] == 196
    resumed = TrainState()
    resumed.load_state_dict(saved)
    resumed.add_consumed(8, 4)
    assert (resumed.consumed_samples, resumed.consumed_tokens) == (24, 200)


class _LogsEveryStep(nt.NanoModule):
    """A regressor that logs as tutorials do, every step: a tensor (also to the progress bar),
    a dict, and a torchmetrics Metric (for the epoch)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(8, 1)
        # the Metric's own NaN check reads the device; "disable" leaves only nanotrain's work
        self.mean_loss = torchmetrics.MeanMetric(nan_strategy="disable")

    def training_step(self, batch, batch_idx):
        x, y = batch
        pred = self.net(x).squeeze(-1)
        loss = torch.nn.functional.mse_loss(pred, y)
        self.log("train_loss", loss, prog_bar=True)
        self.log_dict({"pred_mean": pred.mean(), "target_mean": y.mean()})
        self.mean_loss(loss)
        self.log("mean_loss", self.mean_loss, on_step=False, on_epoch=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3, fused=True)


def test_logging_a_tensor_a_dict_and_a_metric_every_step_reads_nothing_between_log_steps(
    tmp_path,
):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 8, generator=g)
    data = torch.utils.data.TensorDataset(x, x.sum(-1))
    record = _Record(steps=(1, 2))  # steps 2 and 3 of 4: 1 and 4 log
    trainer = nt.Trainer(
        strategy=nt.SingleDeviceStrategy("cpu"),
        max_steps=4,
        global_batch_size=8,
        micro_batch_size=8,
        default_root_dir=str(tmp_path),
        log_every_n_steps=4,
        callbacks=[record],
    )
    trainer.fit(_LogsEveryStep(), train_dataloaders=data)
    found = Counter(r for r in record.records if not r[1].endswith(ALLOWED))
    assert not found, f"host syncs in a non-logging step: {dict(found)}"
    assert set(trainer.logged_metrics) >= {"train_loss", "pred_mean", "mean_loss"}
