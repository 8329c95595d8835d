"""Suite-wide settings: one intra-op thread per process; Ctrl-C stops the whole run.

The suite runs on 2 shared cores; tiny models gain nothing from a thread pool, and several
pools (pytest plus spawned ranks or CLI subprocesses) oversubscribe the cores badly.
``NANOTRAIN_TEST_THREADS=2`` runs the single-process references with two threads instead (the
ranks of a forked world keep one, see tests/distributed/spawn.py): the numerical bounds must
hold whatever the reference's reduction order. ``NANOTRAIN_NUMERICS_LOG=FILE`` records how much
of each tolerance every comparison uses (tests/numerics_log.py). SIGINT handling and the
controlling process's child subreaper end every worker, world and subprocess within seconds of
Ctrl-C (tests/process_tree.py; tests/integration/test_interrupt.py proves it).
"""

import builtins
import compileall
import os
import signal
from pathlib import Path

import pytest
import torch

torch.set_num_threads(int(os.environ.get("NANOTRAIN_TEST_THREADS", "1")))
if os.environ.get("NANOTRAIN_NUMERICS_LOG"):
    from tests import numerics_log

    numerics_log.install(os.environ["NANOTRAIN_NUMERICS_LOG"])


@pytest.fixture(autouse=True)
def no_global_seed(monkeypatch):
    """Every test starts without Lightning's global seed and leaves none behind: a test that
    calls `lightning.seed_everything` would otherwise decide the seed of every later test in
    its process (setenv first: delenv of an unset variable records nothing to put back)."""
    for name in ("PL_GLOBAL_SEED", "PL_SEED_WORKERS"):
        monkeypatch.setenv(name, "0")
        monkeypatch.delenv(name)


@pytest.fixture
def failing_import(monkeypatch):
    """`failing_import(prefix, error)`: from now on, importing a module whose name starts
    with `prefix` raises `error` (as a missing or broken optional package would)."""
    real_import = builtins.__import__

    def install(prefix: str, error: BaseException) -> None:
        def fake_import(name, *args, **kwargs):
            if name.startswith(prefix):
                raise error
            return real_import(name, *args, **kwargs)

        monkeypatch.setattr(builtins, "__import__", fake_import)

    return install


def _interrupt_once(signum, frame):
    """SIGINT in an xdist worker: KeyboardInterrupt once (the test's cleanup kills its world
    and subprocesses, then the worker reports what ran); a second SIGINT (the terminal's and
    the controller's copy of one Ctrl-C) must not break off that cleanup."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    raise KeyboardInterrupt


def _controller_interrupt(signum, frame):
    """SIGINT in the controlling pytest: pass it on to the direct children (xdist workers, which
    then stop their test and report), kill everything below them (forked ranks, torchrun jobs:
    nothing of theirs is worth waiting for), then KeyboardInterrupt, after which pytest prints
    what failed so far. A second Ctrl-C kills every process left."""
    from tests.process_tree import children, kill_descendants

    if getattr(_controller_interrupt, "seen", False):
        kill_descendants()
    else:
        _controller_interrupt.seen = True
        workers = children()
        for pid in workers:
            try:
                os.kill(pid, signal.SIGINT)
            except ProcessLookupError:
                pass
        if _XDIST_CONTROLLER:  # with `-n 0` the children are the running test's own
            kill_descendants(spare=workers)
    raise KeyboardInterrupt


_XDIST_CONTROLLER = False


def _stop_everything_on_ctrl_c(config) -> None:
    """Ctrl-C ends the whole run within seconds: see tests/process_tree.py and spawn.py."""
    if hasattr(config, "workerinput"):
        signal.signal(signal.SIGINT, _interrupt_once)
        return
    from tests.process_tree import become_subreaper

    become_subreaper()  # orphans (a killed worker's ranks, torchrun's workers) stay reachable
    signal.signal(signal.SIGINT, _controller_interrupt)
    global _XDIST_CONTROLLER
    _XDIST_CONTROLLER = bool(getattr(config.option, "numprocesses", None))


@pytest.hookimpl(tryfirst=True)
def pytest_sessionfinish(session, exitstatus):
    """Interrupted under xdist: give the workers a moment to report and exit, then kill them,
    before xdist's teardown would wait up to 10 s for each (15 s for a busy one)."""
    if hasattr(session.config, "workerinput") or exitstatus != pytest.ExitCode.INTERRUPTED:
        return
    import time

    from tests.process_tree import children, kill_descendants

    deadline = time.monotonic() + 2.0
    while children() and time.monotonic() < deadline:
        time.sleep(0.05)
    kill_descendants()


def pytest_unconfigure(config):
    """The controlling pytest ends no process behind: anything still running below it (a
    world or a torchrun job that an interrupted or crashed worker left) is killed."""
    if not hasattr(config, "workerinput"):
        from tests.process_tree import kill_descendants

        kill_descendants()


def pytest_configure(config):
    """In the controlling process only, before any worker or subprocess starts: byte-compile
    the package and the tests. Where PYTHONDONTWRITEBYTECODE is set (as on the CI machines) no
    interpreter writes its compiled modules, so every fresh one (an xdist worker, a torchrun
    worker, the README command, the notebook kernel) would compile nanotrain again, about
    2.5 s of CPU each; reading compiled modules is allowed either way. Then, in every process,
    the Ctrl-C handling that stops the whole run (`_stop_everything_on_ctrl_c`)."""
    _stop_everything_on_ctrl_c(config)
    if hasattr(config, "workerinput"):  # an xdist worker: the controller has done it
        return
    root = Path(__file__).resolve().parents[1]
    for folder in ("nanotrain", "tests", "examples", "benchmarks"):
        compileall.compile_dir(root / folder, quiet=1)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist (`-n`), tests that share a module-scoped fixture of their own file
    (one multi-process world, one torchrun job) go to one worker as a group, so the fixture
    runs once instead of once per worker; every other test is handed out on its own."""
    for item in items:
        fixture_defs = getattr(item, "_fixtureinfo", None)
        if fixture_defs is None:
            continue
        for defs in fixture_defs.name2fixturedefs.values():
            if any(d.scope == "module" and d.baseid == item.nodeid.split("::")[0] for d in defs):
                item.add_marker(pytest.mark.xdist_group(item.module.__name__))
                break
