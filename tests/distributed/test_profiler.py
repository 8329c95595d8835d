"""TorchProfiler: one trace per rank with the strategies' named ranges; nothing when off."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import nanotrain as nt
from nanotrain.callbacks import TorchProfiler
from nanotrain.runtime.profiling import named_range, profiler_recording
from nanotrain.testing import BlobsData, Classifier, make_trainer
from tests.distributed.spawn import run_world


def range_names(trace: Path) -> set[str]:
    """The `nanotrain/...` range names in a Chrome-trace JSON file."""
    events = json.loads(trace.read_text())["traceEvents"]
    return {e["name"] for e in events if str(e.get("name", "")).startswith("nanotrain/")}


def test_named_range_is_a_shared_no_op_without_a_profiler():
    assert not profiler_recording()
    assert named_range("nanotrain/forward") is named_range("nanotrain/backward")


def test_single_process_trace_has_forward_backward_and_optimizer_step(tmp_path):
    profiler = TorchProfiler(wait=1, warmup=1, active=2)
    trainer = make_trainer(tmp_path, max_steps=6, callbacks=[profiler])
    trainer.fit(Classifier(), BlobsData())
    traces = sorted((trainer.run_dir / "profiler").iterdir())
    assert traces == profiler.trace_paths == [trainer.run_dir / "profiler/rank0.4.pt.trace.json"]
    assert range_names(traces[0]) == {
        "nanotrain/forward",
        "nanotrain/backward",
        "nanotrain/optimizer_step",
    }
    assert not profiler_recording()  # stopped once its schedule was done


def test_bad_schedule_raises():
    with pytest.raises(ValueError, match="active must be an int >= 1"):
        TorchProfiler(active=0)
    with pytest.raises(ValueError, match="wait must be an int >= 0"):
        TorchProfiler(wait=-1)


def profiled_pipeline_fit(rank: int, world_size: int, root: str) -> list[str]:
    trainer = nt.Trainer(
        strategy=nt.MegatronStrategy(pp=2, zero_stage=0),
        max_steps=3,
        global_batch_size=4,
        micro_batch_size=1,
        log_every_n_steps=1,
        default_root_dir=root,
        loggers=[],
        callbacks=[TorchProfiler(wait=1, warmup=0, active=1)],
    )
    module = nt.LanguageModelModule(
        model="tiny", model_overrides={"mtp_depth": 0, "max_seq_len": 16}, vocab_size=64
    )
    import torch

    ids = torch.randint(0, 64, (16, 9), generator=torch.Generator().manual_seed(0))
    data = [{"input_ids": row[:-1], "labels": row[1:]} for row in ids]
    trainer.fit(module, train_dataloaders=data)
    traces = sorted((Path(trainer.run_dir) / "profiler").glob(f"rank{rank}.*"))
    assert len(traces) == 1, traces
    return sorted(range_names(traces[0]))


@pytest.mark.distributed
def test_pipeline_run_writes_one_trace_per_rank_with_stage_microbatch_ranges(tmp_path):
    names = run_world(profiled_pipeline_fit, 2, str(tmp_path), timeout=120)
    assert sorted(p.name for p in (tmp_path / "default/version_0/profiler").iterdir()) == [
        "rank0.2.pt.trace.json",
        "rank1.2.pt.trace.json",
    ]
    for rank, got in enumerate(names):
        expected = {"nanotrain/grad_reduction", "nanotrain/optimizer_step"}
        for m in range(4):  # 4 microbatches per step on each stage (dp=1)
            expected |= {f"nanotrain/stage{rank}/forward/mb{m}"}
            expected |= {f"nanotrain/stage{rank}/backward/mb{m}"}
        assert set(got) == expected, (rank, got)
