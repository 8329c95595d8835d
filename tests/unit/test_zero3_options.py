"""ZeRO-3's options and Lightning's FSDP spellings: what is accepted (with its meaning) and
what is refused at construction, by name, with what to use instead."""

from __future__ import annotations

import datetime

import pytest
from torch.distributed.fsdp import CPUOffload, ShardingStrategy

import nanotrain as nt
from nanotrain.strategies import resolve_strategy
from tests.unit.test_language_model import RandomTokens


def test_strategy_fsdp_is_zero3_over_every_rank():
    for name, offload in (("fsdp", False), ("fsdp_cpu_offload", True)):
        strategy = resolve_strategy(name, accelerator="cpu")
        assert isinstance(strategy, nt.FSDPStrategy)
        assert (strategy.zero_stage, strategy.tp, strategy.pp, strategy.ep) == (3, 1, 1, 1)
        assert strategy.cpu_offload is offload and strategy.backend == "gloo"
    assert isinstance(
        nt.Trainer(strategy="fsdp", accelerator="cpu", max_steps=1).strategy, nt.FSDPStrategy
    )


@pytest.mark.parametrize(
    ("sharding", "zero_stage", "reshard"),
    [
        ("FULL_SHARD", 3, True),
        (ShardingStrategy.FULL_SHARD, 3, True),
        ("SHARD_GRAD_OP", 3, False),
        (ShardingStrategy.SHARD_GRAD_OP, 3, False),
        ("NO_SHARD", 0, True),
    ],
)
def test_sharding_strategy_keeps_its_meaning(sharding, zero_stage, reshard):
    strategy = nt.FSDPStrategy(sharding_strategy=sharding)
    assert strategy.zero_stage == zero_stage
    assert strategy.reshard_after_forward is reshard


def test_lightning_arguments_that_map():
    strategy = nt.FSDPStrategy(
        cpu_offload=CPUOffload(offload_params=True),
        process_group_backend="gloo",
        timeout=datetime.timedelta(seconds=90),
        state_dict_type="sharded",
        mixed_precision=None,
        auto_wrap_policy=None,
        activation_checkpointing_policy=None,
    )
    assert strategy.cpu_offload and strategy.backend == "gloo" and strategy.timeout_s == 90
    assert not nt.FSDPStrategy(cpu_offload=CPUOffload(offload_params=False)).cpu_offload


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(sharding_strategy="HYBRID_SHARD"), "hybrid sharding"),
        (dict(sharding_strategy=ShardingStrategy._HYBRID_SHARD_ZERO2), "hybrid sharding"),
        (dict(sharding_strategy="ZERO9"), "unknown sharding_strategy"),
        (dict(state_dict_type="full"), "nanotrain export"),
        (dict(mixed_precision=object()), "Trainer\\(precision="),
        (dict(auto_wrap_policy={object}), "wraps every decoder layer"),
        (dict(activation_checkpointing_policy={object}), "recompute"),
        (dict(device_mesh=(2, 2)), "MegatronStrategy\\(tp="),
        (dict(limit_all_gathers=True), "limit_all_gathers=True"),
        (dict(sharding_strategy="NO_SHARD", cpu_offload=True), "cpu_offload=True needs"),
    ],
)
def test_lightning_arguments_refused_by_name(kwargs, message):
    with pytest.raises(ValueError, match=message):
        nt.FSDPStrategy(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            dict(zero_stage=3, pp=2, virtual_pp=2, overlap_forward_backward=True),
            "overlap_forward_backward=True is not supported",
        ),
        (dict(zero_stage=1, cpu_offload=True), "cpu_offload=True needs zero_stage=3"),
        (dict(zero_stage=2, reshard_after_forward=False), "needs zero_stage=3"),
        (dict(zero_stage=4), "zero_stage must be 0, 1, 2 or 3"),
        (dict(zero_stage=2, reduce_scatter_every_microbatch=True), "needs zero_stage=3 and pp=1"),
        (
            dict(zero_stage=3, pp=2, reduce_scatter_every_microbatch=True),
            "needs zero_stage=3 and pp=1",
        ),
    ],
)
def test_megatron_zero3_refusals(kwargs, message):
    with pytest.raises(ValueError, match=message):
        nt.MegatronStrategy(**kwargs)


def test_zero3_accepts_the_schedules_without_split_backwards():
    for schedule in ("gpipe", "1f1b"):
        assert nt.MegatronStrategy(zero_stage=3, pp=2, schedule=schedule).zero_stage == 3
    strategy = nt.MegatronStrategy(zero_stage=3, pp=2, virtual_pp=2)
    assert strategy.schedule == "interleaved_1f1b"


def test_zero3_on_one_process_trains_as_one_device(tmp_path):
    """Nothing to shard on one process: ZeRO-3 must give the one-device numbers."""

    def losses(strategy) -> list[float]:
        seen: list[float] = []

        class Record(nt.Callback):
            def on_train_step_end(self, trainer, module, outputs, batch, batch_idx) -> None:
                seen.append(float(outputs.loss))

        module = nt.LanguageModelModule("tiny-dense", vocab_size=64, lr=1e-2, warmup_steps=1)
        trainer = nt.Trainer(
            strategy=strategy,
            max_steps=2,
            global_batch_size=4,
            micro_batch_size=2,
            default_root_dir=str(tmp_path / type(strategy).__name__),
            loggers=[],
            seed=1,
            callbacks=[Record()],
            enable_checkpointing=False,
        )
        trainer.fit(module, train_dataloaders=RandomTokens(8, 64))
        return seen

    one = losses(nt.SingleDeviceStrategy("cpu"))
    assert losses(nt.FSDPStrategy(process_group_backend="gloo")) == pytest.approx(one, rel=1e-6)
