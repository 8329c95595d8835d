"""benchmarks/gpu.py: argument checks and a clean skip without CUDA."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu.py"
_spec = importlib.util.spec_from_file_location("gpu_benchmark", _PATH)
gpu = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpu)


def test_bad_arguments_exit_with_the_flag_named(capsys):
    with pytest.raises(SystemExit):
        gpu.parse(["--seq-len", "0"])
    assert "--seq-len must be >= 1" in capsys.readouterr().err


def test_compile_runs_are_parsed_and_checked(capsys):
    assert gpu.parse([]).compile == ["none", "model"]
    assert gpu.parse(["--compile", "layers, model"]).compile == ["layers", "model"]
    with pytest.raises(SystemExit):
        gpu.parse(["--compile", "model,fast"])
    assert "--compile takes none, layers and/or model" in capsys.readouterr().err


def test_presets_are_about_one_billion_parameters():
    sizes = {n: gpu.total_params(gpu.config_of(n, 2048)) for n in gpu.PRESETS}
    assert all(0.9e9 < s < 1.2e9 for s in sizes.values()), sizes


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only skip")
def test_without_cuda_it_skips_cleanly(capsys):
    assert gpu.main(["--preset", "moe-1b"]) == 0
    assert "nothing timed (skipped)" in capsys.readouterr().out
