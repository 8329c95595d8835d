"""The planner's ZeRO-3 figures equal what `MegatronStrategy(zero_stage=3)` (FSDP2) really
allocates and sends on every rank.

Each layout trains one step of two microbatches per rank on a forked world of 4 (two tell
the gathers of every microbatch from the reduce-scatter of the last one). Every rank reports
the bytes of the storages behind its parameter shards (after the step), its gradient shards
(before the optimizer step, once reduced), its optimizer state and buffers, the gathered
copies a split-backward schedule leaves until the reduce-scatter, and the wire bytes and calls
of FSDP2's all-gathers and reduce-scatters on dp and expert-dp (a `CommMeter` from the first
forward to the optimizer step). The planner, which never ran the model, must give the same
numbers, byte for byte.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils.data import Dataset

import nanotrain as nt
from nanotrain.models import presets
from nanotrain.planning import CommMeter, PlanLayout, Workload, comm_estimate, rank_models
from nanotrain.planning.memory import (
    element_size,
    gather_dtype,
    state_memory,
    zero3_optimizer_pieces,
)
from nanotrain.planning.zero3 import kept_gathered_bytes
from nanotrain.strategies.megatron import MegatronStrategy
from tests.distributed.spawn import run_world

pytestmark = pytest.mark.distributed

VOCAB, SEQ, MICRO = 97, 16, 2

# 6 routed experts: 3 per ep=2 rank, split 2 + 1 over expert-dp=2 (uneven shards, so the
# test tells which expert-dp rank each data-parallel rank is); vocab 97 splits unevenly
SIX_EXPERTS = dict(n_routed_experts=6, n_group=2, topk_group=1)
# name -> (preset, model overrides, MegatronStrategy kwargs, precision). What each pins:
LAYOUTS: dict[str, tuple[str, dict, dict, str]] = {
    # DTensor tp shards under FSDP2, gathers in bf16, fp32 reduce-scatters and shards
    "dense tp=2 sp x dp=2 bf16-true": (
        "tiny-dense",
        {},
        dict(tp=2, sequence_parallel=True, zero_stage=3),
        "bf16-true",
    ),
    # expert-dp units beside dp=4 ones (the dense part's uneven shards over 4 ranks), a
    # reduce-scatter on every microbatch
    "deepseek ep=2 x dp=4, reduce-scatter every microbatch": (
        "tiny",
        SIX_EXPERTS,
        dict(ep=2, zero_stage=3, reduce_scatter_every_microbatch=True),
        "32-true",
    ),
    # each stage's own units under 1F1B, nothing left gathered; cpu_offload: the shards,
    # their grads and the optimizer state on the host, the plan's host bytes (a pipeline
    # stage's shards on the device: the zb_1f1b layout)
    "dense pp=2 x dp=2 cpu_offload": (
        "tiny-dense",
        {"num_layers": 4},
        dict(pp=2, zero_stage=3, cpu_offload=True),
        "32-true",
    ),
    # a split-backward schedule: every unit keeps its gathered parameters from its backward
    # until the step's reduce-scatter
    "dense pp=2 x dp=2 zb_1f1b": (
        "tiny-dense",
        {"num_layers": 4},
        dict(pp=2, zero_stage=3, schedule="zb_1f1b"),
        "32-true",
    ),
}
#: FSDP2's collectives (the rest on dp is the step's bookkeeping)
FSDP_OPS = (
    "all_gather_into_tensor",
    "all_gather_single",
    "reduce_scatter_tensor",
    "reduce_scatter_single",
)


class Tokens(Dataset):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(i)
        ids = torch.randint(0, VOCAB, (SEQ + 1,), generator=g)
        return {"input_ids": ids[:-1], "labels": ids[1:]}


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _storage_bytes(tensors: list[torch.Tensor]) -> int:
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def _gathered_storage_bytes(runner: Any) -> int:
    """Bytes of the allocated storages behind FSDP2's gathered (unsharded) parameters."""
    from torch.distributed.fsdp import fully_shard

    storages: dict[int, int] = {}
    for unit_state in fully_shard.state(runner)._state_ctx.all_states:
        for group in unit_state._fsdp_param_groups:
            for fsdp_param in group.fsdp_params:
                if hasattr(fsdp_param, "_unsharded_param"):
                    storage = fsdp_param._unsharded_param.untyped_storage()
                    storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


