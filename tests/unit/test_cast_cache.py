"""One low-precision copy of each weight per training step under autocast: the precision
plugin's `step_context` and `nanotrain.models.cast_cache`."""

from __future__ import annotations

import contextlib

import torch

from nanotrain.models import presets
from nanotrain.models.build import build_model
from nanotrain.models.cast_cache import cached_cast, step_cast_cache
from nanotrain.planning.activations import activation_estimate
from nanotrain.planning.layout import PlanLayout, Workload
from nanotrain.precision import resolve_precision
from tests.unit.test_plan_activations import MICRO, SEQ, SavedBytes


def test_a_weight_is_cast_once_per_step_and_again_when_it_changes():
    w = torch.nn.Parameter(torch.randn(4, 4))
    outside = cached_cast(w, torch.bfloat16)
    assert outside is not cached_cast(w, torch.bfloat16)  # no cache outside a step
    with step_cast_cache():
        first = cached_cast(w, torch.bfloat16)
        assert cached_cast(w, torch.bfloat16) is first
        with torch.no_grad():
            assert cached_cast(w, torch.bfloat16) is not first  # no gradient path: not cached
            w.add_(1.0)  # an in-place update bumps the version
        assert not torch.equal(cached_cast(w, torch.bfloat16), first)
        plain = torch.randn(4, 4)  # not a weight: never cached
        assert cached_cast(plain, torch.bfloat16) is not cached_cast(plain, torch.bfloat16)
    assert cached_cast(w, torch.bfloat16) is not cached_cast(w, torch.bfloat16)


def _two_microbatches(step_wide: bool) -> tuple[list[int], list[torch.Tensor]]:
    """Saved bytes after each of two bf16-mixed forwards of the tiny MoE model, and the
    grads after both backwards."""
    torch.manual_seed(0)
    config = presets.get("tiny")
    model = build_model(config, device="cpu").train()
    plugin = resolve_precision("bf16-mixed")
    plugin.setup_module(model, torch.device("cpu"), is_global_zero=False)
    ids = torch.randint(0, config.vocab_size, (2, MICRO, SEQ))
    totals, losses = [], []
    step = plugin.step_context() if step_wide else contextlib.nullcontext()
    with step, SavedBytes(model) as saved:
        for i in range(2):
            with plugin.forward_context():
                losses.append(model(ids[i], ids[i].roll(-1, 1)).total_loss)
            totals.append(saved.total)
        for loss in losses:
            loss.backward()
    return totals, [p.grad.clone() for p in model.parameters() if p.grad is not None]


def test_the_microbatches_of_a_step_share_the_weight_copies_and_the_gradients_are_unchanged():
    (first, both), grads = _two_microbatches(step_wide=True)
    (first_apart, both_apart), grads_apart = _two_microbatches(step_wide=False)
    assert first == first_apart
    layout, work = PlanLayout(), Workload(SEQ, MICRO, MICRO, "bf16-mixed")
    copies = activation_estimate(presets.get("tiny"), layout, work, device="cpu").detail
    # the second microbatch saves no weight copy of its own (dense layers and experts alike)
    assert (both_apart - first_apart) - (both - first) == copies["weight_copies"]
    assert all(torch.equal(a, b) for a, b in zip(grads, grads_apart, strict=True))


def test_a_recomputed_region_keeps_no_weight_copy_for_the_step():
    from nanotrain.models import cast_cache
    from nanotrain.models.transformer import set_recompute

    config = presets.get("tiny")
    plugin = resolve_precision("bf16-mixed")
    held = {}
    for recompute in (None, "full"):
        torch.manual_seed(0)
        model = build_model(config, device="cpu").train()
        plugin.setup_module(model, torch.device("cpu"), is_global_zero=False)
        set_recompute(model, recompute)
        ids = torch.randint(0, config.vocab_size, (MICRO, SEQ))
        with plugin.step_context():
            with plugin.forward_context():
                loss = model(ids, ids.roll(-1, 1)).total_loss
            # the experts' weight stacks cast by hand, held for the step (autocast's own
            # cache follows the same switch, but is not visible from Python)
            held[recompute] = len(cast_cache._local.cache)
            loss.backward()
    moe_layers = sum(config.is_moe_layer(i) for i in range(config.num_layers)) + config.mtp_depth
    assert held[None] == 3 * moe_layers  # gate, up and down stacks of every MoE layer
    assert held["full"] == 0
