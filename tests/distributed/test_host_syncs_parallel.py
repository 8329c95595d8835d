"""Non-logging training steps wait for the device nowhere under DDP and MegatronStrategy
(tp, sequence parallel, pp with 1F1B, ZeRO-2, and ep with a capacity factor), as on one device
(tests/unit/test_host_syncs.py). Dropless expert parallelism is left out on purpose: its
all-to-all takes the exchanged split sizes as host ints (docs/performance.md).

Each layout fits the tiny MoE model on a 2-rank gloo world with the fused AdamW that
`optimizer_impl="auto"` picks on CUDA and the device-offset expert path CUDA bf16 takes, and
records every host read (`nanotrain.runtime.sync_guard.HostSyncCounter`) during steps 2 and 3 of 4.
"""

from __future__ import annotations

from collections import Counter

import pytest

import nanotrain as nt
import nanotrain.models.expert_compute as expert_compute
from nanotrain.strategies.megatron import MegatronStrategy
from tests.distributed.spawn import run_world
from tests.unit.test_callbacks_moe_load import RandomTokens
from tests.unit.test_host_syncs import ALLOWED, _Record

LAYOUTS = {
    "ddp": lambda: nt.DDPStrategy(),
    "tp=2 sp": lambda: MegatronStrategy(tp=2, sequence_parallel=True),
    "pp=2 1f1b": lambda: MegatronStrategy(pp=2),
    "dp=2 zero2": lambda: MegatronStrategy(zero_stage=2),
    "ep=2 capacity": lambda: MegatronStrategy(ep=2),
}
# fixed-size expert slots (`nanotrain.models.capacity_dispatch`) need no split exchange
OVERRIDES = {"ep=2 capacity": {"capacity_factor": 1.0}}


def _syncs(rank: int, world_size: int, root: str) -> dict[str, list]:
    expert_compute.grouped_mm_available = lambda x, w: True  # this forked rank only
    expert_compute.reads_sizes_first = lambda x: False
    found = {}
    for i, (name, make) in enumerate(LAYOUTS.items()):
        module = nt.LanguageModelModule(
            model="tiny",
            vocab_size=257,
            optimizer_impl="fused",
            model_overrides=OVERRIDES.get(name, {}),
        )
        record = _Record(steps=(1, 2))  # steps 2 and 3 of 4: 1 and 4 log
        trainer = nt.Trainer(
            strategy=make(),
            max_steps=4,
            global_batch_size=8,
            micro_batch_size=2,
            default_root_dir=f"{root}/{i}",
            loggers=["jsonl"],
            log_every_n_steps=100,
            callbacks=[record],
        )
        trainer.fit(module, train_dataloaders=RandomTokens(32))
        found[name] = [r for r in record.records if not r[1].endswith(ALLOWED)]
    return found


@pytest.fixture(scope="module")
def world2(tmp_path_factory) -> list[dict]:
    return run_world(_syncs, 2, str(tmp_path_factory.mktemp("syncs")), timeout=240)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_non_logging_steps_have_no_host_sync(world2, layout):
    for rank, found in enumerate(world2):
        assert not found[layout], f"{layout}, rank {rank}: {dict(Counter(found[layout]))}"
