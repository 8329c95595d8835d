"""DeepSeekMoE: routing, dispatch/experts/combine, balance loss and aux-loss-free balancing."""

import pytest
import torch
import torch.nn.functional as F

from nanotrain.models.balance import update_bias
from nanotrain.models.config import DeepSeekConfig
from nanotrain.models.moe import DeepSeekMoE, TopKRouter, sequence_balance_loss


def _config(**kw):
    base = dict(hidden_size=16, n_routed_experts=8, moe_intermediate_size=8, num_experts_per_tok=2)
    return DeepSeekConfig(**{**base, **kw})


def _random_moe(config, seed=0):
    torch.manual_seed(seed)
    moe = DeepSeekMoE(config)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0.0, 0.5)
    return moe


def _swiglu(x, gate, up, down):
    return (F.silu(x @ gate.T) * (x @ up.T)) @ down.T


def test_dispatch_experts_combine_equals_naive_per_token_loop():
    c = _config(n_shared_experts=1)
    moe = _random_moe(c)
    x = torch.randn(2, 5, 16)
    y, _ = moe(x)
    h = x.reshape(10, 16)
    topk_idx, topk_weight, _ = moe.gate(h)
    ex, sh = moe.experts, moe.shared_experts
    expected = torch.zeros(10, 16)
    for t in range(10):
        for k in range(c.num_experts_per_tok):
            e = topk_idx[t, k]
            out = _swiglu(h[t], ex.gate_proj[e], ex.up_proj[e], ex.down_proj[e])
            expected[t] += topk_weight[t, k] * out
        expected[t] += _swiglu(h[t], sh.gate_proj.weight, sh.up_proj.weight, sh.down_proj.weight)
    torch.testing.assert_close(y.reshape(10, 16), expected, rtol=1e-5, atol=1e-6)


def test_dispatch_sorts_copies_by_expert_with_counts():
    from nanotrain.models.moe import dispatch

    h = torch.arange(3.0)[:, None]  # token t has value t
    d = dispatch(h, torch.tensor([[2, 0], [0, 1], [2, 1]]), num_experts=4)
    assert d.counts.tolist() == [2, 2, 2, 0]
    assert d.x.squeeze(1).tolist() == [0.0, 1.0, 1.0, 2.0, 0.0, 2.0]  # experts 0, 0, 1, 1, 2, 2


# Choice scores for 8 experts in 4 groups of 2. Group scores: top-2 sums are 0.9, 0.98, 1.05,
# 0.2 (sigmoid -> groups 2 and 1); maxima are 0.9, 0.5, 0.6, 0.1 (softmax -> groups 0 and 2).
HAND_SCORES = torch.tensor([[0.9, 0.0, 0.5, 0.48, 0.6, 0.45, 0.1, 0.1]])


def test_group_limited_routing_sigmoid_uses_top2_sum_per_group():
    router = TopKRouter(_config(n_group=4, topk_group=2, scoring_func="sigmoid"))
    picked = set(router.select(HAND_SCORES)[0].tolist())
    assert picked == {4, 2}  # the best single expert (0) is in a losing group


def test_group_limited_routing_softmax_uses_group_max():
    router = TopKRouter(_config(n_group=4, topk_group=2, scoring_func="softmax"))
    assert set(router.select(HAND_SCORES)[0].tolist()) == {0, 4}


def test_scoring_functions_sigmoid_and_softmax():
    h = torch.randn(3, 16)
    for func in ("sigmoid", "softmax"):
        router = TopKRouter(_config(scoring_func=func))
        torch.nn.init.normal_(router.weight)
        logits = h @ router.weight.T
        expected = logits.sigmoid() if func == "sigmoid" else logits.softmax(-1)
        torch.testing.assert_close(router.scores(h), expected)


