"""`nanotrain env`: the report on this machine, and each warning with its condition faked."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest
import torch

from nanotrain.cli import env_report, main
from nanotrain.cli.env_report import collect_environment, format_environment


def test_env_json_on_this_machine_reports_no_gpu_gloo_and_threads(capsys, monkeypatch):
    # in-process through the command's entry point: `python -m nanotrain` is the same entry
    # (every subprocess test goes through it), a fresh interpreter would only repeat the imports
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # what OMP_NUM_THREADS=1 gives a fresh process
    try:
        assert main(["env", "--json"]) == 0
    finally:
        torch.set_num_threads(threads)
    env = json.loads(capsys.readouterr().out)
    assert env["gpus"] == [] and env["cuda"] == {"available": False, "device_count": 0}
    assert env["gloo"] == {"available": True}
    assert env["defaults"] == {
        "strategy": "SingleDeviceStrategy",
        "strategy_under_torchrun": "DDPStrategy",
        "device": "cpu",
        "backend": "gloo",
    }
    assert env["cpu"]["torch_threads"] == 1 and env["cpu"]["OMP_NUM_THREADS"] == "1"
    assert env["cpu"]["usable_cores"] == len(os.sched_getaffinity(0))
    assert env["torch"]["version"] == torch.__version__
    assert env["ranks_per_machine"] == 1 and env["warnings"] == []


def test_env_text_names_every_part(capsys):
    assert main(["env"]) == 0
    text = capsys.readouterr().out
    for part in ("torch ", "CUDA available", "NCCL", "gloo", "Transformer Engine", "CPU ",
                 "default strategy", "default backend      gloo", "GPUs                 none"):  # fmt: skip
        assert part in text, part


def fake_cores_and_threads(monkeypatch, cores: int, threads: int) -> None:
    monkeypatch.setattr(env_report, "_usable_cores", lambda: cores)
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)


def test_thread_oversubscription_warns_with_the_fix(monkeypatch):
    fake_cores_and_threads(monkeypatch, cores=2, threads=2)
    warnings = collect_environment(ranks_per_machine=4)["warnings"]
    assert len(warnings) == 1
    assert "4 ranks per machine x 2 intra-op threads = 8 threads on 2 usable cores" in warnings[0]
    assert "OMP_NUM_THREADS=1" in warnings[0]
    assert collect_environment(ranks_per_machine=1)["warnings"] == []  # one rank: fine
    fake_cores_and_threads(monkeypatch, cores=16, threads=4)
    assert collect_environment(ranks_per_machine=4)["warnings"] == []  # 16 threads, 16 cores
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")  # torchrun's count is the default
    assert "8 ranks per machine" in collect_environment()["warnings"][0]


def test_bad_ranks_per_machine_raises():
    with pytest.raises(ValueError, match="ranks_per_machine must be >= 1"):
        collect_environment(ranks_per_machine=0)


def test_cuda_build_without_gpu_warns(monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", "12.6")
    env = collect_environment(ranks_per_machine=1)
    assert env["torch"]["cuda_build"] == "12.6"
    assert [w for w in env["warnings"] if "CUDA 12.6 build but no GPU is visible" in w]
    assert "nvidia-smi" in format_environment(env)


def fake_te(monkeypatch, outcome) -> None:
    def import_module(name):
        assert name == "transformer_engine"
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    monkeypatch.setattr(env_report, "_import_module", import_module)


def test_empty_transformer_engine_meta_package_is_reported_and_warned(monkeypatch):
    # the real empty meta package raises RuntimeError, not ImportError, on import
    fake_te(monkeypatch, RuntimeError("no transformer_engine_torch"))
    env = collect_environment(ranks_per_machine=1)
    assert env["transformer_engine"]["status"] == "empty meta package"
    assert any("transformer_engine[pytorch]" in w for w in env["warnings"])


def test_transformer_engine_without_a_gpu_warns(monkeypatch):
    fake_te(monkeypatch, SimpleNamespace(__version__="2.4.0"))
    env = collect_environment(ranks_per_machine=1)
    assert env["transformer_engine"] == {"status": "importable", "version": "2.4.0", "error": None}
    assert any("Transformer Engine is importable but no CUDA GPU" in w for w in env["warnings"])


def fake_gpu(monkeypatch, name: str, memory_gib: int, capability: tuple[int, int]) -> None:
    props = SimpleNamespace(
        total_memory=memory_gib * 2**30, major=capability[0], minor=capability[1]
    )
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: name)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i=0: props)


def test_gpu_memory_and_mfu_peak_come_from_the_peak_table(monkeypatch):
    fake_gpu(monkeypatch, "NVIDIA H100 80GB HBM3", 80, (9, 0))
    fake_te(monkeypatch, SimpleNamespace(__version__="2.4.0"))
    env = collect_environment(ranks_per_machine=1)
    (gpu,) = env["gpus"]
    assert gpu["name"] == "NVIDIA H100 80GB HBM3" and gpu["memory_gib"] == 80
    assert gpu["peak_tflops"]["bf16"] == pytest.approx(989.4)  # H100 SXM dense bf16
    assert gpu["peak_tflops"]["fp8"] == pytest.approx(1978.9)
    assert env["defaults"]["backend"] == "nccl" and env["defaults"]["device"] == "cuda:0"
    assert env["warnings"] == []  # TE on a Hopper GPU is what it is for
    assert "peak TFLOP/s for MFU: fp8 1978.9, bf16 989.4" in format_environment(env)


def test_transformer_engine_on_a_gpu_without_fp8_warns(monkeypatch):
    fake_gpu(monkeypatch, "NVIDIA A100-SXM4-80GB", 80, (8, 0))
    fake_te(monkeypatch, SimpleNamespace(__version__="2.4.0"))
    env = collect_environment(ranks_per_machine=1)
    assert env["gpus"][0]["peak_tflops"]["fp8"] is None
    assert env["gpus"][0]["peak_tflops"]["bf16"] == pytest.approx(312.0)
    (warning,) = env["warnings"]
    assert "no GPU here supports its fp8 (NVIDIA A100-SXM4-80GB)" in warning


def test_unknown_gpu_is_listed_without_a_peak(monkeypatch):
    fake_gpu(monkeypatch, "Mystery Accelerator 9000", 24, (8, 6))
    env = collect_environment(ranks_per_machine=1)
    assert env["gpus"][0]["in_peak_table"] is False
    assert "not in the peak table (pass peak_flops_per_device)" in format_environment(env)
