"""Which cases of a file's shared world this run will check.

A module-scoped world runs many layouts for many parametrized tests; a run that selects only
some of those tests (`-k`, or `.ci/run`'s `-m kernels` rerun) needs only their layouts. The
world's fixture asks `selected(request, "layout", LAYOUTS)` and runs just those, so a subset of
the tests costs a subset of the world. Every case runs alone from its own seed, so its numbers
do not depend on which other cases share the world.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import pytest

__all__ = ["selected"]


def selected(request: pytest.FixtureRequest, name: str, every: Iterable[Any]) -> list[Any]:
    """The values of the parametrize argument `name` that this session's selected tests in
    the requesting fixture's module use, in the order of `every` (all of `every` under a run of
    the whole file). Under pytest-xdist each worker sees the whole selection, and a module's
    world tests run on one worker (tests/conftest.py), so the world holds what they check."""
    wanted = set()
    for item in request.session.items:
        callspec = getattr(item, "callspec", None)
        if getattr(item, "module", None) is request.module and callspec is not None:
            if name in callspec.params:
                wanted.add(callspec.params[name])
    return [value for value in every if value in wanted]
