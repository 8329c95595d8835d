"""`nanotrain export` of a sharded checkpoint reads and writes one tensor at a time.

A forked world of 4 ranks trains the tiny DeepSeek (MLA, MoE, MTP; vocabulary 257, padded
to 258 by tp) for one step under tp=2 x ep=2 and saves a sharded checkpoint. In the test
process the export runs with every read of a shard file (through safetensors' slice API)
and every tensor the writer writes logged in one sequence. Between two writes the reads
must add up to exactly the elements of the tensor written next: the export holds one whole
tensor (and the shard pieces it was read from) at a time, never the whole model; the
padding row of the vocabulary is never read, and an HF export reads each routed expert
alone from the one shard holding it. The files must be byte-identical to what
`safetensors.torch.save_file` writes for the eagerly merged tensors (the former export).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

import nanotrain as nt
from nanotrain.callbacks.checkpoint import ModelCheckpoint
from nanotrain.checkpoint import merge
from nanotrain.interop import safetensors_writer
from nanotrain.interop.hf import config_to_hf, state_dict_to_hf
from nanotrain.interop.safetensors_writer import save_file_streaming
from nanotrain.interop.weights import export_checkpoint
from nanotrain.models import lazy, presets
from tests.distributed.spawn import run_world
from tests.distributed.test_pretrained_lazy import _CountingFile
from tests.unit.test_language_model import RandomTokens

VOCAB = 257


def _train(rank: int, world_size: int, root: str) -> str:
    saver = ModelCheckpoint()  # saves when training ends
    trainer = nt.Trainer(
        strategy=nt.MegatronStrategy(tp=2, ep=2),
        max_steps=1,
        global_batch_size=4,
        micro_batch_size=2,
        default_root_dir=root,
        loggers=[],
        seed=3,
        callbacks=[saver],
    )
    module = nt.LanguageModelModule(model="tiny", vocab_size=VOCAB, lr=1e-2, warmup_steps=1)
    trainer.fit(module, train_dataloaders=RandomTokens(16, VOCAB))
    return saver.last_model_path


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    root = str(tmp_path_factory.mktemp("stream"))
    return Path(run_world(_train, 4, root, timeout=120)[0])


def _logged_export(ckpt: Path, out: Path, to: str, monkeypatch) -> list[tuple[str, Any, int]]:
    """Export `ckpt` to `out`; the sequence of ("read", name, elements) and ("write", name,
    elements) events it made."""
    events: list[tuple[str, Any, int]] = []

    class Log(dict):  # the counting handles record into it; we keep the order too
        def __setitem__(self, name: str, total: int) -> None:
            events.append(("read", name, total - self.get(name, 0)))
            super().__setitem__(name, total)

    log = Log()
    real_open, real_payload = merge.safe_open, safetensors_writer._payload

    def payload(name: str, value: Any) -> memoryview:
        data = real_payload(name, value)
        events.append(("write", name, value.numel()))
        return data

    monkeypatch.setattr(
        merge, "safe_open", lambda *a, **kw: _CountingFile(real_open(*a, **kw), log)
    )
    monkeypatch.setattr(lazy, "safe_open", merge.safe_open)
    monkeypatch.setattr(safetensors_writer, "_payload", payload)
    export_checkpoint(ckpt, out, to=to)
    monkeypatch.undo()
    return events


def _reads_per_write(events: list[tuple[str, Any, int]]) -> list[tuple[str, int, int, int]]:
    """(name written, its elements, elements read for it, shard reads for it) per write."""
    out, read, pieces = [], 0, 0
    for kind, name, n in events:
        if kind == "read":
            read, pieces = read + n, pieces + 1
        else:
            out.append((name, n, read, pieces))
            read = pieces = 0
    assert read == 0, "reads after the last write"
    return out


@pytest.mark.distributed
def test_nanotrain_export_reads_one_tensor_per_write_and_equals_save_file(
    ckpt, tmp_path, monkeypatch
):
    events = _logged_export(ckpt, tmp_path / "nt", "nanotrain", monkeypatch)
    writes = _reads_per_write(events)
    merged = merge.merge_model_shards(ckpt)
    assert len(writes) == len(merged)
    for name, numel, read, pieces in writes:
        assert read == numel, f"{name}: read {read} elements to write {numel}"
        assert pieces <= 4, f"{name}: {pieces} reads, more than tp x ep shards"
    # the head and the embedding: rows 0..256 from two tp shards, the padding row not read
    by_name = {w[0]: w for w in writes}
    assert by_name["lm_head.weight"][1:] == (VOCAB * 64, VOCAB * 64, 2)
    # byte for byte what the former, eager export wrote
    weights = {k.removeprefix("model."): v.contiguous().clone() for k, v in merged.items()}
    save_file(weights, tmp_path / "eager.safetensors", metadata={"format": "pt"})
    got = (tmp_path / "nt" / "model.safetensors").read_bytes()
    assert got == (tmp_path / "eager.safetensors").read_bytes()


@pytest.mark.distributed
def test_hf_export_reads_each_expert_alone_and_equals_save_file(ckpt, tmp_path, monkeypatch):
    events = _logged_export(ckpt, tmp_path / "hf", "hf", monkeypatch)
    writes = _reads_per_write(events)
    for name, numel, read, pieces in writes:
        assert read == numel, f"{name}: read {read} elements to write {numel}"
        if ".mlp.experts." in name:  # one expert: a slice of one ep shard, nothing else
            assert pieces == 1, name
    config = presets.get("tiny", vocab_size=VOCAB)
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["vocab_size"] == VOCAB
    merged = merge.merge_model_shards(ckpt)
    weights = {k.removeprefix("model."): v for k, v in merged.items()}
    hf = {k: v.contiguous().clone() for k, v in state_dict_to_hf(config, weights).items()}
    assert len(writes) == len(hf)
    save_file(hf, tmp_path / "eager.safetensors", metadata={"format": "pt"})
    got = (tmp_path / "hf" / "model.safetensors").read_bytes()
    assert got == (tmp_path / "eager.safetensors").read_bytes()
    assert config_to_hf(config)["n_routed_experts"] == 8


def test_streaming_writer_writes_save_files_bytes_for_every_dtype(tmp_path):
    g = torch.Generator().manual_seed(0)
    dtypes = [torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64]
    dtypes += [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.float8_e4m3fn]
    tensors = {
        f"t{i}": (10 * torch.randn(3, i + 1, generator=g)).to(d) for i, d in enumerate(dtypes)
    }
    tensors.update(scalar=torch.tensor(2.5), empty=torch.zeros(0, 3), view=torch.arange(9.0)[::2])
    for metadata in (None, {"format": "pt"}):
        save_file(
            {k: v.contiguous() for k, v in tensors.items()}, tmp_path / "a", metadata=metadata
        )
        save_file_streaming(tensors, tmp_path / "b", metadata=metadata)
        assert (tmp_path / "a").read_bytes() == (tmp_path / "b").read_bytes()
        lazily = lazy.open_safetensors(tmp_path / "a")  # lazy values: read while writing
        save_file_streaming(lazily, tmp_path / "c", metadata=metadata)
        assert (tmp_path / "a").read_bytes() == (tmp_path / "c").read_bytes()
    with pytest.raises(TypeError, match=r"tensors or LazyTensors; \['x'\]"):
        save_file_streaming({"x": [1.0]}, tmp_path / "d")
