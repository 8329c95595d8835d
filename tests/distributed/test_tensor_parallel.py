"""Tensor-parallel layers equal their unsharded torch.nn counterparts (fp32, rtol 1e-5).

Every rank builds the unsharded reference (``nn.Linear``, ``nn.Embedding``,
``F.cross_entropy``) from the same seed, shards its weights into the parallel layers with
``load_full_state_dict`` and checks outputs, input grads and the gathered weight grads.
The first tests need no process group: with ``tp_group=None`` the layers ARE the torch layers.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from nanotrain.parallel import (
    ColumnParallelLinear,
    ParallelMesh,
    RowParallelLinear,
    VocabParallelEmbedding,
    pad_vocab_size,
    vocab_parallel_cross_entropy,
)
from nanotrain.parallel.collectives import all_gather_along_dim, enter_tensor_parallel_region
from tests.distributed.spawn import run_world

TOL = dict(rtol=1e-5, atol=1e-6)
B, S, H, FFN = 2, 4, 8, 16  # S, H and FFN divisible by every tp tested (2 and 4)


# --------------------------------------------------------------------------------------------
# One process: tp_group=None is exactly torch.nn
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cls", [ColumnParallelLinear, RowParallelLinear])
def test_linear_without_group_is_nn_linear(cls: type[nn.Module]) -> None:
    torch.manual_seed(3)
    ref = nn.Linear(H, FFN, bias=True)
    torch.manual_seed(3)
    layer = cls(H, FFN, bias=True)
    assert [(n, p.shape) for n, p in layer.named_parameters()] == [
        (n, p.shape) for n, p in ref.named_parameters()
    ]
    for name, param in ref.named_parameters():
        assert torch.equal(getattr(layer, name), param), name  # same init, bit for bit
    x = torch.randn(B, S, H)
    torch.testing.assert_close(layer(x), ref(x), rtol=0, atol=0)


def test_linear_without_bias_has_no_bias_parameter() -> None:
    layer = ColumnParallelLinear(H, FFN)
    assert layer.bias is None and [n for n, _ in layer.named_parameters()] == ["weight"]


def test_layers_build_on_the_meta_device() -> None:
    layer = RowParallelLinear(H, FFN, bias=True, device="meta")
    assert layer.weight.is_meta and layer.weight.shape == (FFN, H)
    emb = VocabParallelEmbedding(11, H, device="meta", dtype=torch.bfloat16)
    assert emb.weight.is_meta and emb.weight.dtype == torch.bfloat16


def test_embedding_without_group_is_nn_embedding() -> None:
    torch.manual_seed(5)
    ref = nn.Embedding(11, H)
    torch.manual_seed(5)
    emb = VocabParallelEmbedding(11, H)
    assert torch.equal(emb.weight, ref.weight) and emb.padded_num_embeddings == 11
    ids = torch.tensor([[0, 10, 3], [7, 7, 1]])
    torch.testing.assert_close(emb(ids), ref(ids), rtol=0, atol=0)


def test_cross_entropy_without_group_is_f_cross_entropy() -> None:
    logits = torch.randn(B, S, 12)
    target = torch.tensor([[0, 11, -100, 5], [3, -100, 9, 9]])
    expected = F.cross_entropy(logits.view(-1, 12), target.view(-1), reduction="none")
    loss = vocab_parallel_cross_entropy(logits, target)
    torch.testing.assert_close(loss, expected.view(B, S), rtol=0, atol=0)
    assert loss[0, 2] == 0 and loss[1, 1] == 0
    # vocab_size drops padding columns from the softmax.
    padded = torch.cat([logits, torch.full((B, S, 2), 50.0)], dim=-1)
    torch.testing.assert_close(vocab_parallel_cross_entropy(padded, target, vocab_size=12), loss)


def test_cross_entropy_rejects_mismatched_target() -> None:
    with pytest.raises(ValueError, match=r"target shape \(2, 3\) must equal .* \(2, 4\)"):
        vocab_parallel_cross_entropy(torch.randn(2, 4, 5), torch.zeros(2, 3, dtype=torch.long))


def test_pad_vocab_size() -> None:
    assert [pad_vocab_size(v, 4) for v in (8, 9, 11, 12)] == [8, 12, 12, 12]


# --------------------------------------------------------------------------------------------
# Checks run inside a gloo world
# --------------------------------------------------------------------------------------------


def _reference_mlp(seed: int) -> tuple[nn.Linear, nn.Linear]:
    torch.manual_seed(seed)
    return nn.Linear(H, FFN, bias=True), nn.Linear(FFN, H, bias=True)


def _check_init_is_layout_independent(group: dist.ProcessGroup) -> None:
    """Built from the same seed, the gathered shards are exactly nn.Linear's weights."""
    fc1, fc2 = _reference_mlp(seed=11)
    torch.manual_seed(11)
    col = ColumnParallelLinear(H, FFN, bias=True, tp_group=group)
    row = RowParallelLinear(FFN, H, bias=True, tp_group=group)
    for layer, ref in ((col, fc1), (row, fc2)):
        full = layer.gather_full_state_dict()
        assert torch.equal(full["weight"], ref.weight) and torch.equal(full["bias"], ref.bias)


