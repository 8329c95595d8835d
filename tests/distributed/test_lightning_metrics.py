"""torchmetrics objects and sync_dist values logged by a plain LightningModule are reduced over
the data-parallel ranks; Lightning loggers write on global rank 0 only."""

from __future__ import annotations

import pytest
import torch
import torchmetrics
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader, TensorDataset

import nanotrain as nt
from nanotrain.testing import blobs
from tests.distributed.spawn import run_world
from tests.unit.test_lightning_compat import TutorialClassifier, TutorialData, column, read_csv

pytestmark = pytest.mark.distributed


class Gathering(TutorialClassifier):
    """Also gathers each rank's rank number with `self.all_gather` at validation's end."""

    def on_validation_epoch_end(self):
        rank = torch.tensor([float(self.trainer.global_rank)], requires_grad=True)
        self.gathered = self.all_gather({"rank": rank})["rank"].tolist()
        with_grads = self.all_gather(rank * 2.0, sync_grads=True)
        with_grads.sum().backward()
        self.rank_grad = rank.grad.tolist()


def _fit(make_strategy, root: str, rank: int) -> dict:
    torch.manual_seed(0)
    module = Gathering()
    trainer = nt.Trainer(
        strategy=make_strategy(),
        max_steps=6,
        micro_batch_size=8,
        global_batch_size=16,
        shuffle=False,
        log_every_n_steps=1,
        val_check_interval=6,
        default_root_dir=root,
        loggers=["jsonl"],
        logger=[True, CSVLogger(f"{root}/user_rank{rank}", name="", version="")],
        enable_checkpointing=False,
        enable_progress_bar=False,
    )
    trainer.fit(module, TutorialData())
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    return {
        "metrics": metrics,
        "gathered": module.gathered,
        "rank_grad": module.rank_grad,
        "loggers": len(trainer.loggers),
        "test": trainer.test(module, TutorialData()),
        "predict": [p.tolist() for p in trainer.predict(module, TutorialData())],
        "uneven": _uneven(make_strategy(), CountingClassifier(), root),
    }


class CountingClassifier(TutorialClassifier):
    """Also counts the samples its test_step and validation_step see, with torchmetrics
    SumMetrics."""

    def __init__(self) -> None:
        super().__init__()
        self.test_count = torchmetrics.SumMetric()
        self.val_count = torchmetrics.SumMetric()

    def validation_step(self, batch, batch_idx):
        super().validation_step(batch, batch_idx)
        self.val_count.update(torch.tensor(float(len(batch[1]))))
        self.log("val_count", self.val_count)

    def test_step(self, batch, batch_idx):
        super().test_step(batch, batch_idx)
        self.test_count.update(torch.tensor(float(len(batch[1]))))
        self.log("test_count", self.test_count)


def _uneven(strategy, module, root: str) -> dict:
    """validate / test / predict on 9 samples, 4 per batch: rank 0 reads 5 (2 batches), rank 1 reads 4
    (1 batch + 1 padding batch, whose forward runs but whose results are discarded)."""
    data = DataLoader(TensorDataset(*blobs(9, seed=3)), batch_size=4)
    trainer = nt.Trainer(
        strategy=strategy, max_steps=1, micro_batch_size=4, default_root_dir=root, loggers=[],
        enable_checkpointing=False, enable_progress_bar=False,
    )  # fmt: skip
    return {
        "validate": trainer.validate(module, dataloaders=data),
        "test": trainer.test(module, dataloaders=data),
        "predict": [p.tolist() for p in trainer.predict(module, dataloaders=data)],
    }


def _ddp_rank(rank: int, world_size: int, root: str) -> dict:
    return _fit(nt.DDPStrategy, root, rank)


def test_metric_objects_and_sync_dist_reduce_over_ranks_and_rank_zero_logs(tmp_path):
    single = _fit(lambda: nt.SingleDeviceStrategy("cpu"), str(tmp_path / "single"), 0)
    ranks = run_world(_ddp_rank, 2, str(tmp_path / "ddp"))
    for result in ranks:
        # val_acc: a MulticlassAccuracy over each rank's half of the validation set, synced
        # over both ranks on compute(): the accuracy of the whole set, as on one process
        assert result["metrics"]["val_acc"] == pytest.approx(single["metrics"]["val_acc"], rel=1e-6)
    # val_loss is logged without sync_dist: each rank's own mean over its 2 batches, whose
    # average is the one-process mean over all 4
    mean_of_ranks = (ranks[0]["metrics"]["val_loss"] + ranks[1]["metrics"]["val_loss"]) / 2
    assert mean_of_ranks == pytest.approx(single["metrics"]["val_loss"], rel=1e-5)
    assert ranks[0]["metrics"]["val_loss"] != ranks[1]["metrics"]["val_loss"]
    # all_gather: every rank's tensor, stacked over the data-parallel ranks (one process: as is)
    assert single["gathered"] == [0.0]
    assert [r["gathered"] for r in ranks] == [[[0.0], [1.0]], [[0.0], [1.0]]]
    # sync_grads: a rank's input gets its slot's gradient summed over every rank's loss (each
    # rank's loss sums every copy, times 2): 2 per rank, 4 over two ranks
    assert single["rank_grad"] == [2.0] and [r["rank_grad"] for r in ranks] == [[4.0], [4.0]]
    user_csv = tmp_path / "ddp" / "user_rank0" / "metrics.csv"
    rows = read_csv(user_csv)
    assert column(rows, "val_acc") == [pytest.approx(single["metrics"]["val_acc"], rel=1e-6)]
    assert not (tmp_path / "ddp" / "user_rank1").exists()  # rank 1 writes nothing
    assert [r["loggers"] for r in ranks] == [1, 0]  # after fit: yours, on the rank that writes
    # test: the Metric synced over ranks gives the one-process accuracy on every rank
    for result in ranks:
        assert result["test"][0]["test_acc"] == pytest.approx(single["test"][0]["test_acc"])
    # predict: each rank predicts its share (samples rank, rank + 2, ...), in order
    flat = [sum(result["predict"], []) for result in ranks]
    expected = sum(single["predict"], [])
    assert flat[0] == expected[0::2] and flat[1] == expected[1::2]

    # uneven shards: the padding batch changes neither the synced Metrics nor the outputs
    for result in ranks + [single]:
        assert result["uneven"]["test"][0]["test_count"] == 9.0
        assert result["uneven"]["validate"][0]["val_count"] == 9.0
    for result in ranks:
        assert result["uneven"]["test"][0]["test_acc"] == pytest.approx(
            single["uneven"]["test"][0]["test_acc"]
        )
    assert [len(r["uneven"]["predict"]) for r in ranks] == [2, 1]
    expected = sum(single["uneven"]["predict"], [])
    assert sum(ranks[0]["uneven"]["predict"], []) == expected[0::2]
    assert sum(ranks[1]["uneven"]["predict"], []) == expected[1::2]
