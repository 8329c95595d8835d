"""Why restarted workers failed under `torchrun --max-restarts` on gloo, reproduced without
torchrun: the elastic agent's shared store keeps the previous attempt's keys.

The test process plays the agent: it hosts one TCPStore for the whole job and sets the
environment torchrun gives its workers. Attempt 0 initializes a 2-rank gloo group and dies;
in attempt 1, rank 1 comes up late (as a slow restart does), so rank 0 reads rank 1's key
before it is rewritten. Through `nanotrain.strategies.rendezvous.init_process_group` the keys
of each attempt are apart and attempt 1 works; plain `dist.init_process_group` would connect
to the dead process's port ("connectFullMesh failed ... Connection refused").
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import time

import pytest
import torch
import torch.distributed as dist

from nanotrain.strategies.rendezvous import init_process_group

pytestmark = pytest.mark.distributed


def _worker(rank: int, attempt: int, port: int, late: float) -> None:
    torch.set_num_threads(1)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        TORCHELASTIC_USE_AGENT_STORE="True",
        TORCHELASTIC_RESTART_COUNT=str(attempt),
    )
    if rank == 1:
        time.sleep(late)
    init_process_group("gloo", rank, 2, datetime.timedelta(seconds=20))
    value = torch.ones(1)
    dist.all_reduce(value)
    os._exit(0 if value.item() == 2.0 else 1)  # no teardown: the attempt "dies"


def _attempt(attempt: int, port: int, late: float) -> list[int | None]:
    ctx = mp.get_context("fork")
    procs = [ctx.Process(target=_worker, args=(r, attempt, port, late)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=60)
        if p.is_alive():
            p.kill()
    return [p.exitcode for p in procs]


def test_a_restarted_worker_group_rejoins_the_agents_shared_store():
    # port 0: the OS picks a free port as the store binds it (no window for another process)
    agent_store = dist.TCPStore("127.0.0.1", 0, is_master=True, multi_tenant=True)
    port = agent_store.port
    assert _attempt(0, port, late=0.0) == [0, 0]
    assert _attempt(1, port, late=3.0) == [0, 0]
    del agent_store
