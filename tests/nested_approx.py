"""`nested_approx`: `pytest.approx` over lists, tuples and dicts of numbers, at any depth.

pytest 9.2 refuses nested structures in `pytest.approx` (TypeError), and a Lightning stage's
results are such structures (`trainer.validate` returns a list of dicts); a structure of
approx leaves compares with `==` on every pytest version.
"""

from __future__ import annotations

from numbers import Real
from typing import Any

import pytest

__all__ = ["nested_approx"]


def nested_approx(expected: Any, **tolerance: Any) -> Any:
    """`expected` with every number replaced by `pytest.approx(number, **tolerance)`: dicts
    keep their keys, lists and tuples their type and length; anything else as it is."""
    if isinstance(expected, dict):
        return {key: nested_approx(value, **tolerance) for key, value in expected.items()}
    if isinstance(expected, (list, tuple)):
        return type(expected)(nested_approx(value, **tolerance) for value in expected)
    if isinstance(expected, Real) and not isinstance(expected, bool):
        return pytest.approx(expected, **tolerance)
    return expected
