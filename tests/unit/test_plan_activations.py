"""The activation planner against measurement: the bytes a real CPU forward saves for backward.

Measured = the distinct storages handed to `torch.autograd.graph.saved_tensors_hooks` during
one training forward (deduplicated by storage pointer), parameters excluded (they are not
activations). Predicted = `activation_estimate(...).per_microbatch` for pp = 1 (one chunk
holding the embedding, every layer, the head, the loss and MTP).
"""

from __future__ import annotations

import pytest
import torch

from nanotrain.models import presets
from nanotrain.models.build import build_model
from nanotrain.models.expert_compute import set_fp8_expert_activations
from nanotrain.models.transformer import set_recompute
from nanotrain.planning.activations import ActivationEstimate, activation_estimate
from nanotrain.planning.layout import PlanLayout, Workload
from nanotrain.precision import resolve_precision

SEQ, MICRO = 64, 2


class SavedBytes:
    """Context that sums the bytes of distinct non-parameter storages saved for backward."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.seen: dict[int, int] = {}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in self.params:
            self.seen.setdefault(ptr, storage.nbytes())
        return t

    @property
    def total(self) -> int:
        return sum(self.seen.values())

    def __enter__(self) -> SavedBytes:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._hooks.__exit__(*exc)


def measure(
    preset: str,
    precision: str,
    recompute: str | None,
    full_layers: int = 0,
    *,
    fp8: bool = False,
    micro: int = MICRO,
    **overrides,
) -> int:
    """Saved bytes of one training forward of `preset` (seq 64, `micro` sequences) on CPU;
    `fp8`: the routed experts' saves in fp8."""
    torch.manual_seed(0)
    config = presets.get(preset, **overrides)
    model = build_model(config, device="cpu")
    plugin = resolve_precision(precision)
    plugin.setup_module(model, torch.device("cpu"), is_global_zero=False)
    set_recompute(model, recompute, full_layers)
    set_fp8_expert_activations(model, fp8)
    model.train()
    ids = torch.randint(0, config.vocab_size, (micro, SEQ))
    labels = torch.randint(0, config.vocab_size, (micro, SEQ))
    with SavedBytes(model) as saved, plugin.forward_context():
        out = model(ids, labels)
    out.total_loss.backward()  # the graph is complete and runs
    return saved.total


def predict(
    preset: str,
    precision: str,
    recompute: str | None,
    full_layers: int = 0,
    *,
    fp8: bool = False,
    micro: int = MICRO,
    **overrides,
) -> ActivationEstimate:
    layout = PlanLayout(
        recompute=recompute, recompute_full_layers=full_layers, fp8_expert_activations=fp8
    )
    workload = Workload(
        seq_len=SEQ, micro_batch_size=micro, global_batch_size=micro, precision=precision
    )
    return activation_estimate(presets.get(preset, **overrides), layout, workload, device="cpu")


@pytest.mark.parametrize("precision", ["32-true", "bf16-true", "bf16-mixed"])
@pytest.mark.parametrize("recompute", [None, "full", "selective", "light"])
@pytest.mark.parametrize("preset", ["tiny", "tiny-dense"])
def test_per_microbatch_bytes_match_a_cpu_forward(preset, recompute, precision):
    measured = measure(preset, precision, recompute)
    predicted = predict(preset, precision, recompute).per_microbatch
    # byte-exact on torch 2.13; the small slack only spares a future torch that saves one more
    # small tensor, while a change to what our layers save (a few KiB per layer) still fails
    assert predicted == pytest.approx(measured, rel=0.002), (predicted, measured)


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
@pytest.mark.parametrize("overrides", [{"v_head_dim": 24}, {"q_lora_rank": None}], ids=str)
def test_light_recompute_bytes_on_the_other_mla_paths(overrides, precision):
    # equal head widths run SDPA's fused CPU kernel (the rebuilt q, k, v are not kept at all);
    # without a q latent, q_proj's output enters the up-projections' checkpoint
    measured = measure("tiny", precision, "light", **overrides)
    predicted = predict("tiny", precision, "light", **overrides).per_microbatch
    assert predicted == pytest.approx(measured, rel=0.002), (predicted, measured)


