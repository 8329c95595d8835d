"""Activation recomputation: same values and grads, fewer saved activations, no repeated side
effects."""

from __future__ import annotations

import pytest
import torch
from torch.autograd.graph import saved_tensors_hooks

import nanotrain as nt
from nanotrain.models import build_model, presets
from nanotrain.models.transformer import set_recompute


def _step(mode, kind="tiny"):
    torch.manual_seed(0)
    model = build_model(presets.get(kind, vocab_size=101))
    model.train()
    set_recompute(model, mode)
    ids = torch.randint(0, 101, (2, 17), generator=torch.Generator().manual_seed(1))
    saved = []

    def pack(t):
        saved.append(t.numel() * t.element_size())
        return t

    with saved_tensors_hooks(pack, lambda t: t):
        out = model(ids[:, :-1], ids[:, 1:])
    out.total_loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    loads = [m.expert_load.clone() for m in model.modules() if hasattr(m, "expert_load")]
    return out.total_loss.detach(), grads, loads, sum(saved)


@pytest.mark.parametrize("mode", ["full", "selective", "light"])
@pytest.mark.parametrize("kind", ["tiny", "tiny-dense"])
def test_same_loss_and_grads_less_saved_and_loads_counted_once(mode, kind):
    loss, grads, loads, saved = _step(None, kind)
    loss_r, grads_r, loads_r, saved_r = _step(mode, kind)
    torch.testing.assert_close(loss_r, loss, rtol=0, atol=0)
    assert grads_r.keys() == grads.keys()
    for name, g in grads.items():
        torch.testing.assert_close(grads_r[name], g, rtol=1e-6, atol=1e-7, msg=name)
    for a, b in zip(loads_r, loads, strict=True):  # recompute must not count tokens twice
        assert torch.equal(a, b)
    assert saved_r < saved  # fewer bytes kept for backward during forward


def test_full_keeps_less_than_selective():
    *_, none = _step(None)
    *_, selective = _step("selective")
    *_, full = _step("full")
    assert full < selective < none


# model overrides that take other paths: q_proj without a q latent, equal q/k and v head
# widths (SDPA's fused CPU kernel instead of the math one), a capacity factor (slots)
LIGHT_CASES = {
    "tiny": ("tiny", {}),
    "no q latent": ("tiny", {"q_lora_rank": None}),
    "fused attention kernel": ("tiny", {"v_head_dim": 24}),
    "capacity": ("tiny", {"capacity_factor": 1.25}),
    "dense": ("tiny-dense", {}),
}


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed", "bf16-true", "fp8-emulated"])
@pytest.mark.parametrize("case", list(LIGHT_CASES))
def test_light_recompute_gives_the_plain_step_bitwise(case, precision):
    # "light" reruns the same ops on the same inputs: every loss and gradient is bitwise the
    # one without recomputation, under each precision's casts
    preset, overrides = LIGHT_CASES[case]
    _assert_bitwise_equal_steps(
        presets.get(preset, vocab_size=101, **overrides), precision, "light"
    )


def _assert_bitwise_equal_steps(config, precision, mode, full_layers=0):
    """One training forward and backward of `config` without recomputation and with `mode`
    (and `full_layers`): the same loss and gradients, bit for bit."""
    from nanotrain.precision import resolve_precision

    ids = torch.randint(0, 101, (2, 33), generator=torch.Generator().manual_seed(1))
    results = []
    for recompute, full in ((None, 0), (mode, full_layers)):
        torch.manual_seed(0)
        model = build_model(config)
        plugin = resolve_precision(precision)
        plugin.setup_module(model, torch.device("cpu"), is_global_zero=False)
        set_recompute(model, recompute, full_layers=full)
        model.train()
        with plugin.forward_context():
            out = model(ids[:, :-1], ids[:, 1:])
        out.total_loss.backward()
        results.append((out.total_loss.detach(), [p.grad for p in model.parameters()]))
    (loss, grads), (loss_other, grads_other) = results
    assert torch.equal(loss, loss_other)
    for g, g_other in zip(grads, grads_other, strict=True):
        assert (g is None and g_other is None) or torch.equal(g, g_other)


