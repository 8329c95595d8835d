"""Which checkpoints `ModelCheckpoint` keeps: the top k by its monitor (Lightning's ranking, so
that ties and NaN fall as there), the newest and the newest finite one, and that bookkeeping
as a state that survives a resume."""

from __future__ import annotations

import math
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from nanotrain.trainer import Trainer


class CheckpointRetention:
    """The retention half of `ModelCheckpoint` (a mixin: it reads the callback's `monitor`,
    `mode`, `save_top_k`, `dirpath` and `_saved` entries, and keeps Lightning's
    `best_k_models`, `kth_best_model_path`, `kth_value`, `best_model_path`,
    `best_model_score`, `current_score` and `last_model_path` up to date; its messages go
    through the callback's `_log_verbose`)."""

    # -- ranking -------------------------------------------------------------------------------
    def _k(self) -> int:
        return len(self.best_k_models) + 1 if self.save_top_k == -1 else self.save_top_k

    def _enters_top_k(self, current: torch.Tensor | None) -> bool:
        if current is None:
            return False
        if self.save_top_k == -1 or len(self.best_k_models) < self.save_top_k:
            return True
        better = torch.lt if self.mode == "min" else torch.gt
        return bool(better(current, self.best_k_models[self.kth_best_model_path]))

    def _update_best(
        self, trainer: Trainer, path: str, current: torch.Tensor, evicted: str | None
    ) -> None:
        k = self._k()
        if evicted is not None:
            self.best_k_models.pop(evicted)
        if torch.isnan(current):  # as Lightning: NaN is ranked as the worst possible value
            current = torch.tensor(math.inf if self.mode == "min" else -math.inf)
        self.current_score = current
        self.best_k_models[path] = current
        self._refresh_best(k)
        self._log_verbose(
            trainer,
            f"Epoch {trainer.current_epoch}, global step {trainer.global_step}: "
            f"{self.monitor!r} reached {float(current):0.5f} (best "
            f"{float(self.best_model_score):0.5f}), saving model to {path!r} as top {k}",
        )

    def _refresh_best(self, k: int) -> None:
        models = self.best_k_models
        if not models:
            self.kth_best_model_path, self.best_model_path, self.best_model_score = "", "", None
            return
        worst, best = (max, min) if self.mode == "min" else (min, max)
        if len(models) == k:
            self.kth_best_model_path = worst(models, key=lambda p: float(models[p]))
            self.kth_value = models[self.kth_best_model_path]
        # among equal scores max/min keep the first, i.e. the oldest (as Lightning)
        self.best_model_path = best(models, key=lambda p: float(models[p]))
        self.best_model_score = models[self.best_model_path]

    def _retained(self, entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
        keep = {entries[-1]["path"]}  # the newest: `last` points at it
        # Never lose the last good state: a run whose loss turned NaN keeps saving, and its
        # NaN checkpoints must not push the newest finite one out.
        finite = [e for e in entries if e.get("finite", True)]
        keep.update(e["path"] for e in finite[-1:])
        candidates = [e for e in entries if e.get("candidate", True)]
        if self.monitor is None:
            k = self.save_top_k
            keep.update(
                e["path"] for e in (candidates if k == -1 else candidates[-k:] if k else [])
            )
        else:
            keep.update(self.best_k_models)
        return [e for e in entries if e["path"] in keep]

    def _ranked(self, entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
        scored = [e for e in entries if e.get("score") is not None and not math.isnan(e["score"])]
        sign = 1.0 if self.mode == "min" else -1.0
        # Best first; among equal scores the older checkpoint first (as Lightning).
        order = sorted(enumerate(scored), key=lambda ie: (sign * ie[1]["score"], ie[0]))
        return [e for _, e in order]

    # -- state --------------------------------------------------------------------------------
    def _state(self) -> dict[str, Any]:
        return {
            "saved": [dict(e) for e in self._saved],
            "last_saved_step": self._last_saved_step,
            "last_model_path": self.last_model_path,
            "best_k_models": dict(self.best_k_models),
            "kth_best_model_path": self.kth_best_model_path,
            "kth_value": self.kth_value,
            "best_model_path": self.best_model_path,
            "best_model_score": self.best_model_score,
            "current_score": self.current_score,
        }

    def _restore(self, state: dict[str, Any]) -> None:
        self._saved = state["saved"]
        self._last_saved_step = state["last_saved_step"]
        self.last_model_path = state["last_model_path"]
        self.best_k_models = state["best_k_models"]
        self.kth_best_model_path = state["kth_best_model_path"]
        self.kth_value = state["kth_value"]
        self.best_model_path = state["best_model_path"]
        self.best_model_score = state["best_model_score"]
        self.current_score = state["current_score"]

    def state_dict(self) -> dict[str, Any]:
        """Kept checkpoints (paths, steps, scores), the top k and the last saved step, as plain
        values (so that retention and ckpt_path="best" carry on after a resume)."""
        return {
            "saved": [dict(e) for e in self._saved],
            "last_saved_step": self._last_saved_step,
            "last_model_path": self.last_model_path,
            "monitor": self.monitor,
            "mode": self.mode,
            "dirpath": None if self.dirpath is None else str(self.dirpath),
            "best_model_path": self.best_model_path,
            "best_model_score": _plain(self.best_model_score),
            "best_k_models": {p: float(v) for p, v in self.best_k_models.items()},
            "kth_best_model_path": self.kth_best_model_path,
            "current_score": _plain(self.current_score),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore `state_dict`; checkpoints deleted since then are forgotten.

        A state ranked by another monitor or mode, or saved to another folder, is not taken
        over (with a warning): its checkpoints stay on disk and are no longer managed.
        """
        self._last_saved_step = state_dict.get("last_saved_step")
        self.last_model_path = state_dict.get("last_model_path", "")
        if state_dict.get("monitor") != self.monitor or state_dict.get("mode") != self.mode:
            warnings.warn(
                f"ModelCheckpoint resumed with monitor={self.monitor!r}, mode={self.mode!r}; the "
                f"checkpoint ranked by {state_dict.get('monitor')!r} ({state_dict.get('mode')}): "
                "its checkpoints are kept on disk but no longer ranked or deleted",
                stacklevel=2,
            )
            return
        saved_dir = state_dict.get("dirpath")
        if saved_dir is not None and self.dirpath is not None and Path(saved_dir) != self.dirpath:
            warnings.warn(
                f"ModelCheckpoint saves to {self.dirpath} now, the checkpoint's run saved to "
                f"{saved_dir}: only best_model_path is taken over; the earlier checkpoints are "
                "no longer ranked or deleted",
                stacklevel=2,
            )
            self.best_model_path = state_dict.get("best_model_path", "")
            return
        self._saved = [dict(e) for e in state_dict["saved"] if Path(e["path"]).is_dir()]
        if "best_k_models" in state_dict:
            best_k = {p: s for p, s in state_dict["best_k_models"].items() if Path(p).is_dir()}
        else:  # saved before the top k was kept: rank what was kept
            best_k = self._rebuilt_top_k()
        if self.save_top_k != -1 and len(best_k) > self.save_top_k:  # a smaller k than before
            ranked = self._ranked([{"path": p, "score": s} for p, s in best_k.items()])
            chosen = {e["path"] for e in ranked[: self.save_top_k]}
            best_k = {p: s for p, s in best_k.items() if p in chosen}
        self.best_k_models = {p: torch.tensor(s) for p, s in best_k.items()}
        self._refresh_best(self._k() if self.save_top_k != -1 else len(self.best_k_models))
        if self.monitor is None:
            best = state_dict.get("best_model_path", "")
            self.best_model_path = best if best and Path(best).is_dir() else ""
        current = state_dict.get("current_score")
        self.current_score = None if current is None else torch.tensor(current)

    def _rebuilt_top_k(self) -> dict[str, float]:
        if self.monitor is None:
            return {}
        candidates = [e for e in self._saved if e.get("candidate", True)]
        ranked = self._ranked(candidates)
        chosen = ranked if self.save_top_k == -1 else ranked[: self.save_top_k]
        paths = {e["path"] for e in chosen}
        return {e["path"]: e["score"] for e in self._saved if e["path"] in paths}


def _plain(value: torch.Tensor | None) -> float | None:
    return None if value is None else float(value)
