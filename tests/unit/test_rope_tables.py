"""Rotary tables kept on the model's device for torch.compile (`CausalLM.keep_rope_tables`):
the compiled graph reads them instead of computing cos/sin, they follow the model between
devices and stay float32 through dtype casts, and the model computes what it did without them."""

from __future__ import annotations

import pytest
import torch

from nanotrain.models import build_model, presets
from nanotrain.models.compile import compile_model
from nanotrain.models.layers import rope_cos_sin


def _model(preset: str = "tiny-dense", device: str = "cpu"):
    # one layer: the model makes cos/sin once per forward and hands the same tables to every
    # layer (and to the MTP block), so a second layer adds nothing to check. For "tiny" it
    # is the dense first layer with MLA attention: the MoE layer (dropless) would add graph
    # breaks and ~8 s of CPU tracing without touching the rotary tables
    torch.manual_seed(0)
    return build_model(presets.get(preset, vocab_size=64, num_layers=1), device=device)


def _graph_ops(model, ids) -> set[str]:
    """The names of the ops in the graph(s) dynamo captures from one forward of `model`."""
    ops: set[str] = set()

    def backend(gm, example_inputs):
        ops.update(
            str(n.target) for n in gm.graph.nodes if n.op in ("call_function", "call_method")
        )
        return gm.forward

    torch._dynamo.reset()
    torch.compile(model, backend=backend)(ids[:, :-1], ids[:, 1:])
    torch._dynamo.reset()
    return ops


@pytest.mark.parametrize("preset", ["tiny-dense", "tiny"])
def test_compiled_graph_reads_the_kept_tables_instead_of_computing_them(preset):
    ids = torch.randint(0, 64, (2, 9))
    model = _model(preset)
    if preset == "tiny-dense":  # the check can fail: without kept tables the graph has cos
        assert any("cos" in op for op in _graph_ops(model, ids))
    model.keep_rope_tables()
    assert not any("cos" in op or "sin" in op for op in _graph_ops(model, ids))


@pytest.mark.parametrize("preset", ["tiny-dense", "tiny"])
def test_kept_tables_give_the_same_forward(preset):
    ids = torch.randint(0, 64, (2, 9))
    model = _model(preset)
    expected = model(ids[:, :-1], ids[:, 1:]).total_loss
    model.keep_rope_tables()
    assert model._rope_tables is not None
    assert torch.equal(model(ids[:, :-1], ids[:, 1:]).total_loss, expected)


def test_tables_follow_moves_and_stay_float32():
    model = _model()
    model.keep_rope_tables()
    c = model.config
    cos, sin = model._rope_tables
    assert cos.shape == (c.max_seq_len, model.rope_dim // 2)
    assert torch.equal(cos, rope_cos_sin(c.max_seq_len, model.rope_dim, c.rope_theta, None)[0])
    model.to(torch.bfloat16)  # recomputed, not cast
    assert model._rope_tables[0].dtype == torch.float32
    assert torch.equal(model._rope_tables[1], sin)
    model.to("meta")  # nowhere to keep them: computed per forward again
    assert model._rope_tables is None
    model.to_empty(device="cpu")
    assert model._rope_tables[0].device == torch.device("cpu")


def test_compile_model_keeps_the_tables_and_a_plain_model_does_not():
    model = _model()
    assert model._rope_tables is None  # eager models compute them per forward
    compile_model(model, backend="eager")
    assert model._rope_tables is not None


def test_tables_made_when_parameters_arrive_without_a_move():
    """A meta build loaded with `load_state_dict(assign=True)` never calls `_apply`: loading
    makes the tables on the parameters' device, before any (compiled) forward would trace
    around their absence."""
    ids = torch.randint(0, 64, (2, 9))
    source = _model()
    expected = source(ids[:, :-1], ids[:, 1:]).total_loss
    model = _model(device="meta")
    compile_model(model, backend="eager")
    assert model._rope_tables is None
    model.load_state_dict(source.state_dict(), assign=True)
    model.tie_weights()
    assert model._rope_tables is not None and model._rope_tables[0].device.type == "cpu"
    assert not any("cos" in op or "sin" in op for op in _graph_ops(model, ids))
    assert torch.equal(model(ids[:, :-1], ids[:, 1:]).total_loss, expected)


def test_tables_made_in_inference_mode_still_train():
    """Moving a model inside `torch.inference_mode()` (e.g. during evaluation) must not leave
    inference tensors that a later training step's backward refuses."""
    ids = torch.randint(0, 64, (2, 9))
    model = _model()
    model.keep_rope_tables()
    with torch.inference_mode():
        model.to("cpu", torch.float32)
        model(ids[:, :-1], ids[:, 1:])
    assert not model._rope_tables[0].is_inference()
    model(ids[:, :-1], ids[:, 1:]).total_loss.backward()
    assert model.embed_tokens.weight.grad is not None
