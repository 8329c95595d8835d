"""benchmarks/gpu.py: argument checks and a clean skip without CUDA."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

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
    assert "--compile takes none, layers, model, cudagraphs" in capsys.readouterr().err


def test_presets_are_about_one_billion_parameters():
    sizes = {n: gpu.total_params(gpu.config_of(n, 2048)) for n in gpu.PRESETS}
    assert all(0.9e9 < s < 1.2e9 for s in sizes.values()), sizes


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only skip")
def test_without_cuda_it_skips_cleanly(capsys):
    assert gpu.main(["--preset", "moe-1b"]) == 0
    assert "nothing timed (skipped)" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("sync_steps", "passes"), [((), True), ((2,), True), ((2, 4), False), ((5,), False)]
)
def test_sync_check_counts_syncs_reported_only_on_stderr(monkeypatch, capsys, sync_steps, passes):
    # The check itself on CPU: torch.cuda's calls stubbed, and "sync debug mode" stands in for
    # a sync on a thread without Python, which torch reports only on stderr (fd 2), in the
    # steps given. Step 2 (one-time work) is reported but not failed.
    import os

    import nanotrain as nt

    step = {"n": 0}

    def set_mode(mode):
        if mode == "warn":
            step["n"] += 1
            if step["n"] + 1 in sync_steps:  # watching starts at step 2
                os.write(2, b"[rank0]: Warning: called a synchronizing CUDA operation\n")

    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", set_mode)
    monkeypatch.setattr(gpu, "_strategy", lambda name: (nt.SingleDeviceStrategy("cpu"), None))
    assert gpu.sync_check("32", "single") is passes
    out = capsys.readouterr().out
    if sync_steps:
        assert f"{len(sync_steps)}x stderr only" in out
        assert f"in steps {sorted(sync_steps)}" in out
    else:
        assert "no host-device sync" in out


def test_expert_scaling_times_every_size_and_prints_the_floor(capsys):
    # the GPU expert table's code path, on the CPU at toy sizes
    ms = gpu.expert_scaling("cpu", torch.float32, rows=256, hidden=16, width=8, repeats=2)
    assert sorted(ms) == [8, 32, 128] and all(t > 0 for t in ms.values())
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| 128 |")]
    floor = float(rows[0].split("|")[4].strip().rstrip("x"))
    assert floor > 1.0  # 16x the weight bytes cannot cost nothing


def test_sync_sources_places_each_call_in_its_step_with_its_enclosing_ops(monkeypatch, capsys):
    # --find-syncs on CPU, with two ops standing in for blocking CUDA runtime calls: the loss's
    # log-softmax (inside each step's forward) and one a callback runs before each step's own
    # range opens (where data loading and the default callbacks run), which must count to that
    # step, not to nowhere
    import nanotrain as nt

    class CallBeforeEachStep(nt.Callback):
        def on_train_step_start(self, trainer, module, batch, batch_idx):
            torch.zeros(1).logcumsumexp(0)

    real_trainer = nt.Trainer

    def trainer_with_callback(**kwargs):
        kwargs["callbacks"] = [CallBeforeEachStep(), *kwargs["callbacks"]]
        return real_trainer(**kwargs)

    monkeypatch.setattr(nt, "Trainer", trainer_with_callback)
    monkeypatch.setattr(gpu, "_strategy", lambda name: (nt.SingleDeviceStrategy("cpu"), None))
    # steps 8 and 9: the 64-sequence data set ends after step 8 and the next epoch begins
    calls = ("aten::_log_softmax", "aten::logcumsumexp")
    found = gpu.sync_sources("32", "single", steps=range(8, 10), calls=calls)
    out = capsys.readouterr().out
    softmax = {w: n for w, n in found.items() if w.startswith("aten::_log_softmax (thread ")}
    assert softmax and all("nanotrain/forward" in where for where in softmax), list(found)
    # two micro-batches a step: at least twice in each of steps 8 and 9, never outside them
    steps = [n for in_steps in softmax.values() for n in in_steps]
    assert steps.count(8) >= 2 and steps.count(9) >= 2 and set(steps) == {8, 9}
    # step 8's callback call comes before the profiler starts; step 9's belongs to step 9
    before = [n for w, in_steps in found.items() if "logcumsumexp" in w for n in in_steps]
    assert before == [9], (before, out)
    total = sum(len(v) for v in found.values())
    assert f"{total} call(s)" in out
    # one place is one line: no step range or object address splits it
    assert not any("sync_sources/step" in where or " at 0x" in where for where in found)


def test_find_syncs_fails_after_the_warm_up_of_each_strategy():
    assert gpu.warm_up_last("ddp", "bf16-mixed") == 11  # torch's DDP: its runtime statistics
    assert gpu.warm_up_last("ddp", "bf16-true") == 2  # nanotrain's own buckets
    assert gpu.warm_up_last("megatron", "bf16-mixed") == 2
    found = {"a": [2, 2, 5], "b": [12]}
    assert gpu.late_syncs(found, 11) == [12]
    assert gpu.late_syncs(found, 2) == [5, 12]
    assert gpu.late_syncs({"a": [2]}, 2) == []


def test_find_syncs_takes_strategy_and_precision(capsys):
    assert gpu.parse(["--find-syncs", "ddp:bf16-mixed"]).find_syncs == ["ddp:bf16-mixed"]
    with pytest.raises(SystemExit):
        gpu.parse(["--find-syncs", "fsdp:bf16-mixed"])
    assert "--find-syncs takes STRATEGY:PRECISION" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        gpu.parse(["--find-syncs", "ddp:bf17"])
    assert "unknown precision 'bf17'" in capsys.readouterr().err


def test_the_bare_loop_keeps_the_trainer_precisions_on_the_cpu(monkeypatch):
    # bf16-true: bf16 weights, fp32 main grads and masters (what the Trainer keeps), so the
    # bare loop is compared with `nanotrain fit` in the same precision
    monkeypatch.setitem(gpu.PRESETS, "tiny", ("tiny", {}))
    args = gpu.parse(["--precision", "bf16-true", "--seq-len", "16", "--micro-batch", "2"])
    step, config = gpu._training_step("tiny", "none", args, device="cpu")
    step()
    assert config.vocab_size > 0
    with pytest.raises(SystemExit):
        gpu.parse(["--precision", "fp8"])


_FIT_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_fit.py"
_fit_spec = importlib.util.spec_from_file_location("gpu_fit_benchmark", _FIT_PATH)
gpu_fit = importlib.util.module_from_spec(_fit_spec)
_fit_spec.loader.exec_module(gpu_fit)


def test_gpu_fit_arguments_are_checked(capsys):
    args = gpu_fit.parse(["--preset", "dense-3b", "--precision", "bf16-mixed,torchao-float8"])
    assert args.preset == ["dense-3b"] and args.precision == ["bf16-mixed", "torchao-float8"]
    for bad, message in (
        (["--preset", "dense-9b"], "--preset takes"),
        (["--compile", "fast"], "--compile takes none, model, cudagraphs"),
        (["--steps", "0"], "--steps must be >= 1"),
    ):
        with pytest.raises(SystemExit):
            gpu_fit.parse(bad)
        assert message in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only skip")
def test_gpu_fit_runs_nanotrain_fit_on_the_cpu_and_keeps_its_logs(tmp_path, capsys, monkeypatch):
    # the user's path itself (the `nanotrain fit` command line the GPU runs use), tiny. The
    # command runs in this process, through the entry point `python -m nanotrain` calls: a
    # fresh interpreter would only repeat the imports (about 10 s of CPU); that the module
    # launches is test_cli.py's README command, in a real subprocess
    from nanotrain.cli.entry import main as nanotrain_main

    commands = []

    def run_in_process(command, cwd, capture_output, text):
        assert command[:3] == [sys.executable, "-m", "nanotrain"], command
        commands.append(command)
        return subprocess.CompletedProcess(command, nanotrain_main(command[3:]), "", "")

    monkeypatch.setattr(gpu_fit, "subprocess", SimpleNamespace(run=run_in_process))
    assert gpu_fit.main(["--smoke", "--out", str(tmp_path)]) == 0
    assert len(commands) == 1
    kept = tmp_path / "tiny-32-true-none"
    report = json.loads((kept / "report.json").read_text())
    assert report["status"] == "finished" and report["training"]["steps"] == 3
    assert (kept / "tensorboard").is_dir() and (kept / "metrics.jsonl").is_file()
    assert "| tiny | 32-true | none |" in capsys.readouterr().out
    assert gpu_fit.main(["--preset", "moe-1b"]) == 0  # no CUDA: arguments only
