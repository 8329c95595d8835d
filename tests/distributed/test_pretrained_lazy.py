"""A rank of a sharded layout reads only its own slices of a pretrained folder.

`safe_open` is wrapped in every rank so that each read through safetensors' slice API is
recorded (tensor name -> elements returned). A world of 2 ranks loads, lazily
(`model_io.open_pretrained`), three folders under three layouts:

* the tiny dense model (nanotrain weights folder) under tp=2: every column-/row-parallel
  weight is read half per rank, the vocabulary-parallel embedding and head their rows of the
  vocabulary padded from 257 to 258 (129 rows on rank 0, 128 on rank 1), norms whole;
* the same folder under pp=2: a rank reads exactly the tensors of its stage, whole;
* the tiny DeepSeek written as a transformers folder, once with one tensor per expert and
  once with transformers' fused `gate_up_proj` [E, 2I, H], under ep=2: a rank reads the
  tensors of its 4 of the 8 routed experts only (for the fused tensor: rows of its experts
  only), everything else whole.

The expected counts are computed here from the shapes. Every lazy load must also equal an
eager load (everything read, then sliced) bit for bit.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from nanotrain.interop import hf_io
from nanotrain.interop import weights as model_io
from nanotrain.models import build_model, lazy, presets
from nanotrain.models.sharding import load_full_state_dict
from nanotrain.models.stages import build_pipeline_stage
from nanotrain.parallel.mesh import ParallelMesh
from tests.distributed.spawn import run_world

VOCAB, EXPERTS = 257, 8  # of both tiny presets


class _CountingSlice:
    """A `get_slice` result that records how many elements each `[...]` returns."""

    def __init__(self, inner: Any, name: str, log: dict[str, int]) -> None:
        self.inner, self.name, self.log = inner, name, log

    def get_shape(self) -> list[int]:
        return self.inner.get_shape()

    def get_dtype(self) -> str:
        return self.inner.get_dtype()

    def __getitem__(self, index: Any) -> torch.Tensor:
        out = self.inner[index]
        self.log[self.name] = self.log.get(self.name, 0) + out.numel()
        return out


class _CountingFile:
    """A `safe_open` handle whose reads are logged; whole-tensor reads count in full."""

    def __init__(self, inner: Any, log: dict[str, int]) -> None:
        self.inner, self.log = inner, log

    def __enter__(self) -> _CountingFile:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.inner.__exit__(*exc)

    def keys(self) -> list[str]:
        return self.inner.keys()

    def get_slice(self, name: str) -> _CountingSlice:
        return _CountingSlice(self.inner.get_slice(name), name, self.log)

    def get_tensor(self, name: str) -> torch.Tensor:
        out = self.inner.get_tensor(name)
        self.log[name] = self.log.get(name, 0) + out.numel()
        return out


def _perturbed(preset: str) -> torch.nn.Module:
    torch.manual_seed(3)
    model = build_model(presets.get(preset))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


def _fuse_experts(folder: Path) -> None:
    """Rewrite a transformers folder's per-expert tensors as fused `gate_up_proj` [E, 2I, H]
    and `down_proj` [E, H, I] per layer, as transformers >= 5 holds them in memory."""
    tensors = load_file(folder / "model.safetensors")
    out, per_layer = {}, {}
    for key, t in tensors.items():
        head, sep, tail = key.partition(".mlp.experts.")
        if not sep:
            out[key] = t
            continue
        expert, proj, _ = tail.split(".")
        per_layer.setdefault(head, {}).setdefault(proj, {})[int(expert)] = t
    for head, projs in per_layer.items():
        stacked = {p: torch.stack([e[i] for i in range(len(e))]) for p, e in projs.items()}
        out[f"{head}.mlp.experts.gate_up_proj"] = torch.cat(
            [stacked["gate_proj"], stacked["up_proj"]], dim=1
        )
        out[f"{head}.mlp.experts.down_proj"] = stacked["down_proj"]
    save_file(out, folder / "model.safetensors", metadata={"format": "pt"})


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lazy")
    dense, deepseek = _perturbed("tiny-dense"), _perturbed("tiny")
    out = {
        "dense": model_io.save_weights(dense.config, dense.state_dict(), root / "dense"),
        "hf": hf_io.export_hf(deepseek, deepseek.config, root / "hf"),
        "hf-fused": hf_io.export_hf(deepseek, deepseek.config, root / "hf-fused"),
    }
    _fuse_experts(out["hf-fused"])
    return out


# layout name -> (folder, mesh sizes)
LAYOUTS = {
    "dense tp=2": ("dense", dict(tp=2)),
    "dense pp=2": ("dense", dict(pp=2)),
    "deepseek hf ep=2": ("hf", dict(ep=2)),
    "deepseek hf fused ep=2": ("hf-fused", dict(ep=2)),
}


def _load_each(rank: int, world_size: int, folders: dict[str, Path]) -> dict[str, dict]:
    """Per layout: {name: elements read} of this rank's lazy load (and that it equals the
    eager load)."""
    log: dict[str, int] = {}
    real_open = lazy.safe_open
    lazy.safe_open = lambda *a, **kw: _CountingFile(real_open(*a, **kw), log)
    reads = {}
    try:
        for layout, (folder, sizes) in LAYOUTS.items():
            mesh = ParallelMesh.build(**sizes)
            config, state = model_io.open_pretrained(folders[folder])
            models = []
            for _ in range(2):
                if mesh.pp_size > 1:
                    models.append(build_pipeline_stage(config, mesh))
                else:
                    models.append(build_model(config, mesh=mesh))
            log.clear()
            load_full_state_dict(models[0], state)
            reads[layout] = dict(log)
            load_full_state_dict(models[1], model_io.load_pretrained(folders[folder])[1])
            lazy_state, eager_state = models[0].state_dict(), models[1].state_dict()
            for key, value in eager_state.items():
                assert torch.equal(lazy_state[key], value), (layout, key)
    finally:
        lazy.safe_open = real_open
    return reads


@pytest.fixture(scope="module")
def world(folders) -> list[dict[str, dict]]:
    return run_world(_load_each, 2, folders, timeout=120)


def _shapes(folder: Path) -> dict[str, torch.Size]:
    return {k: t.shape for k, t in lazy.open_safetensors(folder / "model.safetensors").items()}


def _half(rank: int, shape: torch.Size) -> int:
    """Elements of rank `rank`'s half of a [rows, ...] tensor split in 2 along some dim; a
    vocabulary of 257 rows is padded to 258, so rank 0 holds 129 rows, rank 1 only 128."""
    if shape[0] == VOCAB:
        return (129 if rank == 0 else 128) * shape.numel() // VOCAB
    return shape.numel() // 2


@pytest.mark.distributed
def test_tp2_rank_reads_its_rows_or_columns_and_whole_norms(world, folders):
    shapes = _shapes(folders["dense"])
    for rank, reads in enumerate(world):
        expected = {
            k: s.numel() if k.endswith("norm.weight") else _half(rank, s) for k, s in shapes.items()
        }
        assert reads["dense tp=2"] == expected, f"rank {rank}"
    split = [k for k in shapes if not k.endswith("norm.weight")]
    for key in split:  # between them the two ranks read each element once
        assert sum(r["dense tp=2"][key] for r in world) == shapes[key].numel(), key
    total = sum(s.numel() for s in shapes.values())
    for reads in world:
        assert 0.49 < sum(reads["dense tp=2"].values()) / total < 0.51


@pytest.mark.distributed
def test_pp2_rank_reads_only_its_stages_tensors(world, folders):
    shapes = _shapes(folders["dense"])
    stage0 = {k for k in shapes if k.startswith(("embed_tokens.", "layers.0."))}
    for rank, reads in enumerate(world):
        mine = stage0 if rank == 0 else set(shapes) - stage0
        assert reads["dense pp=2"] == {k: shapes[k].numel() for k in mine}, f"rank {rank}"


def _expert_of(key: str) -> int | None:
    parts = key.split(".mlp.experts.")
    return int(parts[1].split(".")[0]) if len(parts) == 2 and parts[1][0].isdigit() else None


@pytest.mark.distributed
def test_ep2_rank_reads_only_its_experts_of_a_transformers_folder(world, folders):
    shapes = _shapes(folders["hf"])
    config = json.loads((folders["hf"] / "config.json").read_text())
    assert config["n_routed_experts"] == EXPERTS
    mine = EXPERTS // 2
    for rank, reads in enumerate(world):
        expected = {}
        for key, shape in shapes.items():
            expert = _expert_of(key)
            if expert is None:
                expected[key] = shape.numel()
            elif expert // mine == rank:  # experts 0-3 on ep rank 0, 4-7 on ep rank 1
                expected[key] = shape.numel()
        assert reads["deepseek hf ep=2"] == expected, f"rank {rank}"
        experts = sum(s.numel() for k, s in shapes.items() if _expert_of(k) is not None)
        read = sum(v for k, v in reads["deepseek hf ep=2"].items() if _expert_of(k) is not None)
        assert read * 2 == experts


@pytest.mark.distributed
def test_ep2_rank_reads_its_experts_rows_of_a_fused_tensor(world, folders):
    shapes = _shapes(folders["hf-fused"])
    fused = [k for k in shapes if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]
    assert len(fused) == 4  # the MoE layer and the MTP layer, two tensors each
    for rank, reads in enumerate(world):
        got = reads["deepseek hf fused ep=2"]
        for key, shape in shapes.items():
            want = shape.numel() // 2 if key in fused else shape.numel()
            assert got[key] == want, (rank, key)