def _check_mlp(group: dist.ProcessGroup, sequence_parallel: bool) -> None:
    """Column -> GELU -> Row matches the unsharded MLP: output, input grad, weight grads."""
    tp, rank = dist.get_world_size(group), dist.get_rank(group)
    fc1, fc2 = _reference_mlp(seed=7)
    x = torch.randn(B, S, H, generator=torch.Generator().manual_seed(1), requires_grad=True)
    w = torch.randn(B, S, H, generator=torch.Generator().manual_seed(2))
    y_ref = fc2(F.gelu(fc1(x)))
    (y_ref * w).sum().backward()

    kw = dict(bias=True, tp_group=group, sequence_parallel=sequence_parallel)
    col, row = ColumnParallelLinear(H, FFN, **kw), RowParallelLinear(FFN, H, **kw)
    col.load_full_state_dict(dict(fc1.named_parameters()))
    row.load_full_state_dict(dict(fc2.named_parameters()))
    assert col.weight.shape == (FFN // tp, H) and row.weight.shape == (H, FFN // tp)
    # With sequence parallelism the activations outside the TP region are split by sequence.
    split = (lambda t: t.chunk(tp, 1)[rank]) if sequence_parallel else (lambda t: t)
    x_local = split(x.detach()).clone().requires_grad_()
    y = row(F.gelu(col(x_local)))
    torch.testing.assert_close(y, split(y_ref.detach()), **TOL)
    (y * split(w)).sum().backward()
    torch.testing.assert_close(x_local.grad, split(x.grad), **TOL)

    assert row.partial_grad_names == (("bias",) if sequence_parallel else ())
    for name in row.partial_grad_names:  # each rank saw only its tokens: sum over the group
        dist.all_reduce(getattr(row, name).grad, group=group)
    for layer, ref in ((col, fc1), (row, fc2)):
        for name, param in ref.named_parameters():
            dim = layer.tp_partition_dims[name]
            grad = getattr(layer, name).grad
            full = grad if dim is None else all_gather_along_dim(grad, dim, group)
            torch.testing.assert_close(full, param.grad, **TOL, msg=f"{layer} {name}")


def _check_shared_input(group: dist.ProcessGroup, sequence_parallel: bool) -> None:
    """Two column layers reading one entered input (gate/up style) equal two nn.Linear's:
    output, input grad (summed over both branches by the single collective), weight grads."""
    tp, rank = dist.get_world_size(group), dist.get_rank(group)
    torch.manual_seed(17)
    gate, up, down = nn.Linear(H, FFN), nn.Linear(H, FFN), nn.Linear(FFN, H)
    x = torch.randn(B, S, H, generator=torch.Generator().manual_seed(3), requires_grad=True)
    down(F.silu(gate(x)) * up(x)).pow(2).sum().backward()

    kw = dict(bias=True, tp_group=group, sequence_parallel=sequence_parallel)
    cols = [ColumnParallelLinear(H, FFN, shared_input=True, **kw) for _ in range(2)]
    row = RowParallelLinear(FFN, H, **kw)
    for layer, ref in ((cols[0], gate), (cols[1], up), (row, down)):
        layer.load_full_state_dict(dict(ref.named_parameters()))
    split = (lambda t: t.chunk(tp, 1)[rank]) if sequence_parallel else (lambda t: t)
    x_local = split(x.detach()).clone().requires_grad_()
    entered = enter_tensor_parallel_region(x_local, group, sequence_parallel=sequence_parallel)
    assert entered.shape == (B, S, H)  # the whole sequence inside the region
    y = row(F.silu(cols[0](entered)) * cols[1](entered))
    # Under sequence parallelism each rank's loss covers its own tokens; together, the reference's.
    y.pow(2).sum().backward()
    torch.testing.assert_close(x_local.grad, split(x.grad), **TOL)
    for layer, ref in ((cols[0], gate), (cols[1], up)):
        for name in ("weight", "bias"):
            grad = all_gather_along_dim(getattr(layer, name).grad, 0, group)
            torch.testing.assert_close(grad, getattr(ref, name).grad, **TOL)


def _check_gather_output_and_unsplit_input(group: dist.ProcessGroup) -> None:
    fc1, fc2 = _reference_mlp(seed=9)
    col = ColumnParallelLinear(H, FFN, bias=True, tp_group=group, gather_output=True)
    row = RowParallelLinear(FFN, H, bias=True, tp_group=group, input_is_parallel=False)
    col.load_full_state_dict(dict(fc1.named_parameters()))
    row.load_full_state_dict(dict(fc2.named_parameters()))
    x = torch.randn(B, S, H, generator=torch.Generator().manual_seed(4))
    h = col(x)  # [B, S, FFN]: gathered, so the full hidden goes into the row layer
    torch.testing.assert_close(h, fc1(x), **TOL)
    torch.testing.assert_close(row(h), fc2(h), **TOL)


def _check_embedding(group: dist.ProcessGroup, vocab: int, sequence_parallel: bool) -> None:
    """Padded vocab shards match nn.Embedding in init, lookup and (gathered) weight grad."""
    tp, rank = dist.get_world_size(group), dist.get_rank(group)
    torch.manual_seed(13)
    ref = nn.Embedding(vocab, H)
    torch.manual_seed(13)
    emb = VocabParallelEmbedding(vocab, H, tp_group=group, sequence_parallel=sequence_parallel)
    padded = pad_vocab_size(vocab, tp)
    assert emb.weight.shape == (padded // tp, H)
    assert torch.equal(emb.gather_full_state_dict()["weight"], ref.weight)

    ids = torch.arange(B * S * 3).remainder(vocab).view(B, S * 3)  # every id, some repeated
    w = torch.randn(B, S * 3, H, generator=torch.Generator().manual_seed(6))
    (ref(ids) * w).sum().backward()
    split = (lambda t: t.chunk(tp, 1)[rank]) if sequence_parallel else (lambda t: t)
    out = emb(ids)
    torch.testing.assert_close(out, split(ref(ids).detach()), **TOL)
    (out * split(w)).sum().backward()
    grad = all_gather_along_dim(emb.weight.grad, 0, group)  # [padded, H]
    torch.testing.assert_close(grad[:vocab], ref.weight.grad, **TOL)
    assert torch.all(grad[vocab:] == 0), "padding rows must get no gradient"


def _check_cross_entropy(group: dist.ProcessGroup, vocab: int) -> None:
    """Sharded CE (padding excluded, ignore_index honoured) equals F.cross_entropy + grad."""
    tp, rank = dist.get_world_size(group), dist.get_rank(group)
    padded = pad_vocab_size(vocab, tp)
    gen = torch.Generator().manual_seed(8)
    logits = 3 * torch.randn(B, S, vocab, generator=gen)
    logits.requires_grad_()
    target = torch.randint(0, vocab, (B, S), generator=gen)
    target[0, 1] = target[1, 3] = -100
    target[1, 0] = vocab - 1  # the last real id, next to the padding
    g = torch.rand(B, S, generator=gen)
    ref = F.cross_entropy(logits.view(-1, vocab), target.view(-1), reduction="none")
    (ref.view(B, S) * g).sum().backward()

    # Padding logits get junk values: they must not enter the softmax.
    full = torch.cat([logits.detach(), torch.full((B, S, padded - vocab), 30.0)], dim=-1)
    local = full.chunk(tp, -1)[rank].clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(local, target, group, vocab_size=vocab)
    torch.testing.assert_close(loss, ref.detach().view(B, S), **TOL)
    assert loss[0, 1] == 0 and loss[1, 3] == 0
    (loss * g).sum().backward()
    ref_grad = F.pad(logits.grad, (0, padded - vocab)).chunk(tp, -1)[rank]
    torch.testing.assert_close(local.grad, ref_grad, **TOL)


def _check_mesh_groups(mesh: ParallelMesh) -> None:
    for axis in ("tp", "pp", "dp", "ep", "expert_dp", "mp"):
        assert dist.get_process_group_ranks(mesh.group(axis)) == mesh.group_ranks(axis), axis


def _world_of_two(rank: int, world_size: int) -> str:
    group = dist.group.WORLD
    _check_init_is_layout_independent(group)
    _check_mlp(group, sequence_parallel=False)
    _check_mlp(group, sequence_parallel=True)
    _check_shared_input(group, sequence_parallel=False)
    _check_shared_input(group, sequence_parallel=True)
    _check_gather_output_and_unsplit_input(group)
    _check_embedding(group, vocab=11, sequence_parallel=False)  # padded to 12
    _check_embedding(group, vocab=12, sequence_parallel=True)
    _check_cross_entropy(group, vocab=11)
    _check_cross_entropy(group, vocab=12)
    return "ok"


def _world_of_four(rank: int, world_size: int) -> str:
    # tp=2 inside a tp=2 x dp=2 mesh: the layers work on sub-groups, not only the world.
    mesh = ParallelMesh.build(tp=2, dp=2, num_heads=4)
    assert (mesh.tp_rank, mesh.dp_rank) == (rank % 2, rank // 2)
    _check_mesh_groups(mesh)
    _check_mlp(mesh.tp_group, sequence_parallel=False)
    _check_mlp(mesh.tp_group, sequence_parallel=True)
    # tp=4 over the world with vocab 9 -> 12 rows: rank 3 holds only padding (ids 9..11).
    _check_embedding(dist.group.WORLD, vocab=9, sequence_parallel=False)
    _check_cross_entropy(dist.group.WORLD, vocab=9)
    return "ok"


@pytest.mark.distributed
def test_tensor_parallel_layers_match_torch_at_tp2() -> None:
    assert run_world(_world_of_two, 2) == ["ok", "ok"]


@pytest.mark.distributed
def test_tensor_parallel_layers_on_mesh_subgroups_and_padding_only_rank() -> None:
    assert run_world(_world_of_four, 4) == ["ok"] * 4
