"""With microbatches of different token counts (ignored labels), every strategy weighs them
by tokens over the whole global batch: DDP, MegatronStrategy dp=2, pp=2 (1F1B and DualPipeV)
give the losses and grad norms of one process."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils.data import Dataset

import nanotrain as nt
from nanotrain.strategies.megatron import MegatronStrategy
from tests.distributed.spawn import run_world
from tests.distributed.test_megatron import Recorder

pytestmark = pytest.mark.distributed

VOCAB, SEQ, STEPS = 257, 16, 3


class MaskedTokens(Dataset):
    """Random next-token items; sample i keeps only its first ``1 + (5 * i) % SEQ`` labels."""

    def __init__(self, n: int = 48) -> None:
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, VOCAB, (n, SEQ + 1), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        labels = self.ids[i, 1:].clone()
        labels[1 + (5 * i) % SEQ :] = -100
        return {"input_ids": self.ids[i, :-1], "labels": labels}


def fit(strategy: Any, root: str) -> dict[str, list[float]]:
    """`STEPS` steps of tiny-dense (4 layers), global batch 8, microbatch 2."""
    recorder = Recorder()
    module = nt.LanguageModelModule(
        "tiny-dense", vocab_size=VOCAB, lr=3e-3, warmup_steps=1, model_overrides={"num_layers": 4}
    )
    trainer = nt.Trainer(
        strategy=strategy,
        max_steps=STEPS,
        global_batch_size=8,
        micro_batch_size=2,
        callbacks=[recorder],
        default_root_dir=root,
        enable_checkpointing=False,  # nothing reads a checkpoint: no final save
        enable_progress_bar=False,
        loggers=[],
        seed=5,
    )
    trainer.fit(module, train_dataloaders=MaskedTokens())
    return {"losses": recorder.losses, "grad_norms": recorder.grad_norms}


def _layouts(rank: int, world_size: int, root: str) -> dict[str, dict]:
    return {
        "ddp": fit(nt.strategies.DDPStrategy(), f"{root}/ddp"),
        "megatron dp=2": fit(MegatronStrategy(), f"{root}/dp"),
        "megatron pp=2": fit(MegatronStrategy(pp=2), f"{root}/pp"),
        # the V: the loss on rank 0, which also embeds; split backwards
        "megatron pp=2 dualpipev": fit(MegatronStrategy(pp=2, schedule="dualpipev"), f"{root}/v"),
    }


def test_uneven_microbatches_are_weighed_by_tokens_under_every_layout(tmp_path):
    reference = fit(nt.SingleDeviceStrategy("cpu"), str(tmp_path / "reference"))
    results = run_world(_layouts, 2, str(tmp_path / "w2"), timeout=120)
    for rank, result in enumerate(results):
        for layout, got in result.items():
            what = f"{layout}, rank {rank}"
            torch.testing.assert_close(
                got["losses"], reference["losses"], rtol=1e-5, atol=0, msg=what
            )
            torch.testing.assert_close(
                got["grad_norms"], reference["grad_norms"], rtol=1e-5, atol=0, msg=what
            )
