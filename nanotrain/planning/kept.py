"""A bounded memo for the search's repeated sub-results, keyed by shape rather than object."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import TypeVar

__all__ = ["kept"]

T = TypeVar("T")


def kept(cache: dict, key: Hashable, make: Callable[[], T], limit: int = 4096) -> T:
    """``cache[key]``, made by `make()` on a miss; the cache is emptied when it holds more
    than `limit` entries (a search asks the same few shapes thousands of times, while a
    long-lived process must not keep every shape it ever priced)."""
    hit = cache.get(key)
    if hit is None:
        if len(cache) > limit:
            cache.clear()
        hit = cache[key] = make()
    return hit
