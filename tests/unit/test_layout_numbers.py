"""The single-process pieces of layout-independent numbers (issue 14): validation sample
selection, loss-term weighing and its errors, the progress bar's names, named LR groups."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils.data import TensorDataset

import nanotrain as nt
from nanotrain.callbacks import LearningRateMonitor
from nanotrain.callbacks.lr_monitor import param_group_names
from nanotrain.callbacks.progress import shown_metrics
from nanotrain.data.sampler import ValidationBatchSampler, validation_sample_count
from nanotrain.strategies.base import DataShard
from nanotrain.strategies.weighting import LossAccumulator, weigh_microbatches
from nanotrain.testing import Classifier, blobs, make_trainer


# -- validation samples ----------------------------------------------------------------------
def test_validation_count_is_in_global_batches_or_a_fraction_of_the_set():
    assert validation_sample_count(None, 13, 8) == 13
    assert validation_sample_count(1, 13, 8) == 8  # one global batch
    assert validation_sample_count(5, 13, 8) == 13  # at most the set
    assert validation_sample_count(0.5, 13, 8) == 6
    assert validation_sample_count(1.0, 13, 8) == 13
    assert validation_sample_count(0.01, 13, 8) == 1  # at least one sample
    assert validation_sample_count(0, 13, 8) == 0


def test_validation_shards_read_every_sample_once_with_equal_batch_counts():
    for shards in (1, 2, 3, 4):
        samplers = [ValidationBatchSampler(13, 2, r, shards) for r in range(shards)]
        real = [
            i for s in samplers for b in list(s)[: s.num_real_batches] for i in b
        ]  # padding batches left out
        assert sorted(real) == list(range(13)), shards
        assert len({len(list(s)) for s in samplers}) == 1, shards  # same number of forwards
    # 13 over 4 shards, 2 per batch: shard 0 reads 0,4,8,12 (2 batches); shard 3 reads 3,7,11
    # (2 batches); with 3 shards shard 0 has 5 samples (3 batches), shard 2 has 4 (2 + padding)
    s = ValidationBatchSampler(13, 2, 2, 3)
    assert list(s) == [[2, 5], [8, 11], [0, 0]] and s.num_real_batches == 2
    with pytest.raises(ValueError, match="shard_index"):
        ValidationBatchSampler(13, 2, 3, 3)


def test_validation_reads_the_remainder_batch(tmp_path):
    x, y = blobs(16)
    seen: list[int] = []

    class Count(nt.Callback):
        def on_validation_batch_end(self, trainer, module, outputs, batch, batch_idx):
            seen.append(len(batch[0]))

    trainer = make_trainer(tmp_path, micro_batch_size=4, callbacks=[Count()])
    # 10 validation samples in batches of 4: 4, 4, 2 on one process, nothing dropped
    (metrics,) = trainer.validate(Classifier(), dataloaders=TensorDataset(x[:10], y[:10]))
    assert seen == [4, 4, 2]
    with torch.no_grad():
        expected = torch.nn.functional.cross_entropy(trainer.module.net(x[:10]), y[:10])
    assert metrics["val/loss"] == pytest.approx(expected.item(), rel=1e-6)


class SecondOfTwoShards(nt.SingleDeviceStrategy):
    """One process reading data-parallel shard 1 of 2 (reductions stay local)."""

    def data_shard(self) -> DataShard:
        return DataShard(1, 2)


class CountingClassifier(Classifier):
    def __init__(self) -> None:
        super().__init__()
        self.forwards = 0

    def validation_step(self, batch, batch_idx):
        self.forwards += 1
        return super().validation_step(batch, batch_idx)


def test_padding_batches_run_the_forward_but_record_nothing(tmp_path):
    x, y = blobs(16)
    seen: list[int] = []

    class Count(nt.Callback):
        def on_validation_batch_end(self, trainer, module, outputs, batch, batch_idx):
            seen.append(len(batch[0]))

    trainer = make_trainer(
        tmp_path, strategy=SecondOfTwoShards("cpu"), micro_batch_size=2, callbacks=[Count()]
    )
    module = CountingClassifier()
    # 5 samples over 2 shards: shard 0 reads 0, 2, 4 (2 batches), shard 1 reads 1, 3 (1 batch)
    # and then one padding batch (copies of sample 0) so both run 2 forwards
    (metrics,) = trainer.validate(module, dataloaders=TensorDataset(x[:5], y[:5]))
    assert module.forwards == 2 and seen == [2]
    with torch.no_grad():
        expected = torch.nn.functional.cross_entropy(module.net(x[[1, 3]]), y[[1, 3]])
    assert metrics["val/loss"] == pytest.approx(expected.item(), rel=1e-6)


# -- loss terms ------------------------------------------------------------------------------
def test_loss_terms_check_their_sizes_and_name_means():
    with pytest.raises(ValueError, match="K weights and names"):
        nt.LossTerms(torch.zeros(3), [1.0, 1.0], ["a", "b", "c"])
    terms = nt.LossTerms(torch.zeros(3), [1.0, 0.5, 0.5], ["lm", "mtp", "mtp"])
    named = terms.named_means(torch.tensor([2.0, 1.0, 3.0]))
    assert {k: float(v) for k, v in named.items()} == {"lm": 2.0, "mtp": 2.0}


class _TwoTerms(nt.NanoModule):
    """Term 0 averages over the labels, term 1 over the samples."""

    def loss_counts(self, batch):
        return torch.stack([(batch != 0).sum(), torch.full((), len(batch), device=batch.device)])


def test_each_term_is_weighed_by_its_own_global_count():
    module = _TwoTerms()
    strategy = nt.SingleDeviceStrategy("cpu")
    a = torch.tensor([[1, 0], [1, 1]])  # 3 labels, 2 samples
    b = torch.tensor([[1, 0], [0, 0], [0, 0]])  # 1 label, 3 samples
    weighed = weigh_microbatches(strategy, module, [a, b])
    # hand-computed: term 0 shares 3/4 and 1/4; term 1 shares 2/5 and 3/5
    torch.testing.assert_close(
        weighed.scales, torch.tensor([[0.75, 0.4], [0.25, 0.6]], dtype=torch.float64)
    )
    acc = LossAccumulator(weighed)
    v = torch.tensor([2.0, 10.0], requires_grad=True)
    out = acc.objective(0, {"loss": v.sum(), "loss_terms": nt.LossTerms(v, [1.0, 0.1], "xy")})
    out.backward()
    torch.testing.assert_close(v.grad, torch.tensor([0.75, 0.04]))
    with pytest.raises(TypeError, match="loss_terms"):
        acc.objective(1, torch.tensor(1.0))


class _TokenCount(nt.NanoModule):
    """One-loss mode, weighed by the nonzero entries of each microbatch as its tokens."""

    def count_tokens(self, batch):
        return int((batch != 0).sum())


def _step_loss(batches, losses):
    """(step loss, backpropagated objectives) of one replica's microbatches, weighed on the host."""
    strategy = nt.SingleDeviceStrategy("cpu")
    acc = LossAccumulator(weigh_microbatches(strategy, _TokenCount(), batches))
    objectives = [acc.objective(m, loss) for m, loss in enumerate(losses)]
    return acc.finish(strategy)[0], objectives


