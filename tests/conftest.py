"""Suite-wide settings: one intra-op thread per process.

The suite runs on 2 shared cores; tiny models gain nothing from a thread pool, and several
pools (pytest plus spawned ranks or CLI subprocesses) oversubscribe the cores badly.
"""

import builtins
import compileall
from pathlib import Path

import pytest
import torch

torch.set_num_threads(1)


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


def pytest_configure(config):
    """In the controlling process only, before any worker or subprocess starts: byte-compile
    the package and the tests. Where PYTHONDONTWRITEBYTECODE is set (as on the CI machines) no
    interpreter writes its compiled modules, so every fresh one (an xdist worker, a torchrun
    worker, the README command, the notebook kernel) would compile nanotrain again, about
    2.5 s of CPU each; reading compiled modules is allowed either way."""
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
