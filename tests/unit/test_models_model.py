"""Whole models: output API, causality, losses, MTP targets, router-bias updates, init."""

import pytest
import torch
import torch.nn.functional as F

from nanotrain.models import DeepSeekV3, DenseTransformer, build_model, presets

V = 257


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    # tiny matmuls: on a shared 2-core machine a second intra-op thread only adds wake-ups
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module", params=["tiny", "tiny-dense"])
def model(request):
    torch.manual_seed(0)
    return build_model(presets.get(request.param))


def _batch(b=2, t=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, V, (b, t + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:].clone(), tokens  # input_ids, shifted labels, stream


def test_forward_shapes_and_losses(model):
    ids, labels, _ = _batch()
    model.eval()
    out = model(ids)
    assert out.logits.shape == (2, 12, V) and out.loss is None and out.total_loss is None
    labels[0, :3] = -100
    out = model(ids, labels=labels)
    expected = F.cross_entropy(out.logits.reshape(-1, V), labels.reshape(-1), ignore_index=-100)
    torch.testing.assert_close(out.loss, expected)
    assert out.num_tokens.item() == 2 * 12 - 3
    assert out.mtp_loss is None  # MTP is skipped in eval mode


def test_changing_a_future_token_leaves_past_logits_unchanged(model):
    ids, _, _ = _batch()
    changed = ids.clone()
    changed[:, 7] = (changed[:, 7] + 1) % V
    model.eval()
    with torch.no_grad():
        a, b = model(ids).logits, model(changed).logits
    torch.testing.assert_close(a[:, :7], b[:, :7])
    assert not torch.allclose(a[:, 7:], b[:, 7:])


def test_total_loss_combines_main_aux_and_weighted_mtp():
    torch.manual_seed(0)
    m = build_model(presets.get("tiny", aux_loss_alpha=0.01, mtp_depth=2))
    ids, labels, _ = _batch()
    out = m.train()(ids, labels=labels)
    assert out.aux_loss.item() > 0 and out.mtp_loss is not None
    expected = out.loss + out.aux_loss + m.config.mtp_loss_weight * out.mtp_loss
    torch.testing.assert_close(out.total_loss, expected)
    out.total_loss.backward()
    assert all(p.grad is not None for p in m.mtp.parameters())
    assert m.eval()(ids, labels=labels).mtp_loss is None
    assert m(ids, labels=labels, run_mtp=True).mtp_loss is not None


def test_dense_model_has_zero_aux_loss_and_no_mtp():
    m = build_model(presets.get("tiny-dense"))
    ids, labels, _ = _batch()
    out = m.train()(ids, labels=labels)
    assert out.aux_loss.item() == 0.0 and out.mtp_loss is None
    torch.testing.assert_close(out.total_loss, out.loss)
    assert m.update_router_biases().numel() == 0


def test_mtp_depth_k_predicts_token_t_plus_k_plus_1():
    # Independent recomputation on truncated sequences (DeepSeek-V3 section 2.2): depth k at
    # position i combines h^{k-1}_i with Emb(t_{i+k}) and is scored against t_{i+k+1}.
    torch.manual_seed(0)
    m = build_model(presets.get("tiny", mtp_depth=2)).train()
    ids, labels, stream = _batch(t=10)
    out = m(ids, labels=labels)
    with torch.no_grad():
        h, _ = m.run_layers(m.embed(ids))
        losses = []
        for k, module in enumerate(m.mtp, start=1):
            n = 10 - k  # positions with a target
            cos, sin = m.rope(n, h.device)
            x = module.eh_proj(
                torch.cat((module.enorm(m.embed(stream[:, k : k + n])), module.hnorm(h[:, :n])), -1)
            )
            h, _ = module.block(x, cos, sin)
            logits = m.lm_head(module.norm(h))
            losses.append(
                F.cross_entropy(logits.reshape(-1, V), stream[:, k + 1 : k + 1 + n].reshape(-1))
            )
    torch.testing.assert_close(out.mtp_loss, torch.stack(losses).mean(), rtol=1e-5, atol=1e-6)


def test_mtp_modules_share_embedding_and_head():
    m = build_model(presets.get("tiny"), device="meta")
    names = [n for n, _ in m.named_parameters()]
    assert not any(n.startswith("mtp.") and ("embed" in n or "lm_head" in n) for n in names)
    assert {"mtp.0.enorm.weight", "mtp.0.hnorm.weight", "mtp.0.eh_proj.weight"} <= set(names)
    assert m.mtp[0].eh_proj.weight.shape == (64, 128)


def test_update_router_biases_uses_loads_of_all_microbatches_then_resets():
    torch.manual_seed(0)
    m = build_model(presets.get("tiny", bias_update_speed=0.01)).train()
    ids, labels, _ = _batch()
    m(ids, labels=labels).total_loss.backward()
    m(ids[:1], labels=labels[:1]).total_loss.backward()
    calls = []

    def reduce_fn(t):
        calls.append(t.clone())
        return t

    loads = m.update_router_biases(reduce_fn)
    moe_layers = m.moe_layers()
    assert len(moe_layers) == 2  # layer 1 of the main stack + the MTP block
    # every training forward counts tokens x top-k copies per MoE layer (main: 3 x 12 tokens;
    # the MTP block sees all positions too)
    assert loads.sum(dim=1).tolist() == [3 * 12 * 2] * 2 and len(calls) == 1
    for layer, load in zip(moe_layers, loads, strict=True):
        bias = layer.gate.e_score_correction_bias
        expected = torch.sign(load.mean() - load) * 0.01
        torch.testing.assert_close(bias, expected.float())
        assert bias.grad is None and not bias.requires_grad
        assert layer.expert_load.sum().item() == 0


def test_same_seed_same_model_and_init_values():
    a = build_model(presets.get("tiny"), generator=torch.Generator().manual_seed(3))
    b = build_model(presets.get("tiny"), generator=torch.Generator().manual_seed(3))
    c = build_model(presets.get("tiny"), generator=torch.Generator().manual_seed(4))
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["embed_tokens.weight"], sc["embed_tokens.weight"])
    assert torch.all(sa["layers.0.input_layernorm.weight"] == 1)
    assert torch.all(sa["layers.1.mlp.gate.e_score_correction_bias"] == 0)
    assert sa["layers.1.mlp.experts.gate_proj"].std().item() == pytest.approx(0.02, rel=0.1)


