"""CUDA graphs under the Trainer (`compile_model={"mode": "reduce-overhead"}`): refused at fit
start where a strategy cannot replay graphs; on a GPU, the same losses as compiling without
graphs (that test skips without CUDA)."""

from __future__ import annotations

import pytest
import torch

import nanotrain as nt
from nanotrain.models.compile import uses_cuda_graphs
from tests.precision_helpers import fit


def test_which_compile_options_mean_cuda_graphs():
    assert uses_cuda_graphs({"mode": "reduce-overhead"})
    assert uses_cuda_graphs(False, {"mode": "max-autotune"})
    assert uses_cuda_graphs({"options": {"triton.cudagraphs": True}})
    assert not uses_cuda_graphs(True, {"mode": "max-autotune-no-cudagraphs"}, False)


def test_cuda_graphs_on_the_cpu_are_refused_at_fit_start(tmp_path):
    steps = []

    class Steps(nt.Callback):
        def on_train_step_start(self, *args):
            steps.append(1)

    module = nt.LanguageModelModule("tiny-dense", compile_model={"mode": "reduce-overhead"})
    with pytest.raises(
        ValueError, match="CUDA graphs need a CUDA device, but this run trains on cpu"
    ):
        # the CPU named: "single" would pick the GPU on a machine that has one
        cpu = nt.SingleDeviceStrategy("cpu")
        fit("32-true", strategy=cpu, root=str(tmp_path), module=module, callbacks=[Steps()])
    assert steps == []  # before any step


@pytest.mark.parametrize(
    "strategy, match",
    [
        (nt.DDPStrategy(), "not supported under DDPStrategy"),
        (nt.SingleDeviceStrategy("cpu"), "need a CUDA device"),
    ],
)
def test_strategies_say_why_they_cannot_replay_graphs(strategy, match):
    assert match in strategy.cuda_graphs_refusal()


def test_several_processes_are_refused(monkeypatch):
    strategy = nt.MegatronStrategy()
    monkeypatch.setattr(type(strategy), "root_device", property(lambda s: torch.device("cuda")))
    monkeypatch.setattr(type(strategy), "world_size", property(lambda s: 2))
    assert "run on one GPU, but this run has 2 processes" in strategy.cuda_graphs_refusal()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_graphs_train_as_compiling_without_them(tmp_path, monkeypatch):
    marks = []
    real_mark = torch.compiler.cudagraph_mark_step_begin
    monkeypatch.setattr(
        torch.compiler, "cudagraph_mark_step_begin", lambda: (marks.append(1), real_mark())[1]
    )
    losses = {}
    for name, option in (("graphs", {"mode": "reduce-overhead"}), ("plain", True)):
        module = nt.LanguageModelModule("tiny", compile_model=option, lr=1e-2, warmup_steps=2)
        _, rec = fit(
            "bf16-mixed", strategy=nt.SingleDeviceStrategy("cuda"), steps=6,
            root=str(tmp_path / name), module=module, preset="tiny",
        )  # fmt: skip
        losses[name] = rec.losses
    assert len(marks) >= 6 * 2  # a new graph step per microbatch (global 4 / micro 2)
    assert losses["graphs"] == pytest.approx(losses["plain"], rel=1e-3)
