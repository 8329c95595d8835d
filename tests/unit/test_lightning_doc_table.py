"""docs/lightning.md's reference table names every LightningModule hook and method, Callback
hook, Trainer argument and Trainer attribute of the installed Lightning (read from Lightning
itself), so a hook Lightning adds cannot go unlisted."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import lightning.pytorch as pl
from lightning.pytorch.core.hooks import CheckpointHooks, DataHooks, ModelHooks

DOC = Path(__file__).resolve().parents[2] / "docs" / "lightning.md"


def _listed() -> set[str]:
    """Every identifier in backticks in the table's "Lightning" column."""
    names: set[str] = set()
    for line in DOC.read_text().splitlines():
        cells = line.split(" | ")
        if line.startswith("| ") and len(cells) >= 3:
            names.update(re.findall(r"`([A-Za-z_][A-Za-z0-9_]*)", cells[1]))
    return names


def _public(cls: type) -> set[str]:
    return {n for n in dir(cls) if not n.startswith("_")}


def test_every_lightning_hook_argument_and_attribute_is_in_the_table():
    listed = _listed()
    module = _public(ModelHooks) | _public(DataHooks) | _public(CheckpointHooks)
    module |= {
        n for n, v in vars(pl.LightningModule).items() if callable(v) and not n.startswith("_")
    } - {"to_tensorrt"}  # an export helper Lightning marks experimental
    callback = _public(pl.Callback)
    arguments = set(list(inspect.signature(pl.Trainer.__init__).parameters)[1:])
    attributes = {
        n for n, v in vars(pl.Trainer).items() if not n.startswith("_") and (
            isinstance(v, property) or callable(v))
    }  # fmt: skip
    for kind, names in (
        ("LightningModule", module),
        ("Callback", callback),
        ("Trainer argument", arguments),
        ("Trainer attribute", attributes),
    ):
        missing = sorted(names - listed)
        assert not missing, f"docs/lightning.md does not list these {kind} names: {missing}"
