"""`ResumableDistributedSampler`: 1 process = N shards per step, exact resume, epochs, errors."""

from __future__ import annotations

import itertools

import pytest
from torch.utils.data import DataLoader

from nanotrain.data import ResumableDistributedSampler as Sampler


def step_batches(indices: list[int], per_step: int) -> list[list[int]]:
    """Cut a shard's index stream into its per-optimizer-step pieces."""
    return [indices[i : i + per_step] for i in range(0, len(indices), per_step)]


def test_without_shuffle_shards_read_strided_entries_of_consecutive_windows():
    # dataset 10, G=4: windows [0..3], [4..7]; the last 2 samples are dropped.
    assert list(Sampler(10, 4, shuffle=False)) == list(range(8))
    assert list(Sampler(10, 4, shard_index=0, shard_count=2, shuffle=False)) == [0, 2, 4, 6]
    assert list(Sampler(10, 4, shard_index=1, shard_count=2, shuffle=False)) == [1, 3, 5, 7]
    assert list(Sampler(10, 4, shard_index=3, shard_count=4, shuffle=False)) == [3, 7]
    assert len(Sampler(10, 4, shard_index=1, shard_count=2)) == 4


@pytest.mark.parametrize("shard_count", [2, 3, 6])
def test_union_over_shards_of_each_step_is_the_single_process_global_batch(shard_count):
    dataset_len, global_batch = 50, 12
    single = step_batches(list(Sampler(dataset_len, global_batch, seed=7)), global_batch)
    per_shard = global_batch // shard_count
    shards = [
        step_batches(list(Sampler(dataset_len, global_batch, r, shard_count, seed=7)), per_shard)
        for r in range(shard_count)
    ]
    assert len(single) == dataset_len // global_batch == 4
    for step, batch in enumerate(single):
        union = sorted(i for shard in shards for i in shard[step])
        assert union == sorted(batch)
    # Within a step, shard r holds offsets r, r+n, ... of the global window, in order.
    assert shards[1][0] == single[0][1::shard_count]


def test_an_epoch_is_a_permutation_without_repeats():
    indices = list(Sampler(37, 5, seed=3))
    assert len(indices) == 35 and len(set(indices)) == 35 and set(indices) <= set(range(37))


def test_epochs_differ_with_shuffle_and_repeat_with_the_same_seed():
    a, b = Sampler(64, 8, seed=1), Sampler(64, 8, seed=1)
    epoch0 = list(a)
    a.set_epoch(1)
    epoch1 = list(a)
    assert epoch0 != epoch1 and sorted(epoch0) == sorted(epoch1)
    b.set_epoch(1)
    assert list(b) == epoch1
    assert list(Sampler(64, 8, seed=2)) != epoch0
    unshuffled = Sampler(64, 8, shuffle=False)
    unshuffled.set_epoch(5)
    assert list(unshuffled) == list(range(64))


@pytest.mark.parametrize("shard_count", [1, 2])
def test_resume_from_state_dict_continues_with_the_next_sample(shard_count):
    dataset_len, global_batch, steps_done = 40, 4, 3
    per_shard = global_batch // shard_count
    for rank in range(shard_count):
        uninterrupted = Sampler(dataset_len, global_batch, rank, shard_count, seed=5)
        uninterrupted.set_epoch(2)
        expected = list(uninterrupted)

        first = Sampler(dataset_len, global_batch, rank, shard_count, seed=5)
        first.set_epoch(2)
        consumed = list(itertools.islice(iter(first), steps_done * per_shard))
        for _ in range(steps_done):
            first.advance(per_shard)
        state = first.state_dict()
        assert state["epoch"] == 2 and state["position"] == steps_done * per_shard

        resumed = Sampler(dataset_len, global_batch, rank, shard_count, seed=5)
        resumed.load_state_dict(state)
        assert consumed + list(resumed) == expected
        assert len(resumed) == len(expected)  # __len__ stays a full epoch


def test_resume_under_another_shard_count_skips_the_same_global_batches():
    dataset_len, global_batch = 48, 8
    single = step_batches(list(Sampler(dataset_len, global_batch, seed=9)), global_batch)
    two = Sampler(dataset_len, global_batch, 0, 2, seed=9)
    two.advance(4)  # one optimizer step on each of 2 shards
    state = two.state_dict()
    rest = []  # each of 4 shards' remaining indices, 2 per step
    for r in range(4):
        resumed = Sampler(dataset_len, global_batch, r, 4, seed=9)
        resumed.load_state_dict(state)
        rest.append(list(resumed))
    for step, batch in enumerate(single[1:]):
        assert sorted(i for shard in rest for i in shard[2 * step : 2 * step + 2]) == sorted(batch)


def test_set_epoch_rewinds_the_position():
    s = Sampler(20, 4, shuffle=False)
    s.advance(8)
    assert list(s) == list(range(8, 20))
    s.set_epoch(1)
    assert list(s) == list(range(20))


def test_dataloader_over_a_resumed_sampler_yields_the_next_microbatches():
    data = list(range(100, 130))
    sampler = Sampler(len(data), 6, seed=4)
    expected = [b.tolist() for b in DataLoader(data, batch_size=3, sampler=sampler, drop_last=True)]
    sampler.advance(6)  # one optimizer step of 2 microbatches of 3
    resumed = Sampler(len(data), 6, seed=4)
    resumed.load_state_dict(sampler.state_dict())
    loader = DataLoader(data, batch_size=3, sampler=resumed, drop_last=True)
    assert [b.tolist() for b in loader] == expected[2:]


def test_bad_sizes_raise_with_the_fix():
    with pytest.raises(ValueError, match="global_batch_size=10 is not divisible by the 4"):
        Sampler(100, 10, shard_count=4)
    with pytest.raises(
        ValueError, match="dataset has 10 samples, fewer than one global batch of 32"
    ):
        Sampler(10, 32)
    with pytest.raises(ValueError, match=r"shard_index must be in \[0, 2\)"):
        Sampler(100, 4, shard_index=2, shard_count=2)


def test_advancing_past_the_epoch_or_resuming_another_order_is_refused():
    s = Sampler(16, 4, shuffle=False)
    with pytest.raises(ValueError, match="call set_epoch"):
        s.advance(17)
    with pytest.raises(ValueError, match="seed=1.*sample order would differ"):
        Sampler(16, 4, seed=2).load_state_dict(Sampler(16, 4, seed=1).state_dict())
    odd = Sampler(16, 4, shuffle=False)
    odd.advance(3)
    with pytest.raises(ValueError, match="3 consumed samples do not split over 2 shards"):
        Sampler(16, 4, 0, 2, shuffle=False).load_state_dict(odd.state_dict())