class Snapshot(nt.Callback):
    """What the rank holds and sends in its first step."""

    def __init__(self) -> None:
        self.seen: dict[str, Any] = {}
        self.meter: CommMeter | None = None

    def on_train_start(self, trainer, module) -> None:
        self.meter = CommMeter.for_strategy(trainer.strategy)
        self.meter.__enter__()
        fsdp = trainer.strategy._fsdp
        finish = fsdp.finish

        def measured_finish() -> None:  # the gathered copies the schedule left behind
            self.seen["kept_gathered"] = _gathered_storage_bytes(fsdp.runner)
            finish()

        fsdp.finish = measured_finish

    def on_before_optimizer_step(self, trainer, module, optimizer) -> None:
        assert self.meter is not None
        self.meter.__exit__(None, None, None)
        params = [p for _, p in trainer.strategy._fsdp.named]
        self.seen["grads"] = _storage_bytes([_local(p.grad) for p in params])
        for group in ("dp", "expert_dp"):
            events = [e for e in self.meter.events if e.group == group and e.op in FSDP_OPS]
            self.seen[f"{group}_wire"] = sum(e.bytes for e in events)
            self.seen[f"{group}_calls"] = len(events)

    def on_train_step_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        strategy = trainer.strategy
        params = [p for _, p in strategy._fsdp.named]
        self.seen.update(
            pp_rank=strategy.mesh.pp_rank,
            dp_rank=strategy.mesh.dp_rank,
            params=_storage_bytes([_local(p) for p in params]),
            buffers=sum(b.numel() * b.element_size() for b in module.buffers()),
            optimizer=sum(
                _local(v).numel() * v.element_size()
                for state in strategy.optimizer.state.values()
                for v in state.values()
                if isinstance(v, torch.Tensor)
            ),
        )


def _global_batch(kwargs: dict) -> int:
    """Two microbatches on each of the layout's dp ranks (the world of 4 over tp and pp)."""
    return 2 * MICRO * 4 // (kwargs.get("tp", 1) * kwargs.get("pp", 1))


def _run(rank: int, world_size: int, root: str) -> dict:
    out = {}
    for i, (name, (preset, overrides, kwargs, precision)) in enumerate(LAYOUTS.items()):
        module = nt.LanguageModelModule(preset, model_overrides=overrides, vocab_size=VOCAB)
        trainer = nt.Trainer(
            strategy=MegatronStrategy(**kwargs),
            precision=precision,
            max_steps=1,
            global_batch_size=_global_batch(kwargs),
            micro_batch_size=MICRO,
            default_root_dir=f"{root}/{i}",
            loggers=[],
            callbacks=[snapshot := Snapshot()],
            # it reads what the step holds and sends: no final checkpoint, bar or monitors
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_monitors=False,
            seed=0,
        )
        trainer.fit(module, train_dataloaders=Tokens())
        out[name] = snapshot.seen
    return out


def _plan_inputs(name: str) -> tuple[Any, PlanLayout, Workload]:
    preset, overrides, kwargs, precision = LAYOUTS[name]
    config = presets.get(preset, vocab_size=VOCAB, **overrides)
    layout = PlanLayout.from_strategy(MegatronStrategy(**kwargs), world_size=4)
    workload = Workload(SEQ, MICRO, _global_batch(kwargs), precision)
    return config, layout, workload


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> list[dict]:
    return run_world(_run, 4, str(tmp_path_factory.mktemp("plan_zero3")), timeout=300)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_planned_zero3_state_equals_what_each_rank_allocates(world, name):
    config, layout, workload = _plan_inputs(name)
    assert layout.zero_stage == 3 and layout.cpu_offload == ("offload" in name)
    ranks = rank_models(config, layout)
    for result in world:
        got = result[name]
        rank = ranks[got["pp_rank"]]
        state = state_memory(rank, layout, workload)
        # what the GPU would hold, or under cpu_offload the host: the same shards
        on_gpu = state.params - rank.buffer_bytes + state.grads + state.optimizer
        held = state.host if layout.cpu_offload else on_gpu
        elements, tensors = zero3_optimizer_pieces(rank, layout)[got["dp_rank"]]
        optimizer = 2 * 4 * elements + 4 * tensors  # AdamW: two fp32 moments + a step each
        assert got["buffers"] == rank.buffer_bytes, name
        # every rank allocates the padded fp32 shards (bf16-true too), whatever rows it holds
        assert got["params"] == got["grads"], name
        assert got["optimizer"] == optimizer, name
        if got["dp_rank"] == 0:  # the rank the plan prices: the first rows are the full ones
            assert 2 * got["params"] + got["optimizer"] == held, name
        if not layout.cpu_offload:
            assert got["params"] + got["buffers"] == state.params, name
        if layout.pp > 1:  # what the schedule leaves gathered until the reduce-scatter
            kept = kept_gathered_bytes(rank, layout, element_size(gather_dtype(workload.precision)))
            assert got["kept_gathered"] == kept, name
            assert (kept > 0) == ("zb_1f1b" in name), name


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_planned_zero3_collectives_equal_what_each_rank_sends(world, name):
    """Per step: every microbatch all-gathers the root once and each layer and expert stack
    twice (forward, backward); one reduce-scatter per unit, on the last microbatch (or on
    every one). Under zb_1f1b the root once per step and each layer once per microbatch and
    once more (its copies kept from each backward until the next forward frees them). Each
    pipeline stage prices its own units."""
    config, layout, workload = _plan_inputs(name)
    for result in world:
        got = result[name]
        comm = comm_estimate(config, layout, workload, pp_rank=got["pp_rank"])
        for group in ("dp", "expert_dp"):
            assert got[f"{group}_wire"] == comm.bytes_per_step[group], (name, group)
            assert got[f"{group}_calls"] == comm.calls_per_step[group], (name, group)
