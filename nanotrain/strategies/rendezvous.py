"""Joining the default process group so that `torchrun --max-restarts N` can restart workers.

Under torchrun (torch 2.13) every worker's store is a client of one TCPStore that the elastic
agent hosts for the whole job (`TORCHELASTIC_USE_AGENT_STORE=True`), and a restarted worker
group connects to the *same* store on the same port, with no per-attempt key prefix. The keys
the previous attempt's ranks left behind (e.g. gloo's address of every rank) are still there:
a restarted rank that reads a peer's key before that peer rewrote it connects to the dead
process's old port and fails in `init_process_group` with gloo's "connectFullMesh failed ...
Connection refused" (measured: about one restart in three on 2 ranks). Prefixing every key
with the restart count (`TORCHELASTIC_RESTART_COUNT`) keeps each attempt's keys apart.

Plain scripts (without nanotrain's strategies) get the same effect by launching torchrun with
`TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`: then rank 0 hosts a fresh store on a new port at
every attempt.
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "LaunchedRanks",
    "default_group_timeout_s",
    "env_int",
    "init_process_group",
    "join_process_group",
    "launched_local_rank",
    "launched_rank",
    "launched_world_size",
    "process_device",
]


def init_process_group(
    backend: str,
    rank: int | None,
    world_size: int | None,
    timeout: datetime.timedelta,
    local_rank: int | None = None,
) -> None:
    """`dist.init_process_group(backend, rank, world_size, timeout)` from torchrun's
    environment (MASTER_ADDR/MASTER_PORT), with a store whose keys are private to this restart
    attempt when the elastic agent shares its store with the workers.

    On NCCL the group is bound to GPU `local_rank` (`device_id`, default: `rank`): NCCL then
    sets up its communicator at once, on the right GPU, rather than at the first collective,
    subgroups are split from it, and `barrier()` knows its device instead of guessing (torch
    warns "devices used by this process are currently unknown" without it).

    Raises:
        ValueError: on NCCL, when that GPU index is not among the GPUs this process sees."""
    kwargs = dict(rank=rank, world_size=world_size, timeout=timeout)
    if backend == "nccl":
        index = rank if local_rank is None else local_rank
        visible = torch.cuda.device_count()
        if index is not None and index >= visible:
            raise ValueError(
                f"this process drives GPU {index} (LOCAL_RANK, else RANK) but {visible} GPU(s) "
                "are visible to it; launch at most that many processes per node "
                "(`torchrun --nproc-per-node`), and do not narrow CUDA_VISIBLE_DEVICES to one "
                "GPU per process (LOCAL_RANK indexes the GPUs each process sees)"
            )
        kwargs["device_id"] = torch.device("cuda", index)
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    shared = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)
    if not (shared and restart is not None and rank is not None and world_size is not None):
        dist.init_process_group(backend, **kwargs)
        return
    client = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world_size=world_size,
        is_master=False,
        timeout=timeout,
    )
    store = dist.PrefixStore(f"nanotrain/restart_{restart}", client)
    dist.init_process_group(backend, store=store, **kwargs)


def env_int(name: str) -> int | None:
    """An integer environment variable set by the launcher (RANK, WORLD_SIZE, ...), or None."""
    value = os.environ.get(name)
    return None if value is None else int(value)


def launched_rank() -> int:
    """This process's global rank: the default group's, else torchrun's RANK, else 0."""
    return dist.get_rank() if dist.is_initialized() else (env_int("RANK") or 0)


def launched_local_rank() -> int:
    """This process's rank on its machine (which GPU it drives): LOCAL_RANK, else the rank."""
    local = env_int("LOCAL_RANK")
    return launched_rank() if local is None else local


def launched_world_size() -> int:
    """Processes in the job: the default group's size, else WORLD_SIZE, else 1."""
    return dist.get_world_size() if dist.is_initialized() else (env_int("WORLD_SIZE") or 1)


class LaunchedRanks:
    """Mixin for a strategy whose ranks are the launcher's processes: `global_rank`,
    `local_rank` and `world_size` from the default group or torchrun's environment."""

    @property
    def global_rank(self) -> int:
        return launched_rank()

    @property
    def local_rank(self) -> int:
        return launched_local_rank()

    @property
    def world_size(self) -> int:
        return launched_world_size()


def join_process_group(who: str, backend: str | None, timeout_s: float) -> bool:
    """Join the default process group from the launcher's environment unless this process
    already is in one (a user's own group is used as it is). Backend: `backend`, else NCCL
    with CUDA, else gloo. Returns True when this call created the group (the caller then
    destroys it at teardown).

    Raises:
        ValueError: RANK or WORLD_SIZE is not set (`who` names the strategy in the message),
            or as `init_process_group`.
    """
    if dist.is_initialized():
        return False
    for name in ("RANK", "WORLD_SIZE"):
        if env_int(name) is None:
            raise ValueError(
                f"{who} needs the environment variable {name}; launch with "
                "`torchrun --nproc-per-node N ...` (or set RANK, WORLD_SIZE, LOCAL_RANK, "
                "MASTER_ADDR, MASTER_PORT yourself)"
            )
    init_process_group(
        backend or ("nccl" if torch.cuda.is_available() else "gloo"),
        rank=env_int("RANK"),
        world_size=env_int("WORLD_SIZE"),
        timeout=datetime.timedelta(seconds=timeout_s),
        local_rank=launched_local_rank(),
    )
    return True


#: the collective timeout of a process group a strategy creates itself (torch's default)
DEFAULT_TIMEOUT_S = 1800.0


def default_group_timeout_s() -> float | None:
    """The collective timeout of the default process group this process is already in (one
    the user or a test harness made), or None (no group, or torch does not tell)."""
    if not dist.is_initialized():
        return None
    try:
        device = torch.device("cuda" if dist.get_backend() == "nccl" else "cpu")
        backend = dist.distributed_c10d._get_default_group()._get_backend(device)
        return float(backend.options._timeout.total_seconds())
    except Exception:  # noqa: BLE001 - private attributes: fall back to the default
        return None


def process_device(backend: str | None) -> torch.device:
    """The device this process trains on, made current: GPU LOCAL_RANK under an NCCL group
    (or, with no group, whenever CUDA is there and `backend` is not "gloo"), else the CPU."""
    if dist.is_initialized():
        use_cuda = dist.get_backend() == "nccl"
    else:
        use_cuda = torch.cuda.is_available() and backend != "gloo"
    if not use_cuda:
        return torch.device("cpu")
    device = torch.device("cuda", launched_local_rank())
    torch.cuda.set_device(device)
    return device