def test_tied_embeddings_share_one_tensor():
    m = build_model(presets.get("tiny-dense", tie_word_embeddings=True))
    assert m.lm_head.weight is m.embed_tokens.weight
    assert m.lm_head.weight.std().item() == pytest.approx(0.02, rel=0.1)


def test_meta_build_and_family_classes():
    assert isinstance(build_model(presets.get("tiny"), device="meta"), DeepSeekV3)
    dense = build_model(presets.get("tiny-dense"), device="meta")
    assert isinstance(dense, DenseTransformer)
    assert all(p.is_meta for p in dense.parameters())


def test_bad_inputs_raise():
    m = build_model(presets.get("tiny-dense"), device="meta")
    with pytest.raises(ValueError, match=r"\[batch, seq\]"):
        m(torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="labels shape"):
        m(torch.zeros(1, 3, dtype=torch.long), labels=torch.zeros(1, 2, dtype=torch.long))
    with pytest.raises(TypeError, match="DenseConfig or DeepSeekConfig"):
        build_model({"hidden_size": 8})


@pytest.mark.parametrize("name", ["tiny", "tiny-dense"])
def test_sequence_parallel_on_one_process_changes_nothing(name):
    # without a tensor-parallel group there is no sequence to split: same model, same outputs
    ids, labels, _ = _batch(t=7)  # any length: nothing is divided by tp
    models = [
        build_model(presets.get(name), generator=torch.Generator().manual_seed(1), **kw).train()
        for kw in ({}, {"sequence_parallel": True})
    ]
    outs = [m(ids, labels=labels) for m in models]
    assert torch.equal(outs[0].logits, outs[1].logits)
    assert torch.equal(outs[0].total_loss, outs[1].total_loss)
    assert models[1].full_seq_len(torch.zeros(2, 7, 4)) == 7
