"""Training on an IterableDataset: the same steps as the map-style dataset of the same samples,
shared out over replicas without repeats, resumed exactly where the dataset keeps a position,
refused with a reason where it cannot."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset

import nanotrain as nt
from nanotrain.callbacks.checkpoint import ModelCheckpoint
from nanotrain.data.streaming import StreamLoader, StreamSampler
from tests.unit.test_checkpoint import LossRecorder, make_trainer

VOCAB, SEQ = 64, 8


def sample(i: int) -> dict[str, torch.Tensor]:
    """Sample ``i``: random tokens, the first ``(5 i + 2) % (SEQ + 1)`` labels kept."""
    ids = torch.randint(0, VOCAB, (SEQ + 1,), generator=torch.Generator().manual_seed(i))
    labels = ids[1:].clone()
    labels[(5 * i + 2) % (SEQ + 1) :] = -100
    return {"input_ids": ids[:-1], "labels": labels}


class Samples(Dataset):
    """Map-style: samples 0 .. n-1."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return sample(i)


class Stream(IterableDataset):
    """Samples 0 .. n-1 as a stream, without a position to save."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        return (sample(i) for i in range(self.n))


class StatefulStream(Stream):
    """A stream that keeps its position: the samples yielded so far; a loaded position is
    skipped on the next iteration."""

    def __init__(self, n: int) -> None:
        super().__init__(n)
        self.yielded = self.skip = 0

    def __iter__(self):
        start, self.skip = self.skip, 0
        for i in range(start, self.n):
            self.yielded = i + 1
            yield sample(i)

    def state_dict(self) -> dict[str, int]:
        return {"yielded": self.yielded}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.skip = self.yielded = state["yielded"]


def fit(root, data, max_steps, ckpt_path=None, save=False, **settings):
    recorder = LossRecorder()
    callbacks = [recorder, ModelCheckpoint()] if save else [recorder]
    settings = {"micro_batch_size": 2, "global_batch_size": 8, **settings}
    trainer = make_trainer(root, max_steps, callbacks, **settings)
    module = nt.LanguageModelModule(
        "tiny-dense", vocab_size=VOCAB, warmup_steps=1, decay_steps=10, lr=3e-3
    )
    trainer.fit(module, train_dataloaders=data, ckpt_path=ckpt_path)
    return [float(recorder.losses[s]) for s in sorted(recorder.losses)], trainer


def test_a_stream_trains_as_the_map_style_dataset_of_its_samples_across_epochs(tmp_path):
    # 20 samples, 8 per step: 2 steps per epoch (the last 4 left out), 5 steps = 3 epochs
    mapped, map_trainer = fit(tmp_path / "map", DataLoader(Samples(20), 2, shuffle=False), 5)
    with pytest.warns(UserWarning, match="stream ended 4 samples into a global batch of 8"):
        streamed, trainer = fit(tmp_path / "stream", DataLoader(Stream(20), batch_size=2), 5)
    assert streamed == mapped  # bit for bit
    assert len(set(streamed)) == 5
    # in the third epoch, cut short: Lightning counts it done
    assert trainer.current_epoch == map_trainer.current_epoch == 3
    bare, _ = fit(tmp_path / "bare", Stream(20), 5)  # a bare IterableDataset: the Trainer batches
    assert bare == mapped


class EpochDecay(nt.LanguageModelModule):
    """SGD whose learning rate drops tenfold at every epoch's end."""

    def configure_optimizers(self):
        sgd = torch.optim.SGD(self.parameters(), lr=0.5)
        decay = torch.optim.lr_scheduler.StepLR(sgd, step_size=1, gamma=0.1)
        return {"optimizer": sgd, "lr_scheduler": {"scheduler": decay, "interval": "epoch"}}


def test_an_epoch_scheduler_steps_when_the_stream_runs_out(tmp_path):
    runs = []
    for name, data in (("map", DataLoader(Samples(20), 2)), ("stream", Stream(20))):
        recorder = LossRecorder()
        trainer = make_trainer(
            tmp_path / name, 5, [recorder], micro_batch_size=2, global_batch_size=8
        )
        trainer.fit(EpochDecay("tiny-dense", vocab_size=VOCAB), train_dataloaders=data)
        runs.append([float(recorder.losses[s]) for s in sorted(recorder.losses)])
        assert trainer.lr_scheduler_configs[0].scheduler.get_last_lr() == [pytest.approx(5e-3)]
    assert runs[1] == runs[0]


class Rows(IterableDataset):
    """The rows of `tests.unit.test_lightning_data.dataset(20)` as a stream."""

    def __iter__(self):
        from tests.unit.test_lightning_data import dataset

        return iter(dataset(20))


