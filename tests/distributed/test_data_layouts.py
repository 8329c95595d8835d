"""Blends and streams reach the model as the same global batches under every layout.

One process is the reference. A blend of two prepared corpora (70/30) trains 3 steps and is
validated; under dp=2 (DDP), tp=2, pp=2 and ep=2 (world 2) and dp=4 (world 4) the per-step
losses and grad norms and `val/loss`, `val/loss/a`, `val/loss/b` match it. A stream (an
`IterableDataset`) under dp=2 and dp=4 matches the one-process run of the map-style dataset of
the same samples in order, its replicas train on disjoint samples that make up the
global batch, and under dp=2 it resumes from a checkpoint exactly.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

import nanotrain as nt
from nanotrain.data import TokenDataModule
from nanotrain.strategies.megatron import MegatronStrategy
from tests.distributed.spawn import run_world
from tests.unit.test_data_blend import SEQ, make_corpora
from tests.unit.test_data_streaming import Samples, StatefulStream

pytestmark = pytest.mark.distributed

STEPS = 3
VAL_KEYS = ("val/loss", "val/loss/a", "val/loss/b")


class Seen(nt.Callback):
    """Per step: the loss, the grad norm, and the first token ids of this rank's samples."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.grad_norms: list[float] = []
        self.samples: list[list[list[int]]] = []

    def on_train_step_start(self, trainer, module, microbatches, step_idx) -> None:
        self.samples.append([row[:4].tolist() for b in microbatches for row in b["input_ids"]])

    def on_train_step_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(outputs.loss))
        self.grad_norms.append(float(outputs.grad_norm))


def fit(
    strategy: Any, root: str, data: Any, steps: int = STEPS, ckpt_path: str | None = None
) -> dict[str, Any]:
    """`steps` steps (global batch 8, micro batch 2) of the tiny DeepSeek preset, saving a
    checkpoint at the end; a TokenDataModule is validated after."""
    seen = Seen()
    module = nt.LanguageModelModule("tiny", vocab_size=257, warmup_steps=1, lr=1e-3, eps=1e-6)
    trainer = nt.Trainer(
        strategy=strategy,
        max_steps=steps,
        global_batch_size=8,
        micro_batch_size=2,
        callbacks=[seen],
        default_root_dir=root,
        loggers=[],
        limit_val_batches=0,
        seed=3,
    )
    if isinstance(data, TokenDataModule):
        trainer.fit(module, datamodule=data)
        trainer.settings.limit_val_batches = None
        metrics = trainer.validate(module, data, verbose=False)[0]
        val = [float(metrics[k]) for k in VAL_KEYS]
    else:
        trainer.fit(module, train_dataloaders=data, ckpt_path=ckpt_path)
        val = []
    return {"losses": seen.losses, "grad_norms": seen.grad_norms, "val": val, "seen": seen.samples}


def _blend(corpora: str) -> TokenDataModule:
    return TokenDataModule({f"{corpora}/a": 0.7, f"{corpora}/b": 0.3}, seq_len=SEQ)


def _stream() -> DataLoader:
    return DataLoader(StatefulStream(40), batch_size=2)


def assert_same(got: dict, ref: dict, what: str) -> None:
    torch.testing.assert_close(got["losses"], ref["losses"], rtol=1e-5, atol=0, msg=what)
    torch.testing.assert_close(got["grad_norms"], ref["grad_norms"], rtol=1e-5, atol=0, msg=what)
    torch.testing.assert_close(got["val"], ref["val"], rtol=1e-5, atol=0, msg=what)


def _world(rank: int, world_size: int, root: str, corpora: str) -> dict[str, dict]:
    if world_size == 2:
        blends = {
            "ddp dp=2": nt.strategies.DDPStrategy,
            "tp=2": lambda: MegatronStrategy(tp=2),
            "pp=2": lambda: MegatronStrategy(pp=2),
            "ep=2": lambda: MegatronStrategy(ep=2),
        }
    else:
        blends = {"megatron dp=4": MegatronStrategy}
    out = {
        f"blend {n}": fit(s(), f"{root}/b{i}", _blend(corpora))
        for i, (n, s) in enumerate(blends.items())
    }
    stream = fit(nt.strategies.DDPStrategy(), f"{root}/s", _stream())
    if world_size == 2:  # saved after step 2 by 2 replicas, resumed by 2: step 3 as straight
        fit(nt.strategies.DDPStrategy(), f"{root}/r", _stream(), steps=2)
        resumed = fit(nt.strategies.DDPStrategy(), f"{root}/r", _stream(), ckpt_path="last")
        assert resumed["losses"] == stream["losses"][2:], (resumed["losses"], stream["losses"])
    # the stream's samples this step, over all replicas: gathered for the test
    shares: list[Any] = [None] * world_size
    dist.all_gather_object(shares, stream["seen"])
    out[f"stream dp={world_size}"] = dict(stream, shares=shares)
    return out


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    return make_corpora(tmp_path_factory.mktemp("blend"))


def test_blends_and_streams_are_the_same_global_batches_under_every_layout(tmp_path, corpora):
    torch.set_num_threads(1)
    blend_ref = fit(nt.SingleDeviceStrategy("cpu"), str(tmp_path / "ref"), _blend(corpora))
    assert blend_ref["val"][1] != pytest.approx(blend_ref["val"][2], rel=1e-3)
    # the stream's reference: the map-style dataset of the same 40 samples, in order
    map_ref = fit(nt.SingleDeviceStrategy("cpu"), str(tmp_path / "map"), DataLoader(Samples(40), 2))
    one = fit(nt.SingleDeviceStrategy("cpu"), str(tmp_path / "one"), _stream())
    assert one["losses"] == map_ref["losses"]
    for world in (2, 4):
        results = run_world(_world, world, str(tmp_path / f"w{world}"), str(corpora), timeout=400)
        for rank, result in enumerate(results):
            for layout, got in result.items():
                ref = blend_ref if layout.startswith("blend") else map_ref
                assert_same(got, ref, f"{layout}, rank {rank}")
        shares = results[0][f"stream dp={world}"]["shares"]
        for step in range(STEPS):
            rows = [row for share in shares for row in share[step]]
            assert len(rows) == 8 and len({tuple(r) for r in rows}) == 8  # no repeats
            assert sorted(rows) == sorted(map_ref["seen"][step])  # the global batch
