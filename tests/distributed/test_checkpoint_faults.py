"""Damaged sharded checkpoints: every rank raises a clear error naming the file, none hangs.

One forked world of 2 ranks under MegatronStrategy(tp=2) saves the tiny DeepSeek once, then
tries to resume copies of that checkpoint damaged in one place each: the file only rank 1
reads flipped in the middle (same size), rank 1's model shard missing, a code-carrying pickle
as rank 1's state file, and a different model config.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

import nanotrain as nt
from nanotrain.callbacks.checkpoint import ModelCheckpoint
from nanotrain.checkpoint import files as ckpt_files
from tests.distributed.spawn import run_world
from tests.unit.test_language_model import RandomTokens

pytestmark = pytest.mark.distributed


def _fit(root: str, ckpt_path=None, save=False, **overrides) -> None:
    trainer = nt.Trainer(
        strategy=nt.MegatronStrategy(tp=2, timeout_s=20),
        max_steps=2 if save else 3,
        global_batch_size=2,
        micro_batch_size=2,
        default_root_dir=root,
        loggers=[],
        seed=3,
        callbacks=[ModelCheckpoint()] if save else [],
    )
    module = nt.LanguageModelModule(model="tiny", vocab_size=257, model_overrides=overrides)
    trainer.fit(module, train_dataloaders=RandomTokens(8, 257), ckpt_path=ckpt_path)


class _RunsCode:
    def __reduce__(self):
        return (os.system, ("true",))


def _damage(ckpt: Path, how: str) -> Path:
    copy = ckpt.parent / f"damaged-{how}"
    shutil.copytree(ckpt, copy)
    if how == "flipped":
        path = copy / "optim-rank-00001.safetensors"
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))
    elif how == "missing":
        (copy / "model-rank-00001.safetensors").unlink()
    elif how == "pickle":
        path = copy / "rank-00001.pt"
        torch.save({"rng": _RunsCode()}, path)
        meta = json.loads((copy / "meta.json").read_text())
        meta["files"][path.name] = path.stat().st_size
        meta["sha256"][path.name] = ckpt_files.sha256_of(path)
        (copy / "meta.json").write_text(json.dumps(meta))
    return copy


def _rank(rank: int, world_size: int, root: str) -> dict:
    _fit(f"{root}/run", save=True)
    ckpt = Path(root) / "run/default/version_0/checkpoints/step-00000002"
    out = {}
    for how in ("flipped", "missing", "pickle", "config"):
        if how != "config" and rank == 0:
            _damage(ckpt, how)
        torch.distributed.barrier()
        path = ckpt if how == "config" else ckpt.parent / f"damaged-{how}"
        overrides = {"num_layers": 3} if how == "config" else {}
        try:
            _fit(f"{root}/resume-{how}", ckpt_path=str(path), **overrides)
            out[how] = None
        except Exception as exc:  # noqa: BLE001 - reported to the test
            out[how] = f"{type(exc).__name__}: {exc}"
    return out


def test_damaged_checkpoints_fail_clearly_on_every_rank(tmp_path):
    results = run_world(_rank, 2, str(tmp_path), timeout=240)
    for rank, result in enumerate(results):
        flipped, missing, pickle, config = (
            result[k] for k in ("flipped", "missing", "pickle", "config")
        )
        assert flipped and "optim-rank-00001.safetensors is corrupt" in flipped, (rank, flipped)
        assert missing and "model-rank-00001.safetensors is missing" in missing, (rank, missing)
        assert pickle and pickle.startswith("UnsafeCheckpointError") and "GLOBAL" in pickle
        assert config and "num_layers: saved 2, now 3" in config, (rank, config)
    assert "failed on rank 1" in results[0]["flipped"]  # rank 0 names the rank that failed
