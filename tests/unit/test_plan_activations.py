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
from nanotrain.models.recompute import set_recompute
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


def measure(preset: str, precision: str, recompute: str | None) -> int:
    """Saved bytes of one training forward of `preset` (seq 64, micro batch 2) on CPU."""
    torch.manual_seed(0)
    config = presets.get(preset)
    model = build_model(config, device="cpu")
    plugin = resolve_precision(precision)
    plugin.setup_module(model, torch.device("cpu"), is_global_zero=False)
    set_recompute(model, recompute)
    model.train()
    ids = torch.randint(0, config.vocab_size, (MICRO, SEQ))
    labels = torch.randint(0, config.vocab_size, (MICRO, SEQ))
    with SavedBytes(model) as saved, plugin.forward_context():
        out = model(ids, labels)
    out.total_loss.backward()  # the graph is complete and runs
    return saved.total


def predict(preset: str, precision: str, recompute: str | None) -> ActivationEstimate:
    layout = PlanLayout(recompute=recompute)
    workload = Workload(
        seq_len=SEQ, micro_batch_size=MICRO, global_batch_size=MICRO, precision=precision
    )
    return activation_estimate(presets.get(preset), layout, workload, device="cpu")


@pytest.mark.parametrize("precision", ["32-true", "bf16-true", "bf16-mixed"])
@pytest.mark.parametrize("recompute", [None, "full", "selective"])
@pytest.mark.parametrize("preset", ["tiny", "tiny-dense"])
def test_per_microbatch_bytes_match_a_cpu_forward(preset, recompute, precision):
    measured = measure(preset, precision, recompute)
    predicted = predict(preset, precision, recompute).per_microbatch
    assert predicted == pytest.approx(measured, rel=0.10), (predicted, measured)
