"""Which callbacks a hook reaches: found once per state of the Trainer's callback list.

The Trainer calls a hook only on the callbacks that define it beyond their base class's no-op
(`hook_checks.overrides`). Asking that of every callback at every hook call is a measurable
part of a small model's step (docs/benchmarks.md, `overhead.py`), so the answer is kept per
hook and found again whenever the list changes (element by element, by identity) or
a callback it left out gets the hook assigned on the instance.
"""

from __future__ import annotations

from typing import Any

from nanotrain.trainer.hook_checks import overrides


class CallbackHooks:
    """The callbacks of a live list that define each hook, in the list's order."""

    def __init__(self) -> None:
        # the list's elements when `_by_hook` was filled (held: their ids stay theirs)
        self._seen: list[Any] = []
        self._seen_ids: list[int] = []
        # hook -> (callbacks that define it, the instance dicts of those that do not)
        self._by_hook: dict[str, tuple[list[Any], list[dict]]] = {}

    def defining(self, callbacks: list[Any], hook: str) -> list[Any]:
        """The callbacks of `callbacks` that define `hook` (on their class or on the
        instance), in order; found again only when the list or an instance's hooks change."""
        ids = list(map(id, callbacks))  # by identity: a callback's own __eq__ is not asked
        if ids != self._seen_ids:
            self._seen, self._seen_ids, self._by_hook = list(callbacks), ids, {}
        kept = self._by_hook.get(hook)
        if kept is not None:
            for instance_dict in kept[1]:
                if hook in instance_dict:  # assigned on a callback since: find them again
                    kept = None
                    break
        if kept is None:
            reached: list[Any] = []
            others: list[dict] = []
            for cb in self._seen:
                if overrides(cb, hook):
                    reached.append(cb)
                elif hasattr(cb, "__dict__"):
                    others.append(vars(cb))
            kept = self._by_hook[hook] = (reached, others)
        return kept[0]

    def call(self, callbacks: list[Any], hook: str, *args: Any) -> None:
        """Call `hook(*args)` on every callback of `callbacks` that defines it (on its class
        or on the instance), in order. As Lightning iterates the live list, a callback one of
        these calls appends runs in this call too."""
        reached = self.defining(callbacks, hook)
        known = len(self._seen)
        for cb in reached:
            getattr(cb, hook)(*args)
        while len(callbacks) > known:  # appended by one of the calls above
            cb = callbacks[known]
            if overrides(cb, hook):
                getattr(cb, hook)(*args)
            known += 1
