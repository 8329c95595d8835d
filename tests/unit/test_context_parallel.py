"""Context parallelism without processes: chunk placement, position ids, the causal mask by
global position, the mesh's cp axis and MegatronStrategy's refusals (issue 52)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import nanotrain as nt
from nanotrain.parallel.context import (
    causal_mask,
    check_context_length,
    chunk_positions,
    context_batch,
    split_sequence,
)
from nanotrain.parallel.mesh import MeshLayout
from nanotrain.strategies.megatron import MegatronStrategy


class StandIn:
    """A group of `size` ranks seen from `rank` (what `group_size` / `group_rank` ask)."""

    def __init__(self, size: int, rank: int) -> None:
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


def test_rank_i_holds_chunks_i_and_2n_minus_1_minus_i():
    # T = 16, cp = 4: 8 chunks of 2 tokens; rank 0 holds chunks 0 and 7, rank 3 chunks 3 and 4
    assert chunk_positions(16, 4, 0).tolist() == [0, 1, 14, 15]
    assert chunk_positions(16, 4, 1).tolist() == [2, 3, 12, 13]
    assert chunk_positions(16, 4, 2).tolist() == [4, 5, 10, 11]
    assert chunk_positions(16, 4, 3).tolist() == [6, 7, 8, 9]
    assert chunk_positions(8, 1, 0).tolist() == list(range(8))


def test_chunks_cover_the_sequence_once_and_balance_the_causal_work():
    seq, cp = 24, 3
    every = torch.cat([chunk_positions(seq, cp, r) for r in range(cp)])
    assert sorted(every.tolist()) == list(range(seq))
    # a query at position p attends to p + 1 keys: every rank gets the same number of pairs
    work = {int((chunk_positions(seq, cp, r) + 1).sum()) for r in range(cp)}
    assert work == {seq * (seq + 1) // 2 // cp}


def test_split_sequence_keeps_the_tokens_at_the_rank_positions():
    ids = torch.arange(100, 116).repeat(2, 1)  # [B=2, T=16], token = 100 + position
    for rank in range(4):
        mine = split_sequence(ids, 4, rank)
        assert mine.shape == (2, 4)
        assert (mine[0] - 100).tolist() == chunk_positions(16, 4, rank).tolist()


def test_context_batch_cuts_sequence_tensors_and_keeps_per_sample_ones():
    batch = {
        "input_ids": torch.arange(8).repeat(3, 1),
        "labels": torch.arange(1, 9).repeat(3, 1),
        "part": torch.tensor([0, 1, 2]),
    }
    mine = context_batch(batch, StandIn(2, 1))  # rank 1 of 2: positions 2, 3, 4, 5
    assert mine["input_ids"][0].tolist() == [2, 3, 4, 5]
    assert mine["labels"][0].tolist() == [3, 4, 5, 6]  # shifted before chunking: t -> t + 1
    assert mine["part"] is batch["part"]
    assert context_batch(batch, None) is batch
    with pytest.raises(TypeError, match="needs dict batches with an 'input_ids' tensor"):
        context_batch((batch["input_ids"],), StandIn(2, 0))


def test_causal_mask_follows_global_positions():
    mask = causal_mask(torch.tensor([0, 3]), 4)  # queries at 0 and 3 over keys 0..3
    assert mask.shape == (1, 1, 2, 4)
    assert mask[0, 0].tolist() == [[True, False, False, False], [True, True, True, True]]


def test_sequence_length_must_split_into_2cp_chunks():
    check_context_length(16, 2, tp=2)
    with pytest.raises(ValueError, match=r"seq_len=12 must be a multiple of 2\*cp\*tp"):
        check_context_length(12, 2, tp=2)
    with pytest.raises(ValueError, match="multiple of 2\\*cp = 2\\*2 = 4; use seq_len 8 or 12"):
        chunk_positions(10, 2, 0)


def test_mesh_orders_tp_then_cp_then_data_and_carves_ep_from_dp_x_cp():
    # world 8: tp=2, cp=2, dp=2 (4 weight replicas): rank = tp + 2 * (cp + 2 * data)
    layout = MeshLayout(tp=2, dp=4, cp=2, ep=2)
    assert layout.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert layout.groups("cp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert layout.groups("dp") == [[0, 2, 4, 6], [1, 3, 5, 7]]  # gradients over dp x cp
    assert layout.groups("ep") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    c = layout.coords(6)
    assert (c.tp_rank, c.cp_rank, c.data_rank, c.dp_rank) == (0, 1, 1, 3)
    assert layout.group_of("cp", 6) == [4, 6]
    with pytest.raises(ValueError, match="cp=3 does not divide the 4 weight replicas"):
        MeshLayout(dp=4, cp=3)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(cp=0), "cp must be >= 1"),
        (dict(cp=2, overlap_forward_backward=True, pp=2, virtual_pp=2), "cp=2 with overlap"),
        (dict(cp=2, ep=4, dp=1), r"ep=4 does not divide dp\*cp=1\*2=2"),
    ],
)
def test_bad_context_option_fails_at_construction(kwargs, message):
    with pytest.raises(ValueError, match=message):
        MegatronStrategy(**kwargs)


def test_context_layout_not_fitting_the_world_fails_before_any_process_group(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "6")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(ValueError, match=r"tp\*pp\*cp=1\*1\*4=4 does not divide world_size=6"):
        MegatronStrategy(cp=4).setup_environment()
    assert MegatronStrategy(cp=2, dp=2).validate_world(4) == 4  # 4 replicas: dp x cp
    assert not dist.is_initialized()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(model_overrides={"capacity_factor": 1.0}), "needs dropless MoE layers"),
    ],
)
def test_what_context_parallelism_cannot_split_fails_before_the_model_is_built(
    monkeypatch, kwargs, message
):
    monkeypatch.setenv("WORLD_SIZE", "2")
    module = nt.LanguageModelModule("tiny", vocab_size=256, **kwargs)
    with pytest.raises(ValueError, match=message):
        MegatronStrategy(cp=2).setup_module(module)
    assert module.model is None
