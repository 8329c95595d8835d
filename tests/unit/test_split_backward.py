"""A backward split into its input half (I) and weight half (W) equals the fused backward:
per layer kind (Llama-style layer: GQA attention, SwiGLU, RMSNorms; DeepSeek's dense layer:
MLA attention; DeepSeek's MoE layer: router, shared and routed experts), with activation
recomputation, and for the final norm, head and MTP on top of them; the weight half leaves
every gradient to W, and W accumulates through autograd, so post-accumulate hooks fire."""

from __future__ import annotations

import pytest
import torch

import nanotrain as nt
from nanotrain.parallel.split_backward import backward_input

VOCAB, SEQ = 257, 16


def _model(preset: str, recompute: str | None = None) -> torch.nn.Module:
    torch.manual_seed(0)
    module = nt.LanguageModelModule(preset, vocab_size=VOCAB, recompute=recompute)
    module.configure_model()
    return module.model


def _grads(params: list[torch.nn.Parameter]) -> list[torch.Tensor | None]:
    return [None if p.grad is None else p.grad.clone() for p in params]


def _fused_and_split(run, inp: torch.Tensor, params: list[torch.nn.Parameter]):
    """`run(x) -> (tensors, grads)` backpropagated fused, then split: the input gradients
    and parameter gradients of both, and how many post-accumulate hooks fired before W and
    after it."""
    x = inp.clone().requires_grad_()
    tensors, grads = run(x)
    torch.autograd.backward(tensors, grads)
    fused = (x.grad.clone(), _grads(params))
    for p in params:
        p.grad = None
    fired: list[int] = []
    hooks = [p.register_post_accumulate_grad_hook(lambda p: fired.append(1)) for p in params]
    x = inp.clone().requires_grad_()
    tensors, grads = run(x)
    dinp, weights = backward_input(tensors, grads, x, params)
    before_w = (len(fired), _grads(params))
    weights()
    for hook in hooks:
        hook.remove()
    return fused, (dinp, _grads(params)), before_w, len(fired)


def _assert_equal(fused, split, before_w, fired, params) -> None:
    (x_grad, param_grads), (dinp, split_grads) = fused, split
    assert torch.allclose(dinp, x_grad, rtol=1e-6, atol=1e-7)
    assert before_w == (0, [None] * len(params))  # the input half left every weight alone
    reached = [g for g in param_grads if g is not None]
    assert fired == len(reached) > 0
    for name_grad, got in zip(param_grads, split_grads, strict=True):
        if name_grad is None:
            assert got is None
        else:
            assert torch.allclose(got, name_grad, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize(
    ("preset", "layer", "recompute"),
    [
        ("tiny-dense", 0, None),  # GQA attention, SwiGLU, RMSNorms
        ("tiny", 0, None),  # MLA attention, dense SwiGLU
        ("tiny", 1, None),  # MLA, router, shared and routed experts
        ("tiny", 1, "full"),  # the same, recomputed in backward
        ("tiny", 1, "selective"),
    ],
    ids=["dense-layer", "mla-dense-layer", "moe-layer", "moe-layer-full", "moe-selective"],
)
def test_a_decoder_layer_split_backward_equals_the_fused_one(preset, layer, recompute):
    model = _model(preset, recompute)
    block = model.layers[layer]
    params = list(block.parameters())
    torch.manual_seed(1)
    h = torch.randn(2, SEQ, model.config.hidden_size)
    grad = torch.randn(2, SEQ, model.config.hidden_size)
    cos, sin = model.rope(SEQ, h.device)

    def layer(x):
        out, aux = block(x, cos, sin)  # aux: the MoE balance loss (a constant 0 when dense)
        if not aux.requires_grad:
            return [out], [grad]
        return [out, aux], [grad, torch.ones(())]

    _assert_equal(*_fused_and_split(layer, h, params), params)


def test_the_top_of_the_model_split_backward_equals_the_fused_one():
    # the last layer, final norm, head, cross-entropy and the MTP module with its own loss,
    # from the hidden state after layer 0 (what a second pipeline stage receives)
    model = _model("tiny")
    ids = torch.randint(0, VOCAB, (2, SEQ + 1), generator=torch.Generator().manual_seed(2))
    inputs, labels = ids[:, :-1], ids[:, 1:]
    cos, sin = model.rope(SEQ, inputs.device)
    with torch.no_grad():
        h0, _ = model.layers[0](model.embed_tokens(inputs), cos, sin)
    # MTP embeds the shifted tokens with the model's embedding: its gradient comes too
    params = [p for n, p in model.named_parameters() if not n.startswith("layers.0.")]

    def top(x):
        h, _ = model.layers[1](x, cos, sin)
        _, loss, _ = model.head_and_loss(h, labels)
        per_depth, mtp_aux = model.mtp_losses(h, inputs, labels)
        return [loss + 0.3 * per_depth.mean() + mtp_aux], [torch.ones(())]

    _assert_equal(*_fused_and_split(top, h0, params), params)


def test_a_stage_whose_input_takes_no_gradient_leaves_everything_to_w():
    model = _model("tiny-dense")
    params = list(model.parameters())
    ids = torch.randint(0, VOCAB, (2, SEQ + 1), generator=torch.Generator().manual_seed(3))
    loss = model(ids[:, :-1], ids[:, 1:])
    loss = loss if isinstance(loss, torch.Tensor) else loss.loss
    dinp, weights = backward_input([loss], [torch.ones(())], None, params)
    assert dinp is None and all(p.grad is None for p in params)
    weights()
    assert all(p.grad is not None for p in params)


def test_a_recomputed_moe_layer_counts_its_tokens_once_over_both_halves():
    # the weight half may rerun the checkpointed forward: the expert load must not count twice
    model = _model("tiny", "full")
    block = model.layers[1]
    h = torch.randn(2, SEQ, model.config.hidden_size, requires_grad=True)
    cos, sin = model.rope(SEQ, h.device)
    before = block.mlp.expert_load.sum().item()
    out, aux = block(h, cos, sin)
    grads = [torch.ones_like(out), torch.ones(())]
    _, weights = backward_input([out, aux], grads, h, list(block.parameters()))
    weights()
    assert block.mlp.expert_load.sum().item() - before == 2 * SEQ * model.config.num_experts_per_tok
