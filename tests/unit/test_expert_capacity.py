"""Capacity factor: which token copies an expert drops, what the layer outputs without them,
and how the drops are counted, all checked against a routing fixed by hand.

The router's weight is 4 on the diagonal (expert e reads input feature e) and 0 elsewhere, so
a token whose features a and b are set (others 0) routes to experts a and b, with sigmoid
affinities s(4 x_a) and s(4 x_b) against s(0) = 0.5 for every other expert.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from nanotrain.models import presets
from nanotrain.models.build import init_weights
from nanotrain.models.config import DeepSeekConfig
from nanotrain.models.moe import DeepSeekMoE
from nanotrain.parallel.expert import capacity_keep_mask

# (expert a, feature a, expert b, feature b) per token. With N=6 tokens, K=2 and E=8 a
# capacity factor of 1.0 gives C = ceil(1.0 * 6 * 2 / 8) = 2 copies per expert.
TOKENS = [(0, 1.0, 1, 1.0), (0, 1.0, 2, 1.0), (0, 2.0, 3, 1.0), (0, 1.0, 1, 1.0), (4, 1.0, 5, 1.0)]
TOKENS.append((1, 1.0, 6, 1.0))
# Expert 0 gets t0, t1, t3 at weight 0.5 and t2 at more than 0.5: it keeps t2 (highest weight)
# and t0 (first of the ties). Expert 1 gets t0, t3, t5 at 0.5: it keeps t0 and t3.
KEPT = [{0, 1}, {2}, {0, 3}, {1}, {4, 5}, {6}]
# The same tokens in reverse order: the ties now fall the other way (u_i = t_{5-i}). Expert 0
# gets u2, u4, u5 at 0.5 and u3 higher: keeps u3, u2. Expert 1 gets u0, u2, u5: keeps u0, u2.
# u5 (= t0) loses both its copies.
KEPT_REVERSED = [{1, 6}, {4, 5}, {0, 1}, {0, 3}, {2}, set()]
DROPPED = 3  # copies per forward in either order (12 routed, 9 kept)


def capacity_config(**kw) -> DeepSeekConfig:
    """8 experts, top-2, no groups and no shared experts (the output is the routed part)."""
    base = dict(
        hidden_size=16,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        n_shared_experts=0,
        moe_intermediate_size=8,
        capacity_factor=1.0,
    )
    return DeepSeekConfig(**{**base, **kw})


def hand_routed_layer(config: DeepSeekConfig, ep_group=None, seed: int = 0) -> DeepSeekMoE:
    """A DeepSeekMoE whose router picks the experts named by the input features."""
    layer = DeepSeekMoE(config, ep_group=ep_group)
    init_weights(layer, torch.Generator().manual_seed(seed))
    with torch.no_grad():
        layer.gate.weight.zero_()
        layer.gate.weight[:, :8] = 4.0 * torch.eye(8)
    return layer


def token_inputs(tokens: list[tuple[int, float, int, float]]) -> torch.Tensor:
    """[1, N, 16] inputs with features a and b of token t set."""
    x = torch.zeros(1, len(tokens), 16)
    for t, (a, xa, b, xb) in enumerate(tokens):
        x[0, t, a], x[0, t, b] = xa, xb
    return x


def expected_output(
    full_experts: dict[str, torch.Tensor],
    tokens: list[tuple[int, float, int, float]],
    kept: list[set[int]],
) -> torch.Tensor:
    """y_t = sum over kept experts e of w_{t,e} SwiGLU_e(x_t), w = normalized sigmoid
    affinities of the two chosen experts (dropped copies contribute nothing)."""
    x = token_inputs(tokens)[0]
    y = torch.zeros_like(x)
    for t, (a, xa, b, xb) in enumerate(tokens):
        s = {a: torch.sigmoid(torch.tensor(4 * xa)), b: torch.sigmoid(torch.tensor(4 * xb))}
        for e in kept[t]:
            g, u, d = (full_experts[n][e] for n in ("gate_proj", "up_proj", "down_proj"))
            y[t] += s[e] / (s[a] + s[b]) * ((F.silu(x[t] @ g.T) * (x[t] @ u.T)) @ d.T)
    return y


def test_capacity_is_ceil_of_factor_times_balanced_share():
    layer = DeepSeekMoE(capacity_config(capacity_factor=1.25))
    assert layer.capacity(6) == math.ceil(1.25 * 6 * 2 / 8) == 2
    assert layer.capacity(100) == 32  # 1.25 * 25
    assert DeepSeekMoE(capacity_config(capacity_factor=None)).capacity(6) is None


def test_keep_mask_prefers_higher_weight_then_token_order():
    idx = torch.tensor([[0, 1], [0, 2], [0, 3], [0, 1]])
    weight = torch.tensor([[0.5, 0.5], [0.5, 0.5], [0.9, 0.1], [0.5, 0.5]])
    keep = capacity_keep_mask(idx, weight, num_experts=4, capacity=2)
    # expert 0: slots 0, 2, 4, 6 -> keeps 4 (0.9) and 0 (first tie); expert 1: slots 1, 7
    assert keep.tolist() == [True, True, False, True, True, True, False, True]


def test_capacity_drops_and_output_match_hand_routing():
    layer = hand_routed_layer(capacity_config()).train()
    full = dict(layer.experts.named_parameters())
    for tokens, kept in ((TOKENS, KEPT), (TOKENS[::-1], KEPT_REVERSED)):
        y, _ = layer(token_inputs(tokens))
        torch.testing.assert_close(y[0], expected_output(full, tokens, kept), rtol=1e-5, atol=1e-7)
    # both forwards counted: routing demand includes the dropped copies, drops are separate
    assert layer.dropped_tokens.item() == 2 * DROPPED
    demand = torch.tensor([4, 3, 1, 1, 1, 1, 1, 0]) * 2
    assert layer.expert_load.tolist() == demand.tolist()
    layer.reset_load()
    assert layer.dropped_tokens.item() == 0 and layer.expert_load.sum().item() == 0


def test_capacity_is_per_sequence_so_batching_does_not_change_the_drops():
    # TOKENS overflow expert 0; the reversed sequence keeps other copies. Batched together,
    # each sequence still gets its own C slots per expert: its output is what it gets alone
    layer = hand_routed_layer(capacity_config()).train()
    full = dict(layer.experts.named_parameters())
    both = torch.cat([token_inputs(TOKENS), token_inputs(TOKENS[::-1])])  # [2, N, 16]
    y, _ = layer(both)
    torch.testing.assert_close(y[0], expected_output(full, TOKENS, KEPT), rtol=1e-5, atol=1e-7)
    reversed_alone = expected_output(full, TOKENS[::-1], KEPT_REVERSED)
    torch.testing.assert_close(y[1], reversed_alone, rtol=1e-5, atol=1e-7)
    assert layer.dropped_tokens.item() == 2 * DROPPED


def test_capacity_applies_in_eval_but_is_counted_only_in_training():
    layer = hand_routed_layer(capacity_config()).eval()
    y, _ = layer(token_inputs(TOKENS))
    full = dict(layer.experts.named_parameters())
    torch.testing.assert_close(y[0], expected_output(full, TOKENS, KEPT), rtol=1e-5, atol=1e-7)
    assert layer.dropped_tokens.item() == 0


def test_a_large_capacity_factor_drops_nothing_and_equals_dropless():
    dropless = hand_routed_layer(capacity_config(capacity_factor=None)).train()
    roomy = hand_routed_layer(capacity_config(capacity_factor=4.0)).train()  # C = 6 >= 4 copies
    x = token_inputs(TOKENS)
    # the same sums through fixed-size slots instead of exact-size groups: equal up to the
    # GEMMs' fp32 summation order
    torch.testing.assert_close(roomy(x)[0], dropless(x)[0], rtol=1e-5, atol=1e-7)
    assert roomy.dropped_tokens.item() == 0


def test_balance_experts_reports_loads_drops_and_updated_biases_per_layer():
    config = presets.get("tiny", capacity_factor=0.5, bias_update_speed=0.01)
    from nanotrain.models import build_model

    model = build_model(config, generator=torch.Generator().manual_seed(0)).train()
    ids = torch.randint(0, config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(1))
    model(ids, labels=ids)
    expected_dropped = [int(m.dropped_tokens) for m in model.moe_layers()]
    stats = model.balance_experts()
    # tiny: layer 0 dense, layer 1 MoE, then MTP module 0 as index num_layers + 0 = 2
    assert stats.layers == [1, 2]
    assert stats.loads.sum(dim=1).tolist() == [16 * 2, 16 * 2]  # tokens x top-k, drops incl.
    # capacity ceil(0.5 * 16 * 2 / 8) = 2 per expert: at most 16 of 32 copies kept
    assert all(d >= 16 for d in expected_dropped)
    assert stats.dropped.tolist() == expected_dropped
    for bias, load in zip(stats.biases, stats.loads, strict=True):
        torch.testing.assert_close(bias, (torch.sign(load.mean() - load) * 0.01).float())
    assert model.balance_experts().dropped.tolist() == [0.0, 0.0]  # counters were reset
    dense = build_model(presets.get("tiny-dense"), device="meta")
    assert dense.balance_experts() is None


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), float("inf")])
def test_capacity_factor_must_be_positive(bad):
    with pytest.raises(ValueError, match="capacity_factor must be > 0"):
        capacity_config(capacity_factor=bad)


def test_capacity_factor_must_be_a_number():
    with pytest.raises(TypeError, match="capacity_factor must be a number or None"):
        capacity_config(capacity_factor="1.25")
