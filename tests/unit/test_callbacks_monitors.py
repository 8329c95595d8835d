"""GradNormMonitor, ThroughputMonitor, LearningRateMonitor, MemoryMonitor and the peak table."""

from __future__ import annotations

import io
import json
import os
import warnings
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import nanotrain as nt
from nanotrain.callbacks.flops import device_peak_flops, normalize_precision
from nanotrain.callbacks.grad_norm import GradNormMonitor, group_name
from nanotrain.callbacks.lr_monitor import LearningRateMonitor
from nanotrain.callbacks.memory import MemoryMonitor, process_memory_bytes
from nanotrain.callbacks.progress import ProgressBar
from nanotrain.callbacks.throughput import ThroughputMonitor
from nanotrain.planning.gpus import GPUS
from nanotrain.testing import BlobsData, Classifier, blobs, make_trainer


def metrics_by_step(trainer: nt.Trainer) -> dict[int, dict]:
    """Merge every metrics.jsonl line of a step into one dict per step, keyed by the step's
    number N (`global_step` once it completes); its records are logged at N - 1
    (Lightning's 0-based convention), the Trainer's and every monitor's alike."""
    merged: dict[int, dict] = {}
    for line in (trainer.run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        merged.setdefault(record["step"] + 1, {}).update(record)
    return merged


class FakeClock:
    """A clock that moves only when told to."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class AdvanceClock(nt.Callback):
    """Makes every training step take `step_time` and every validation `val_time` fake seconds."""

    def __init__(self, clock: FakeClock, step_time: float, val_time: float = 0.0) -> None:
        self.clock, self.step_time, self.val_time = clock, step_time, val_time

    def on_train_step_start(self, trainer, module, batch, batch_idx):
        self.clock.now += self.step_time

    def on_validation_end(self, trainer, module):
        self.clock.now += self.val_time


class TokenClassifier(Classifier):
    """Pretends every sample holds 10 tokens and costs a known number of FLOPs per token."""

    def count_tokens(self, batch):
        return 10 * len(batch[0])

    def flops_per_token(self):
        return 1234.0


# -- grad norm -------------------------------------------------------------------------------
def test_logged_grad_norms_match_clip_grad_norm_on_a_reference_model(tmp_path):
    x, y = blobs(64)
    monitor = GradNormMonitor(detail_every_n_steps=1, group_by="parameter")
    # a tiny clip threshold shows the logged norm is the one before clipping
    trainer = make_trainer(
        tmp_path,
        max_steps=1,
        shuffle=False,
        gradient_clip_val=1e-3,
        callbacks=[monitor],
        seed=0,
    )
    trainer.fit(Classifier(), train_dataloaders=TensorDataset(x, y))
    logged = metrics_by_step(trainer)[1]

    torch.manual_seed(0)  # Trainer(seed=0) seeds the global RNG before the model is built
    reference = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))
    F.cross_entropy(reference(x[:8]), y[:8]).backward()  # first batch, no shuffling
    expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm=float("inf"))
    # one name per number: the Trainer's train/grad_norm, no grad_norm/global copy
    assert logged["train/grad_norm"] == pytest.approx(expected.item(), rel=1e-5)
    assert "grad_norm/global" not in logged
    for i in (0, 2):
        for kind in ("weight", "bias"):
            grad = getattr(reference[i], kind).grad
            assert logged[f"grad_norm/net.{i}.{kind}"] == pytest.approx(
                grad.norm().item(), rel=1e-5
            )


def test_group_norm_pools_parameters_as_root_sum_of_squares():
    monitor = GradNormMonitor(group_by="layer")
    norms = {
        "net.0.weight": torch.tensor(3.0),
        "net.0.bias": torch.tensor(4.0),
        "head.weight": torch.tensor(2.0),
    }
    pooled = monitor.group_norms(norms)
    assert pooled["grad_norm/net.0"].item() == pytest.approx(5.0)
    assert pooled["grad_norm/head"].item() == pytest.approx(2.0)


def test_group_names():
    name = "model.layers.3.attn.wq.weight"
    assert group_name(name, "parameter") == name
    assert group_name(name, "module") == "model.layers.3.attn.wq"
    assert group_name(name, "layer") == "model.layers.3"
    assert group_name("model.embed.weight", "layer") == "model.embed"


def test_a_grad_norm_far_above_the_running_median_is_flagged(tmp_path):
    class SpikeAt5(Classifier):
        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            return loss * 1e3 if self.trainer.global_step == 4 else loss

    monitor = GradNormMonitor(min_history=3, spike_factor=5.0)
    # clipping keeps the spiked step from wrecking the weights (and the steps after it)
    trainer = make_trainer(tmp_path, max_steps=6, gradient_clip_val=1.0, callbacks=[monitor])
    with pytest.warns(UserWarning, match="grad-norm spike at step 5"):
        trainer.fit(SpikeAt5(), BlobsData())
    logged = metrics_by_step(trainer)
    assert [logged[s]["grad_norm/spikes"] for s in range(1, 7)] == [0, 0, 0, 0, 1, 1]
    assert monitor.num_spikes == 1


def test_grad_norm_monitor_rejects_unknown_grouping():
    with pytest.raises(ValueError, match="group_by must be one of"):
        GradNormMonitor(group_by="tp_rank")


# -- throughput and MFU ----------------------------------------------------------------------
def test_mfu_and_rates_match_the_formula_with_a_fake_clock(tmp_path):
    clock = FakeClock()
    peak = 1e6  # FLOP/s per device, tiny so that the MFU is a readable number
    monitor = ThroughputMonitor(peak_flops_per_device=peak, log_every_n_steps=2, clock=clock)
    # each step takes 0.5 s; validation after step 2 takes 7 s and must not count
    trainer = make_trainer(
        tmp_path,
        callbacks=[AdvanceClock(clock, 0.5, val_time=7.0), monitor],
        val_check_interval=2,
        limit_val_batches=1,
    )
    trainer.fit(TokenClassifier(), BlobsData())
    logged = metrics_by_step(trainer)
    tokens_per_sec = 8 * 10 / 0.5  # 8 samples × 10 tokens per 0.5 s step
    for step in (2, 4):
        m = logged[step]
        assert m["throughput/step_time"] == pytest.approx(0.5)
        assert m["throughput/samples_per_sec"] == pytest.approx(16.0)
        assert m["throughput/tokens_per_sec"] == pytest.approx(tokens_per_sec)
        assert m["throughput/tokens_per_sec_per_device"] == pytest.approx(tokens_per_sec)
        assert m["throughput/tflops_per_device"] == pytest.approx(1234.0 * tokens_per_sec / 1e12)
        assert m["throughput/mfu"] == pytest.approx(1234.0 * tokens_per_sec / peak)
    assert "throughput/mfu" not in logged[1]


def test_first_window_leaves_out_the_first_step(tmp_path):
    # step 1 takes 10 s more (a compile, say): before, the first window's rates counted it
    clock = FakeClock()

    class SlowFirstStep(nt.Callback):
        def on_train_step_start(self, trainer, module, batch, batch_idx):
            clock.now += 10.0 if trainer.global_step == 0 else 0.0

    monitor = ThroughputMonitor(peak_flops_per_device=1e6, log_every_n_steps=2, clock=clock)
    trainer = make_trainer(tmp_path, callbacks=[SlowFirstStep(), AdvanceClock(clock, 0.5), monitor])
    trainer.fit(TokenClassifier(), BlobsData())
    logged = metrics_by_step(trainer)
    for step in (2, 4):  # the first window is step 2 alone, the second steps 3-4
        assert logged[step]["throughput/step_time"] == pytest.approx(0.5)
        assert logged[step]["throughput/tokens_per_sec"] == pytest.approx(8 * 10 / 0.5)


def test_mfu_is_not_logged_on_cpu_without_a_peak_and_says_why_without_a_warning(tmp_path):
    monitor = ThroughputMonitor()
    trainer = make_trainer(tmp_path, max_steps=2, callbacks=[monitor])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # CPU has no peak by nature: no Python warning
        trainer.fit(TokenClassifier(), BlobsData())
    logged = metrics_by_step(trainer)[2]  # step 1, the first, is not timed
    assert "throughput/tokens_per_sec" in logged and "throughput/mfu" not in logged
    assert "no peak FLOP/s is known for cpu" in monitor.mfu_note
    assert "peak_flops_per_device" in monitor.mfu_note


@pytest.fixture
def fake_gpu(monkeypatch):
    """Name the (absent) CUDA device as torch would, an sm90 part, fp32 matmuls in full fp32."""
    monkeypatch.setattr(torch, "get_float32_matmul_precision", lambda: "highest")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))

    def named(name):
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: name)
        return torch.device("cuda", 0)

    return named


def test_peaks_come_from_lightning_where_it_knows_the_device(fake_gpu):
    from lightning.fabric.utilities.throughput import get_available_flops

    device = fake_gpu("NVIDIA A100-SXM4-80GB")
    assert device_peak_flops(device, "bf16") == get_available_flops(device, torch.bfloat16)
    assert device_peak_flops(device, "bf16") == pytest.approx(312e12)
    assert device_peak_flops(device, "fp8") is None  # no fp8 on A100
    assert device_peak_flops(fake_gpu("NVIDIA H100 80GB HBM3"), torch.bfloat16) == 989.4e12
    assert device_peak_flops(fake_gpu("Tesla V100-SXM2-16GB"), "fp16") == pytest.approx(125e12)
    assert device_peak_flops(fake_gpu("Some Future GPU"), "bf16") is None
    assert device_peak_flops(torch.device("cpu"), "bf16") is None


def test_own_rows_cover_what_lightning_lacks_or_misreads(fake_gpu):
    assert device_peak_flops(fake_gpu("NVIDIA H100 80GB HBM3"), "fp8") == pytest.approx(1978.9e12)
    assert device_peak_flops(fake_gpu("NVIDIA H200"), "bf16") == pytest.approx(989.4e12)
    assert device_peak_flops(fake_gpu("NVIDIA H800"), "bf16") == pytest.approx(989.4e12)
    assert device_peak_flops(fake_gpu("NVIDIA B200"), "bf16") == pytest.approx(2250e12)
    # Lightning reads "L40S" as the L4 and gives an NVL pair's figure for one H100 NVL
    assert device_peak_flops(fake_gpu("NVIDIA L40S"), "bf16") == pytest.approx(362.05e12)
    assert device_peak_flops(fake_gpu("NVIDIA H100 NVL"), "bf16") == pytest.approx(835.5e12)
    assert normalize_precision(torch.float8_e4m3fn) == "fp8"
    with pytest.raises(ValueError, match="unknown precision"):
        normalize_precision("int4")


@pytest.mark.parametrize(
    "kind, device_name",
    [("a100", "NVIDIA A100-SXM4-80GB"), ("h100", "NVIDIA H100 80GB HBM3"),
     ("h800", "NVIDIA H800"), ("h200", "NVIDIA H200"), ("b200", "NVIDIA B200")],
)  # fmt: skip
def test_the_planner_divides_by_the_peak_a_run_divides_by(fake_gpu, kind, device_name):
    device = fake_gpu(device_name)
    for column in ("fp8", "bf16", "fp16", "tf32", "fp32"):
        assert GPUS[kind].peak_flops.get(column) == pytest.approx(
            device_peak_flops(device, column)
        ), column


def test_default_precision_follows_the_parameters_dtype():
    fp32, bf16 = Classifier(), Classifier()
    fp32.configure_model()
    bf16.configure_model()
    bf16.to(torch.bfloat16)
    trainer = SimpleNamespace(strategy=SimpleNamespace(root_device=torch.device("cpu")))
    trainer.is_global_zero = False  # no warning about the (unknown) CPU peak
    monitors = {}
    for name, module in (("fp32", fp32), ("bf16", bf16)):
        monitors[name] = ThroughputMonitor(peak_flops_per_device=1e12)
        monitors[name].on_fit_start(trainer, module)
    assert monitors["fp32"].precision == "fp32"
    assert monitors["bf16"].precision == "bf16"
    assert ThroughputMonitor(precision="fp8").precision == "fp8"  # given: kept


# -- learning rate and memory ----------------------------------------------------------------
def test_learning_rate_logged_is_the_rate_each_step_used(tmp_path):
    trainer = make_trainer(
        tmp_path, max_steps=5, callbacks=[LearningRateMonitor(log_momentum=True)]
    )
    trainer.fit(Classifier(lr=0.08, scheduler=True), BlobsData())
    logged = metrics_by_step(trainer)
    # StepLR(step_size=2, gamma=0.5) steps after every update: step n runs at 0.08·0.5^((n-1)//2)
    assert [logged[n]["lr/group0"] for n in range(1, 6)] == pytest.approx(
        [0.08, 0.08, 0.04, 0.04, 0.02]
    )
    assert logged[1]["momentum/group0"] == 0.0  # SGD's default momentum
    # as Lightning's monitor: the last logged rates are also in callback_metrics
    assert float(trainer.callback_metrics["lr/group0"]) == pytest.approx(0.02)


def test_cpu_memory_reads_the_process_resident_set(tmp_path):
    # statm counts resident pages: an independent view of the same number
    resident_pages = int(open("/proc/self/statm").read().split()[1])
    rss, peak = process_memory_bytes()
    assert rss == pytest.approx(resident_pages * os.sysconf("SC_PAGE_SIZE"), rel=0.05)
    assert peak >= rss
    trainer = make_trainer(tmp_path, max_steps=2, callbacks=[MemoryMonitor()])
    trainer.fit(Classifier(), BlobsData())
    logged = metrics_by_step(trainer)[2]
    assert 0 < logged["memory/rss_gib"] <= logged["memory/peak_rss_gib"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_peak_covers_a_large_temporary_of_the_step(tmp_path):
    class Hungry(Classifier):
        def training_step(self, batch, batch_idx):
            scratch = torch.ones(64 * 2**20 // 4, device=batch[0].device)  # 64 MiB, freed at once
            return super().training_step(batch, batch_idx) + 0 * scratch[0]

    trainer = make_trainer(
        tmp_path, max_steps=1, strategy=nt.SingleDeviceStrategy("cuda"), callbacks=[MemoryMonitor()]
    )
    trainer.fit(Hungry(), BlobsData())
    logged = metrics_by_step(trainer)[1]
    assert logged["memory/peak_allocated_gib"] >= 64 / 1024
    assert logged["memory/peak_reserved_gib"] >= logged["memory/peak_allocated_gib"]


def test_after_a_resume_onto_a_log_step_the_first_step_is_not_timed(tmp_path):
    # a run resumed at step 3 starts with step 4, a log step, which carries the restart's
    # start-up (10 s here): neither the throughput nor the progress line may time it
    clock = FakeClock()

    class SlowFirstStepOfEachStart(nt.Callback):
        def on_train_start(self, trainer, module):
            self.first = True

        def on_train_step_start(self, trainer, module, batch, batch_idx):
            clock.now += 10.0 if self.first else 0.5
            self.first = False

    def trainer(max_steps, *extra):
        callbacks = [SlowFirstStepOfEachStart(), *extra]
        callbacks.append(ThroughputMonitor(peak_flops_per_device=1e6, clock=clock))
        return make_trainer(
            tmp_path,
            max_steps=max_steps,
            log_every_n_steps=2,
            enable_checkpointing=True,
            callbacks=callbacks,
        )

    trainer(3).fit(TokenClassifier(), BlobsData())
    stream = io.StringIO()
    resumed = trainer(8, ProgressBar(mode="plain", stream=stream, clock=clock))
    resumed.fit(TokenClassifier(), BlobsData(), ckpt_path="last")
    logged = metrics_by_step(resumed)
    assert "throughput/step_time" not in logged[4]
    assert [logged[s]["throughput/step_time"] for s in (6, 8)] == pytest.approx([0.5, 0.5])
    lines = stream.getvalue().splitlines()
    assert lines[0].startswith("step 4/8") and "s/step" not in lines[0] and "ETA" not in lines[0]
    assert lines[1].startswith("step 6/8") and lines[1].endswith("0.500 s/step | ETA 0:00:01")