def test_one_microbatch_at_scale_one_reports_its_own_loss_bit_for_bit():
    loss = torch.tensor(1.0 / 3.0, requires_grad=True)
    step_loss, (objective,) = _step_loss([torch.tensor([[1, 2]])], [loss])
    assert objective is loss  # backpropagated unscaled
    assert step_loss.dtype == torch.float32 and step_loss.dim() == 0
    assert step_loss.item() == loss.item()  # x * 1, summed in float64, back to float32
    bf16 = torch.tensor(1.0 / 3.0, dtype=torch.bfloat16)
    assert _step_loss([torch.tensor([[1]])], [bf16])[0] == bf16.double().float()


def test_a_unit_scale_microbatch_then_others_sums_every_weighed_loss():
    # all 3 tokens in the first microbatch: scales 1 and 0; then 1/4, 3/4 and 0
    a, b = torch.tensor(2.0), torch.tensor(5.0)
    step_loss, objectives = _step_loss([torch.tensor([[1, 1, 1]]), torch.tensor([[0]])], [a, b])
    assert step_loss.item() == 2.0 and objectives[1].item() == 0.0
    batches = [torch.tensor([[1, 0]]), torch.tensor([[1, 1, 1]]), torch.tensor([[0, 0]])]
    c = torch.tensor(7.0)
    step_loss, _ = _step_loss(batches, [a, b, c])
    assert step_loss.item() == pytest.approx(2.0 / 4 + 5.0 * 3 / 4)


