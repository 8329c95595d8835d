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

__all__ = ["init_process_group"]


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
