"""Run by tests/integration/test_interrupt.py in a pytest of its own, which it then interrupts
(the file name keeps it out of the suite). One test fails at once; the other holds a forked
gloo world and a process tree shaped like a torchrun job (a worker in a session of its own),
each of which would run for five minutes. Every process notes its pid in the file named by
NANOTRAIN_INTERRUPT_PIDS, so the interrupting test can check that none outlives the run."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from tests.distributed.spawn import run_world

HOLD = 300  # seconds: far beyond any bound the interrupting test allows


def _note(what: str) -> None:
    with open(os.environ["NANOTRAIN_INTERRUPT_PIDS"], "a") as f:
        f.write(f"{what}\n")


def test_fails_before_the_interrupt():
    _note("failed")
    raise AssertionError("planted failure, to be listed in the summary")


def _hold(rank: int, world_size: int) -> None:
    _note(str(os.getpid()))
    time.sleep(HOLD)


def test_holds_a_process_tree_and_a_world():
    # an agent whose worker lives in a session of its own (torchrun's shape), then a world
    agent = (
        "import os, subprocess, sys, time\n"
        f"w = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep({HOLD})'], "
        "start_new_session=True)\n"
        "open(os.environ['NANOTRAIN_INTERRUPT_PIDS'], 'a').write(f'{os.getpid()}\\n{w.pid}\\n')\n"
        f"time.sleep({HOLD})\n"
    )
    tree = subprocess.Popen([sys.executable, "-c", agent])
    try:
        run_world(_hold, 2, timeout=2 * HOLD)
    finally:
        tree.kill()
