"""Fixed-size expert slots (`nanotrain.models.capacity_dispatch`): the same outputs and
gradients as sorting the kept copies by expert, and no host read in a whole MoE layer."""

from __future__ import annotations

import pytest
import torch

from nanotrain.models.build import init_weights
from nanotrain.models.capacity_dispatch import (
    combine_from_slots,
    dispatch_to_slots,
    run_experts_in_slots,
    slot_positions,
    slot_weights,
)
from nanotrain.models.moe import DeepSeekMoE, GroupedExperts, combine, copy_weights, dispatch
from nanotrain.parallel.expert import capacity_keep_mask
from nanotrain.runtime.sync_guard import HostSyncCounter
from tests.unit.test_expert_capacity import capacity_config

N, K, E, H = 24, 2, 8, 16


def _routing(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    # skewed: experts 0 and 1 get most copies, so a capacity drops some and leaves slots empty
    logits = torch.randn(N, E, generator=g) + torch.tensor([3.0, 2.0] + [0.0] * (E - 2))
    weight, idx = logits.softmax(-1).topk(K, dim=-1)
    return idx, weight


def _experts(seed: int) -> GroupedExperts:
    experts = GroupedExperts(E, H, 8)
    g = torch.Generator().manual_seed(seed)
    for p in experts.parameters():
        with torch.no_grad():
            p.copy_(0.3 * torch.randn(p.shape, generator=g))
    return experts


def _grads(out: torch.Tensor, *tensors: torch.Tensor) -> list[torch.Tensor]:
    probe = torch.randn(out.shape, generator=torch.Generator().manual_seed(9))
    return list(torch.autograd.grad((out * probe).sum(), tensors))


def test_slots_match_sorted_kept_copies_with_drops_and_empty_experts():
    idx, weight = _routing(0)
    capacity = 4  # expert 0 and 1 overflow, others have empty slots
    h = torch.randn(N, H, generator=torch.Generator().manual_seed(1), requires_grad=True)
    w = weight.clone().requires_grad_()
    experts = _experts(2)
    params = list(experts.parameters())

    keep = capacity_keep_mask(idx, w, E, capacity)
    d = dispatch(h, idx, E, keep)
    reference = combine(experts(d.x, d.counts.tolist(), copy_weights(w, d)), d, N)

    position, kept = slot_positions(idx, w, E, capacity)
    assert kept.tolist() == keep.tolist()
    assert 0 < int((~kept).sum()) and int(kept.sum()) < E * capacity  # drops and empty slots
    x_slots = dispatch_to_slots(h, idx, position, E * capacity)
    w_slots = slot_weights(w, position, E * capacity)
    y_slots = run_experts_in_slots(x_slots, E, capacity, experts, None, scale=w_slots)
    y = combine_from_slots(y_slots, position, N)

    torch.testing.assert_close(y, reference, rtol=1e-5, atol=1e-6)
    for got, want in zip(_grads(y, h, w, *params), _grads(reference, h, w, *params), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("groups", [1, 2, 3])
def test_each_kept_copy_sits_in_its_experts_slots_in_priority_order(groups):
    # groups: equal runs of consecutive tokens (a MoE layer's sequences), each with its own
    # C slots per expert at rows (e * G + g) * C ..
    idx, weight = _routing(3)
    capacity = 3
    position, keep = slot_positions(idx, weight, E, capacity, groups)
    flat, w = idx.reshape(-1), weight.reshape(-1)
    group_of = torch.arange(N * K) // (K * N // groups)
    for g in range(groups):
        for e in range(E):
            mine = ((flat == e) & (group_of == g)).nonzero().flatten()
            order = sorted(mine.tolist(), key=lambda s: (-float(w[s]), s))  # weight, then slot
            for rank, slot in enumerate(order):
                kept = rank < capacity
                expected = (e * groups + g) * capacity + rank if kept else E * groups * capacity
                assert int(position[slot]) == expected and bool(keep[slot]) == kept


def test_capacity_groups_must_split_the_tokens_evenly():
    idx, weight = _routing(3)
    with pytest.raises(ValueError, match="equal capacity groups"):
        slot_positions(idx, weight, E, 3, groups=5)  # 24 tokens


def test_a_moe_layer_with_a_capacity_never_reads_the_device():
    layer = DeepSeekMoE(capacity_config(hidden_size=H, capacity_factor=1.0)).train()
    init_weights(layer, torch.Generator().manual_seed(0))
    x = torch.randn(2, 6, H, generator=torch.Generator().manual_seed(1), requires_grad=True)
    with HostSyncCounter() as c:
        y, aux = layer(x)
        (y.square().sum() + aux).backward()
    assert c.records == [], c.records
    assert int(layer.dropped_tokens) > 0  # the capacity did drop copies
