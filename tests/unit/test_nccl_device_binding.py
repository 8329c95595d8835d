"""The strategies bind an NCCL default group to their GPU (`device_id`), and only NCCL ones
(checked with `torch.distributed.init_process_group` stubbed: no GPU here)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import nanotrain as nt


class _Stop(Exception):
    """Raised by the stub: the test needs only the call's arguments."""


@pytest.fixture
def init_calls(monkeypatch):
    calls = []

    def fake_init(backend, **kwargs):
        calls.append((backend, kwargs))
        raise _Stop

    monkeypatch.setattr(dist, "init_process_group", fake_init)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    for name, value in {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    return calls


both_strategies = pytest.mark.parametrize(
    "make",
    [lambda b: nt.DDPStrategy(backend=b), lambda b: nt.MegatronStrategy(backend=b)],
    ids=["ddp", "megatron"],
)


def joined(strategy, init_calls) -> tuple[str, dict]:
    """Run `strategy`'s setup up to the stubbed init; the backend and arguments it passed."""
    with pytest.raises(_Stop):
        strategy.setup_environment()
    ((backend, kwargs),) = init_calls
    return backend, kwargs


@both_strategies
def test_nccl_group_is_bound_to_the_local_gpu(init_calls, make):
    # rank 5 of 8 with LOCAL_RANK 1 drives GPU 1 (its node's second), not GPU 5
    backend, kwargs = joined(make("nccl"), init_calls)
    assert backend == "nccl" and kwargs["rank"] == 5 and kwargs["world_size"] == 8
    assert kwargs["device_id"] == torch.device("cuda", 1)


@both_strategies
def test_gloo_group_gets_no_device(init_calls, make):
    backend, kwargs = joined(make("gloo"), init_calls)
    assert backend == "gloo" and "device_id" not in kwargs


def test_without_local_rank_the_global_rank_names_the_gpu(init_calls, monkeypatch):
    monkeypatch.delenv("LOCAL_RANK")
    _, kwargs = joined(nt.DDPStrategy(backend="nccl"), init_calls)
    assert kwargs["device_id"] == torch.device("cuda", 5)


@both_strategies
def test_a_gpu_index_beyond_the_visible_ones_is_refused_before_joining(
    init_calls, monkeypatch, make
):
    # LOCAL_RANK 1 with one visible GPU (e.g. CUDA_VISIBLE_DEVICES narrowed per process):
    # a clear error before any rendezvous, instead of NCCL's invalid device ordinal
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match="drives GPU 1 .* but 1 GPU"):
        make("nccl").setup_environment()
    assert init_calls == []


def test_restarted_worker_on_the_agent_store_is_bound_too(init_calls, monkeypatch):
    # under torchrun's shared store a restarted worker joins through a per-attempt prefix
    # store (rendezvous.py); that path must pass the GPU as well
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    monkeypatch.setattr(dist, "TCPStore", lambda *a, **k: "agent store")
    monkeypatch.setattr(dist, "PrefixStore", lambda prefix, store: (prefix, store))
    _, kwargs = joined(nt.DDPStrategy(backend="nccl"), init_calls)
    assert kwargs["store"] == ("nanotrain/restart_2", "agent store")
    assert kwargs["device_id"] == torch.device("cuda", 1) and kwargs["rank"] == 5