def test_a_stream_with_max_steps_trains_as_under_lightning(tmp_path):
    from tests.unit.test_lightning_data import (
        assert_same_weights,
        fresh,
        lightning_fit,
        nt_trainer,
    )

    lit_module, nt_module = fresh(), fresh()
    # 5 batches of 4 per epoch: 7 steps run into the second epoch
    lit = lightning_fit(lit_module, DataLoader(Rows(), batch_size=4), max_steps=7, max_epochs=None)
    ours = nt_trainer(tmp_path, max_steps=7, max_epochs=None)
    ours.fit(nt_module, DataLoader(Rows(), batch_size=4))
    assert ours.global_step == lit.global_step == 7
    expected = [list(range(i, i + 4)) for i in range(0, 20, 4)] + [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert nt_module.seen == lit_module.seen == expected
    assert ours.current_epoch == lit.current_epoch == 2  # the cut epoch counts as done
    assert_same_weights(nt_module, lit_module)


def test_replicas_read_disjoint_shares_that_make_up_each_global_batch():
    stream = Stream(30)
    shares = []
    for rank in range(4):
        sampler = StreamSampler(stream, global_batch_size=8, shard_index=rank, shard_count=4)
        loader = StreamLoader(sampler, micro_batch_size=1, collate_fn=lambda xs: xs[0])
        shares.append([_index_of(b) for b in loader])
    for step in range(3):  # 30 samples: 3 whole global batches of 8
        got = sorted(i for share in shares for i in share[2 * step : 2 * step + 2])
        assert got == list(range(8 * step, 8 * step + 8))
    assert [len(s) for s in shares] == [6, 6, 6, 6]
    assert shares[1][:2] == [1, 5]  # replica r: offsets r, r + n of each global batch


def _index_of(item: dict[str, torch.Tensor]) -> int:
    return next(i for i in range(40) if torch.equal(sample(i)["input_ids"], item["input_ids"]))


@pytest.mark.parametrize("kind", ["own", "datasets"])
def test_a_stream_with_a_position_resumes_exactly(tmp_path, kind):
    def data():
        if kind == "own":
            return DataLoader(StatefulStream(40), batch_size=2)
        import datasets

        rows = [{k: v.tolist() for k, v in sample(i).items()} for i in range(40)]
        stream = datasets.Dataset.from_list(rows).to_iterable_dataset(num_shards=3)
        return DataLoader(stream.with_format("torch"), batch_size=2)

    straight, _ = fit(tmp_path / "straight", data(), 4)
    fit(tmp_path / "split", data(), 2, save=True)
    resumed, _ = fit(tmp_path / "split", data(), 4, ckpt_path="last")
    assert resumed == straight[2:]  # bit for bit


def test_resuming_mid_stream_without_a_position_is_refused(tmp_path):
    fit(tmp_path, Stream(40), 2, save=True)
    with pytest.raises(ValueError, match="cannot resume exactly: .* 16 samples into epoch 0 "):
        fit(tmp_path, Stream(40), 4, ckpt_path="last")
    with pytest.raises(ValueError, match="checkpoint read a stream"):
        fit(tmp_path, Samples(40), 4, ckpt_path="last")


def test_what_a_stream_cannot_do_is_refused_with_the_fix(tmp_path):
    with pytest.raises(ValueError, match="num_workers=0"):
        fit(tmp_path, DataLoader(Stream(40), batch_size=2, num_workers=1), 1)
    with pytest.raises(ValueError, match=r"cannot shuffle the training IterableDataset"):
        fit(tmp_path, Stream(40), 1, shuffle=True)
    with pytest.raises(ValueError, match="val_check_interval=0.5 is a fraction of an epoch"):
        fit(tmp_path, Stream(40), 1, val_check_interval=0.5)
    with pytest.raises(ValueError, match="ended after 6 samples, fewer than one global batch"):
        fit(tmp_path, Stream(6), 1)
    with pytest.raises(TypeError, match="validation data is an IterableDataset"):
        trainer = make_trainer(
            tmp_path, 1, limit_val_batches=None, micro_batch_size=2, global_batch_size=8
        )
        module = nt.LanguageModelModule("tiny-dense", vocab_size=VOCAB)
        trainer.fit(module, train_dataloaders=Samples(8), val_dataloaders=Stream(8))


def test_a_datasets_stream_split_by_node_is_refused():
    import datasets
    from datasets.distributed import split_dataset_by_node

    stream = datasets.Dataset.from_list([{"x": 1}] * 4).to_iterable_dataset()
    with pytest.raises(ValueError, match="split_dataset_by_node; nanotrain shares a stream"):
        StreamSampler(split_dataset_by_node(stream, 0, 2), 8, 0, 2)