@pytest.mark.parametrize("normalize", [True, False])
def test_weights_are_normalized_then_scaled(normalize):
    router = TopKRouter(_config(norm_topk_prob=normalize, routed_scaling_factor=2.5))
    torch.nn.init.normal_(router.weight)
    h = torch.randn(4, 16)
    idx, weight, _ = router(h)
    s = (h @ router.weight.T).sigmoid().gather(1, idx)
    expected = (s / s.sum(-1, keepdim=True) if normalize else s) * 2.5
    torch.testing.assert_close(weight, expected)


def test_bias_steers_selection_but_not_weights_and_gets_no_grad():
    router = TopKRouter(_config(norm_topk_prob=False))
    torch.nn.init.normal_(router.weight)
    h = torch.randn(5, 16)
    router.e_score_correction_bias[3] = 10.0  # expert 3 now wins every token
    idx, weight, _ = router(h)
    assert (idx == 3).any(dim=1).all()
    unbiased = (h @ router.weight.T).sigmoid()
    torch.testing.assert_close(weight, unbiased.gather(1, idx))  # no bias in the weight
    weight.sum().backward()
    assert "e_score_correction_bias" not in dict(router.named_parameters())
    assert router.e_score_correction_bias.grad is None and router.weight.grad is not None


def test_sequence_balance_loss_matches_paper_formula_on_hand_example():
    # seq 0: s' rows [.4 .1 .3 .2], [.05 .45 .25 .25] -> P = [.225 .275 .275 .225];
    #        chosen {0,2}, {1,2} -> f = E/(K T) * counts = 1 * [1 1 2 0] -> sum f P = 1.05
    # seq 1: uniform scores -> P = .25 each; chosen {0,1} twice -> f = [2 2 0 0] -> 1.0
    scores = torch.tensor(
        [[0.8, 0.2, 0.6, 0.4], [0.1, 0.9, 0.5, 0.5], [1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 1.0]]
    )
    idx = torch.tensor([[0, 2], [1, 2], [0, 1], [0, 1]])
    loss = sequence_balance_loss(scores, idx, batch=2, alpha=0.01)
    assert loss.item() == pytest.approx(0.01 * (1.05 + 1.0) / 2)


def test_moe_aux_loss_only_in_training_and_scaled_by_alpha():
    moe = _random_moe(_config(aux_loss_alpha=0.1))
    x = torch.randn(2, 4, 16)
    _, aux = moe(x)
    h = x.reshape(8, 16)
    idx, _, scores = moe.gate(h)
    assert aux.item() == pytest.approx(sequence_balance_loss(scores, idx, 2, 0.1).item())
    moe.eval()
    assert moe(x)[1].item() == 0.0


def test_expert_load_counts_training_forwards_and_bias_update_resets_it():
    moe = _random_moe(_config())
    moe(torch.randn(2, 3, 16))
    moe(torch.randn(1, 4, 16))
    assert moe.expert_load.sum().item() == (6 + 4) * 2  # token copies = tokens x top-k
    loads = moe.expert_load.clone()
    seen = []
    update_bias([moe], speed=0.01, reduce_fn=lambda t: seen.append(t.clone()) or t * 2)
    # one reduction of [layers, E + 1]: the loads, then the dropped copies (none: dropless)
    torch.testing.assert_close(seen[0], torch.cat([loads, torch.zeros(1, dtype=torch.long)])[None])
    mean = loads.double().mean()
    expected = torch.where(loads > mean, -0.01, torch.where(loads < mean, 0.01, 0.0))
    torch.testing.assert_close(moe.gate.e_score_correction_bias, expected.float())
    assert moe.expert_load.sum().item() == 0


def test_balancing_bias_stays_fp32_when_the_model_is_cast_to_bf16():
    # bf16-true casts the model; a 1e-3 bias step is below bf16's spacing at |b| >= 0.5
    moe = _random_moe(_config())
    with torch.no_grad():
        moe.gate.e_score_correction_bias.fill_(0.75)
    moe.to(torch.bfloat16)
    assert moe.gate.weight.dtype == torch.bfloat16
    assert moe.gate.e_score_correction_bias.dtype == torch.float32
    moe(torch.randn(2, 3, 16, dtype=torch.bfloat16))
    before = moe.gate.e_score_correction_bias.clone()
    update_bias([moe], speed=1e-3)
    moved = (moe.gate.e_score_correction_bias - before).abs()
    assert moved.max() == pytest.approx(1e-3, rel=1e-3)  # every step lands
    assert moe.to(torch.float64).gate.e_score_correction_bias.dtype == torch.float32
    assert moe.gate.weight.dtype == torch.float64


