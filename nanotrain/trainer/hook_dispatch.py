"""Which callbacks a hook reaches: found once per state of the Trainer's callback list.

The Trainer calls a hook only on the callbacks that define it beyond their base class's no-op
(`hook_checks.overrides`). Asking that of every callback at every hook call is a measurable
part of a small model's step (docs/benchmarks.md, `overhead.py`), so the answer is kept per
hook and found again whenever the list changes (compared element by element, by identity).
"""

from __future__ import annotations

from typing import Any

from nanotrain.trainer.hook_checks import overrides


class CallbackHooks:
    """The callbacks of a live list that define each hook, in the list's order."""

    def __init__(self) -> None:
        self._seen: list[Any] = []  # the list's elements when `_by_hook` was filled
        self._by_hook: dict[str, list[Any]] = {}

    def call(self, callbacks: list[Any], hook: str, *args: Any) -> None:
        """Call `hook(*args)` on every callback of `callbacks` that defines it. As Lightning
        iterates the live list, a callback one of these calls appends runs in this call too.
        A callback whose class does not define the hook but gets it assigned on the instance
        is seen from the next change of the list on (or from the start, if assigned before)."""
        if callbacks != self._seen:  # identity of each element first: no __eq__ is called
            self._seen, self._by_hook = list(callbacks), {}
        reached = self._by_hook.get(hook)
        if reached is None:
            reached = self._by_hook[hook] = [cb for cb in self._seen if overrides(cb, hook)]
        known = len(self._seen)
        for cb in reached:
            getattr(cb, hook)(*args)
        while len(callbacks) > known:  # appended by one of the calls above
            cb = callbacks[known]
            if overrides(cb, hook):
                getattr(cb, hook)(*args)
            known += 1