@pytest.mark.parametrize("recompute", [None, "light"])
def test_the_first_layers_recomputed_fully_beside_another_mode(recompute):
    # tiny's dense layer 0 recomputes fully, its MoE layer 1 and the MTP block take the mode
    measured = measure("tiny", "bf16-mixed", recompute, full_layers=1)
    predicted = predict("tiny", "bf16-mixed", recompute, full_layers=1).per_microbatch
    assert predicted == pytest.approx(measured, rel=0.002), (predicted, measured)
    assert measured < measure("tiny", "bf16-mixed", recompute)


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
@pytest.mark.parametrize("recompute", [None, "light"])
def test_one_sequence_per_microbatch_matches_a_cpu_forward(recompute, precision):
    # with fp32 activations and b = 1 the CPU attention path reshapes q, k, v by views: v is
    # kv_b's whole output, and under light recomputation all three are rebuilt tensors' views
    measured = measure("tiny", precision, recompute, micro=1)
    predicted = predict("tiny", precision, recompute, micro=1).per_microbatch
    assert predicted == pytest.approx(measured, rel=0.002), (predicted, measured)


@pytest.mark.parametrize("precision", ["32-true", "bf16-true", "bf16-mixed"])
@pytest.mark.parametrize("recompute", [None, "light", "full"])
def test_fp8_expert_saves_match_a_cpu_forward(recompute, precision):
    measured = measure("tiny", precision, recompute, fp8=True)
    predicted = predict("tiny", precision, recompute, fp8=True)
    assert predicted.per_microbatch == pytest.approx(measured, rel=0.002), (predicted, measured)
    plain = measure("tiny", precision, recompute)
    if recompute == "full":  # a checkpointed layer keeps nothing of its experts anyway
        assert measured == plain
    else:
        assert measured < plain
        assert predicted.transient > predict("tiny", precision, recompute).transient


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
@pytest.mark.parametrize("capacity", [1.0, 1.25, 2.0])
def test_capacity_slots_match_a_cpu_forward(capacity, precision):
    # E x B x C slots, not T x K copies: C = ceil(f S K / E) = 16, 20 and 32 per sequence
    # at f = 1, 1.25 and 2 (S = 64, K = 2, E = 8)
    measured = measure("tiny", precision, None, capacity_factor=capacity)
    predicted = predict("tiny", precision, None, capacity_factor=capacity).per_microbatch
    assert predicted == pytest.approx(measured, rel=0.002), (predicted, measured)


def test_detail_adds_up_and_full_recompute_reports_its_transient():
    plain = predict("tiny", "32-true", None)
    full = predict("tiny", "32-true", "full")
    assert sum(plain.detail.values()) == plain.per_microbatch
    assert plain.transient == 0 and plain.peak == plain.saved_peak
    # one layer rebuilt during its backward: at most a MoE layer's worth, on top of the inputs
    assert 0 < full.transient < plain.per_microbatch - full.per_microbatch
    assert full.peak == full.saved_peak + full.transient


def test_interleaved_peak_walks_the_schedule_with_unequal_chunks():
    config = presets.get("tiny", num_layers=4)
    layout = PlanLayout(pp=2, virtual_pp=2, pipeline_layout=(0, 2, 1, 1))
    workload = Workload(SEQ, MICRO, 8 * MICRO, precision="32-true")
    est = activation_estimate(config, layout, workload, pp_rank=0)
    first, last = est.per_microbatch_chunk  # embedding only; layer 3 + head + MTP
    assert first < last
    # the worst moment holds fewer than in_flight copies of the largest chunk
    assert est.saved_peak < est.in_flight * last


def test_bad_pp_rank_is_refused():
    layout = PlanLayout(pp=2)
    workload = Workload(SEQ, MICRO, 4 * MICRO)
    with pytest.raises(ValueError, match="pp_rank=2 is outside"):
        activation_estimate(presets.get("tiny", num_layers=4), layout, workload, pp_rank=2)


def test_an_estimate_for_the_671b_model_takes_well_under_a_tenth_of_a_second():
    import time

    config = presets.get("deepseek-v3-671b")
    workload = Workload(4096, 1, 1024, precision="bf16-mixed")

    def split(pp: int) -> tuple[int, ...]:  # 61 layers over pp stages, the first ones larger
        return tuple(61 // pp + (i < 61 % pp) for i in range(pp))

    layouts = [
        PlanLayout(
            tp=tp,
            pp=pp,
            dp=64,
            ep=ep,
            sequence_parallel=True,
            recompute=rc,
            pipeline_layout=split(pp),
        )
        for tp in (1, 2, 4, 8)
        for pp in (4, 8, 16)
        for ep in (8, 64)
        for rc in (None, "selective", "full")
    ]
    start = time.perf_counter()
    for layout in layouts:
        est = activation_estimate(config, layout, workload, pp_rank=layout.pp - 1)
        assert est.peak > 0
    assert (time.perf_counter() - start) / len(layouts) < 0.1