def test_host_weights_are_reused_while_the_counts_repeat():
    strategy, module = nt.SingleDeviceStrategy("cpu"), _TokenCount()
    first = weigh_microbatches(strategy, module, [torch.tensor([[1, 2]])])
    assert weigh_microbatches(strategy, module, [torch.tensor([[3, 4]])]) is first
    other = weigh_microbatches(strategy, module, [torch.tensor([[3, 0]])])
    assert other is not first and other.tokens.item() == 1.0 and first.tokens.item() == 2.0


# -- what the user reads ---------------------------------------------------------------------
def test_progress_bar_leads_with_the_lm_loss_and_names_the_total(tmp_path):
    trainer = make_trainer(tmp_path)
    trainer.callback_metrics.update(
        {
            "train/lm_loss": torch.tensor(2.0),
            "train/bpb": torch.tensor(1.5),
            "train/loss": torch.tensor(2.25),  # the Trainer's objective (not a progress-bar key)
        }
    )
    trainer.progress_bar_metrics.update({"val/loss": torch.tensor(3)})
    assert shown_metrics(trainer) == {
        "lm_loss": 2.0,
        "bpb": 1.5,
        "total_loss": 2.25,
        "val/loss": 3.0,
    }


def test_language_model_names_its_optimizer_groups():
    module = nt.LanguageModelModule("tiny-dense", vocab_size=64)
    module.configure_model()
    optimizer = module.configure_optimizers()["optimizer"]
    assert sorted(LearningRateMonitor().read(optimizer)) == ["lr/decay", "lr/no_decay"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_weighing_a_step_never_waits_for_the_gpu():
    module = _TwoTerms()
    strategy = nt.SingleDeviceStrategy("cuda")
    batches = [torch.tensor([[1, 0], [1, 1]], device="cuda"), torch.tensor([[1, 0]], device="cuda")]
    v = torch.tensor([2.0, 10.0], device="cuda", requires_grad=True)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        weighed = weigh_microbatches(strategy, module, batches)
        acc = LossAccumulator(weighed)
        for m in range(2):
            terms = nt.LossTerms(v * (m + 1), [1.0, 0.1], ["x", "y"])
            acc.objective(m, {"loss": terms.values.sum(), "loss_terms": terms}).backward()
        loss, named = acc.finish(strategy)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    # term x: (2·3 + 4·1) / 4 = 2.5; term y: (10·2 + 20·1) / 3; loss = x + 0.1·y
    assert float(named["x"]) == pytest.approx(2.5)
    assert float(loss) == pytest.approx(2.5 + 0.1 * 40 / 3)


def test_train_bpb_is_the_global_lm_loss_in_bits_per_byte(tmp_path, monkeypatch):
    from nanotrain.data import TokenDataModule

    monkeypatch.setenv("NANOTRAIN_CACHE", str(tmp_path / "cache"))
    data = TokenDataModule(seq_len=32, micro_batch_size=4, demo_max_bytes=30_000)
    trainer = make_trainer(tmp_path, max_steps=1, micro_batch_size=4, limit_val_batches=0)
    trainer.fit(nt.LanguageModelModule("tiny-dense", warmup_steps=1), datamodule=data)
    m = trainer.callback_metrics
    expected = float(m["train/lm_loss"]) / math.log(2) / data.bytes_per_token
    assert float(m["train/bpb"]) == pytest.approx(expected, rel=1e-6)


def test_unnamed_groups_are_named_by_what_sets_them_apart():
    a, b, c = (torch.nn.Parameter(torch.zeros(1)) for _ in range(3))
    decay = torch.optim.AdamW(
        [{"params": [a], "weight_decay": 0.1}, {"params": [b], "weight_decay": 0.0}]
    )
    assert param_group_names(decay) == ["weight_decay=0.1", "weight_decay=0.0"]
    mixed = torch.optim.SGD(
        [{"params": [a], "name": "head"}, {"params": [b]}, {"params": [c]}], lr=0.1
    )
    assert param_group_names(mixed) == ["head", "group1", "group2"]  # nothing sets 1, 2 apart
    assert param_group_names(torch.optim.SGD([a], lr=0.1)) == ["group0"]