def test_full_layers_recompute_the_first_layers_of_each_chunk_fully():
    from nanotrain.models.stages import PipelineStage

    model = build_model(presets.get("tiny", vocab_size=101, num_layers=4))
    set_recompute(model, "light", full_layers=1)
    assert [layer.recompute for layer in model.layers] == ["full", "light", "light", "light"]
    assert [m.block.recompute for m in model.mtp] == ["light"]  # MTP blocks take the mode
    assert not model.recompute_head
    # a pipeline rank: the first layer of each of its chunks
    stage = PipelineStage(model, [[0, 1], [2, 3]], pp_size=2, pp_rank=0)  # two chunks
    set_recompute(stage, None, full_layers=1)
    modes = [[stage.layers[str(i)].recompute for i in chunk] for chunk in stage.chunks]
    assert all(chunk[0] == "full" and set(chunk[1:]) <= {None} for chunk in modes), modes
    with pytest.raises(ValueError, match="with recompute='full' every layer does already"):
        nt.LanguageModelModule("tiny", recompute="full", recompute_full_layers=1)
    with pytest.raises(ValueError, match="recompute_full_layers must be an int >= 0"):
        nt.LanguageModelModule("tiny", recompute="light", recompute_full_layers=-1)


def test_full_layers_beside_light_give_the_plain_step_bitwise():
    config = presets.get("tiny", vocab_size=101, num_layers=3)
    _assert_bitwise_equal_steps(config, "32-true", "light", full_layers=1)


def test_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="recompute must be one of"):
        nt.LanguageModelModule("tiny", recompute="some")


def _vocab_sized_saved(kind: str, mode: str | None) -> list[tuple[int, ...]]:
    """Shapes of the tensors with a vocabulary-sized dim saved by one training forward."""
    torch.manual_seed(0)
    config = presets.get(kind)
    model = build_model(config).train()
    set_recompute(model, mode)
    ids = torch.randint(0, config.vocab_size, (2, 17), generator=torch.Generator().manual_seed(1))
    shapes = []

    def pack(t):
        if config.vocab_size in t.shape and not isinstance(t, torch.nn.Parameter):
            shapes.append(tuple(t.shape))
        return t

    with saved_tensors_hooks(pack, lambda t: t):
        out = model(ids[:, :-1], ids[:, 1:])
    assert out.logits.shape[-1] == config.vocab_size  # the logits are still returned
    out.total_loss.backward()
    return shapes


@pytest.mark.parametrize("kind", ["tiny", "tiny-dense"])
def test_full_recompute_keeps_no_logits_or_log_probs_of_the_head_or_mtp(kind):
    assert _vocab_sized_saved(kind, None)  # without recompute the head's [N, V] are kept
    assert _vocab_sized_saved(kind, "full") == []


def test_a_rerun_on_another_thread_leaves_this_threads_forward_counting():
    # the pipeline executor's paired chunks: one thread's backward reruns a checkpointed
    # forward while another thread runs a forward whose side effects must count
    import threading

    from nanotrain.models.recompute import is_recomputing, recomputed

    inside, release, seen = threading.Event(), threading.Event(), {}

    def region(x):
        if is_recomputing():
            seen["rerun"] = True
            inside.set()
            release.wait(10)
        return x * x  # saves x: backward needs the rerun

    x = torch.ones(3, requires_grad=True)
    y = recomputed(region, x).sum()
    worker = threading.Thread(target=y.backward)
    worker.start()
    assert inside.wait(10)
    seen["here"] = is_recomputing()  # this thread is not rerunning anything
    release.set()
    worker.join(10)
    assert seen == {"rerun": True, "here": False}
    assert torch.equal(x.grad, torch.full((3,), 2.0))