def test_aux_loss_free_balancing_lowers_max_over_mean_load():
    speed = 0.01
    moe = _random_moe(_config(n_shared_experts=0, bias_update_speed=speed), seed=1)
    x = torch.randn(4, 16, 16)
    x[..., 0] = 1.0  # a constant feature through which the router favours experts 0 and 1
    with torch.no_grad():
        moe.gate.weight[:2, 0] += 4.0
    imbalance = []  # max / mean expert load per step
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # 60 tiny steps: thread wake-ups would cost 50x the math
    try:
        with torch.no_grad():
            for _ in range(60):
                moe(x)
                imbalance.append((moe.expert_load.max() / moe.expert_load.float().mean()).item())
                update_bias([moe], speed)
    finally:
        torch.set_num_threads(threads)
    assert imbalance[0] > 3.0  # nearly all copies on 2 of 8 experts (4.0 would be all)
    # the bias moves by +-speed per step, so the load ends up oscillating near balance
    assert sum(imbalance[-10:]) / 10 < 1.3


def test_language_model_keeps_the_steps_moe_stats_for_callbacks():
    import nanotrain as nt

    module = nt.LanguageModelModule(model="tiny", vocab_size=257)
    module.configure_model()
    module.model.train()
    ids = torch.randint(0, 257, (2, 8), generator=torch.Generator().manual_seed(0))
    module(ids, ids).total_loss.backward()
    expected_loads = torch.stack([m.expert_load for m in module.model.moe_layers()]).double()
    module.on_before_optimizer_step(None)
    stats = module.last_moe_stats
    assert stats.layers == [1, 2]  # decoder layer 1, then MTP module 0 after the 2 layers
    torch.testing.assert_close(stats.loads, expected_loads)
    assert stats.dropped.tolist() == [0.0, 0.0]  # dropless
    speed = module.config.bias_update_speed
    for bias, load, layer in zip(stats.biases, stats.loads, module.model.moe_layers(), strict=True):
        torch.testing.assert_close(bias, (torch.sign(load.mean() - load) * speed).float())
        torch.testing.assert_close(bias, layer.gate.e_score_correction_bias)

    dense = nt.LanguageModelModule(model="tiny-dense", vocab_size=257)
    dense.configure_model()
    dense.on_before_optimizer_step(None)
    assert dense.last_moe_stats is None


def test_expert_slices_need_ep_to_divide_the_experts():
    from nanotrain.models.moe import GroupedExperts

    experts = GroupedExperts(8, 16, 8, ep_size=4, ep_rank=3, device="meta")
    assert (experts.expert_offset, experts.num_local_experts) == (6, 2)
    assert experts.gate_proj.shape == (2, 8, 16) and experts.full_shape("down_proj") == (8, 16, 8)
    with pytest.raises(ValueError, match=r"n_routed_experts=8 over ep=3 ranks"):
        GroupedExperts(8, 16, 8, ep_size=3, ep_rank=0, device="meta")


def test_routed_expert_params_stay_tagged_through_materialization_and_casts():
    from nanotrain.models import build_model, presets
    from nanotrain.parallel.expert import is_expert_param

    model = build_model(presets.get("tiny"))  # built on meta, then to_empty + init
    tagged = {n for n, p in model.named_parameters() if is_expert_param(p)}
    assert tagged == {
        f"{prefix}.mlp.experts.{w}_proj"
        for prefix in ("layers.1", "mtp.0.block")
        for w in ("gate", "up", "down")
    }
    model.to(torch.bfloat16)
    assert {n for n, p in model.named_parameters() if is_expert_param(p)} == tagged
