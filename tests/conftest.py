"""Suite-wide settings: one intra-op thread per process.

The suite runs on 2 shared cores; tiny models gain nothing from a thread pool, and several
pools (pytest plus spawned ranks or CLI subprocesses) oversubscribe the cores badly.
"""

import builtins

import pytest
import torch

torch.set_num_threads(1)


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
