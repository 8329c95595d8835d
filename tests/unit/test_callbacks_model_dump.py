"""ModelDump: the summary at fit start and the statistics files at chosen steps."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from torch import nn
from torch.utils.data import TensorDataset

import nanotrain as nt
from nanotrain.callbacks.model_dump import ModelDump, model_summary, tensor_stats
from nanotrain.testing import Classifier, blobs


def expected_stats(tensor: torch.Tensor) -> dict:
    """The statistics, computed with NumPy in float64."""
    a = tensor.detach().double().numpy()
    return {
        "mean": a.mean(),
        "std": a.std(),
        "absmax": np.abs(a).max(),
        "zero_fraction": (a == 0).mean(),
        "norm": np.sqrt((a * a).sum()),
    }


def assert_stats(recorded: dict, tensor: torch.Tensor) -> None:
    assert recorded["shape"] == list(tensor.shape)
    assert recorded["numel"] == tensor.numel()
    for key, value in expected_stats(tensor).items():
        assert recorded[key] == pytest.approx(value, rel=1e-5, abs=1e-7), key


class Capture(nt.Callback):
    """Keeps copies of the batch, weights and gradients of one step, seen right after
    ModelDump (registered before it) in the same hooks."""

    def __init__(self, step: int) -> None:
        self.step = step
        self.batch = None
        self.weights: dict[str, torch.Tensor] = {}
        self.grads: dict[str, torch.Tensor] = {}

    def on_train_step_start(self, trainer, module, batch, batch_idx):
        if trainer.global_step + 1 == self.step:
            self.batch = batch

    def on_before_optimizer_step(self, trainer, module, optimizer):
        if trainer.global_step + 1 == self.step:
            for name, p in module.named_parameters():
                self.weights[name] = p.detach().clone()
                self.grads[name] = p.grad.detach().clone()


def test_dump_files_exist_at_chosen_steps_and_match_the_tensors(tmp_path):
    x, y = blobs(64)
    dump, capture = ModelDump(steps=[2], save_tensors=True), Capture(step=2)
    trainer = nt.Trainer(
        strategy=nt.SingleDeviceStrategy("cpu"),
        default_root_dir=str(tmp_path),
        max_steps=3,
        micro_batch_size=4,
        global_batch_size=8,
        loggers=["jsonl"],
        callbacks=[dump, capture],
    )
    module = Classifier()
    trainer.fit(module, train_dataloaders=TensorDataset(x, y))
    dumps = trainer.run_dir / "dumps"
    assert sorted(p.name for p in dumps.iterdir()) == ["step_2"]
    out = dumps / "step_2"

    weights = json.loads((out / "weights.json").read_text())
    grads = json.loads((out / "grads.json").read_text())
    assert weights["step"] == grads["step"] == 2
    for name in capture.weights:
        assert_stats(weights["tensors"][name], capture.weights[name])
        assert_stats(grads["tensors"][name], capture.grads[name])

    # activations over both microbatches of step 2, recomputed with the weights of that step
    acts = json.loads((out / "activations.rank0.json").read_text())["modules"]
    net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))
    net.load_state_dict({k.removeprefix("net."): v for k, v in capture.weights.items()})
    inputs = torch.cat([mb[0] for mb in capture.batch])  # [8, 8]
    with torch.no_grad():
        hidden = net[0](inputs)
        assert_stats({**acts["net.0"], "shape": [8, 16]}, hidden)
        assert_stats({**acts["net.1"], "shape": [8, 16]}, torch.tanh(hidden))
        assert_stats({**acts["net"], "shape": [8, 3]}, net(inputs))
    assert acts["net.0"]["shape"] == [4, 16]  # shape of one microbatch's output

    tensors = load_file(str(out / "tensors.safetensors"))
    torch.testing.assert_close(tensors["grad/net.2.weight"], capture.grads["net.2.weight"])
    first_mb = load_file(str(out / "activations.rank0.safetensors"))
    torch.testing.assert_close(first_mb["net.2"], net(capture.batch[0][0]).detach())
    # the hooks are gone after the dump step
    assert all(not m._forward_hooks for m in module.modules())


def test_summary_counts_parameters_of_the_built_model(tmp_path):
    trainer = nt.Trainer(
        strategy=nt.SingleDeviceStrategy("cpu"),
        default_root_dir=str(tmp_path),
        max_steps=1,
        micro_batch_size=8,
        loggers=["jsonl"],
        callbacks=[ModelDump()],
    )
    trainer.fit(Classifier(hidden=16), train_dataloaders=TensorDataset(*blobs(16)))
    summary = json.loads((trainer.run_dir / "model_summary.json").read_text())
    # Linear(8, 16) + Linear(16, 3), weights and biases
    assert summary["total_parameters"] == 8 * 16 + 16 + 16 * 3 + 3
    assert summary["active_parameters"] == summary["total_parameters"]
    assert summary["flops_per_token"] is None
    assert [m["name"] for m in summary["modules"]] == ["net.0", "net.2"]
    assert "total parameters:     195" in (trainer.run_dir / "model_summary.txt").read_text()


def test_summary_separates_frozen_parameters():
    model = nn.Sequential(nn.Linear(4, 5), nn.Linear(5, 2))
    model[0].requires_grad_(False)
    summary = model_summary(model)
    assert summary["frozen_parameters"] == 4 * 5 + 5
    assert summary["trainable_parameters"] == 5 * 2 + 2
    assert summary["parameters"][0] == {
        "name": "0.weight",
        "shape": [5, 4],
        "dtype": "float32",
        "trainable": False,
    }


def test_tensor_stats_of_a_known_tensor():
    stats = tensor_stats(torch.tensor([[0.0, 3.0], [-4.0, 0.0]]))
    assert stats["mean"] == pytest.approx(-0.25)
    assert stats["absmax"] == 4.0 and stats["zero_fraction"] == 0.5 and stats["norm"] == 5.0
    assert stats["std"] == pytest.approx(np.std([0.0, 3.0, -4.0, 0.0]))


def test_dump_steps_must_be_step_numbers():
    with pytest.raises(ValueError, match=">= 1"):
        ModelDump(steps=[0])
