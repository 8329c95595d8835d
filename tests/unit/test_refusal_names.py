"""Every message in nanotrain's code names only nanotrain things that exist: each
`nanotrain.<path>` it mentions imports, each `Trainer(<arg>=...)` is a Trainer argument, and
each `nanotrain.<path>(<arg>=...)` is an argument of that callable; and every Lightning
built-in callback is either run or refused with such a counterpart."""

from __future__ import annotations

import ast
import importlib
import inspect
import re
from pathlib import Path

import lightning.pytorch as pl
import lightning.pytorch.callbacks as pl_callbacks
import pytest

import nanotrain as nt
from nanotrain.callbacks.lightning_builtins import COUNTERPARTS, RUNS_AS_IS
from nanotrain.trainer.config import TrainerConfig

PACKAGE = Path(nt.__file__).resolve().parent
NAME = re.compile(r"\bnanotrain((?:\.[A-Za-z_]\w*)+)(\((\w+)=)?")
TRAINER_ARG = re.compile(r"(?<![\w.])(?:nt\.|nanotrain\.)?Trainer\((\w+)=")


def _messages() -> list[tuple[str, str]]:
    """(file:line, text) of every string literal (f-strings joined) in nanotrain's code."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.JoinedStr):
                text = "".join(
                    v.value if isinstance(v, ast.Constant) else "{}" for v in node.values
                )
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                text = node.value
            else:
                continue
            if not re.search(r"\s", text):
                continue  # an identifier or format name (e.g. "nanotrain.tokens"), no message
            found.append((f"{path.relative_to(PACKAGE.parent)}:{node.lineno}", text))
    return found


def _resolve(dotted: str):
    """The object `nanotrain.<dotted>` names, importing modules on the way; None if none."""
    parts = ["nanotrain", *dotted.strip(".").split(".")]
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            if not hasattr(obj, attr):
                return None
            obj = getattr(obj, attr)
        return obj
    return None


def _trainer_arguments() -> set[str]:
    return set(TrainerConfig.__dataclass_fields__) | set(
        inspect.signature(nt.Trainer.__init__).parameters
    )


def test_every_nanotrain_name_a_message_mentions_exists():
    missing = []
    arguments = _trainer_arguments()
    for where, text in _messages():
        for match in NAME.finditer(text):
            dotted = match.group(1).rstrip(".")
            if dotted.endswith((".py", ".md", ".yaml", ".json", ".pt")):
                continue  # a file name, not an object
            obj = _resolve(dotted)
            if obj is None:
                missing.append(f"{where}: nanotrain{dotted}")
            elif match.group(3) and callable(obj):
                params = inspect.signature(obj).parameters
                if match.group(3) not in params:
                    missing.append(f"{where}: nanotrain{dotted}({match.group(3)}=)")
        for match in TRAINER_ARG.finditer(text):
            if match.group(1) not in arguments:
                missing.append(f"{where}: Trainer({match.group(1)}=)")
    assert not missing, "messages name what does not exist:\n" + "\n".join(missing)


def test_every_lightning_builtin_callback_runs_or_names_its_counterpart():
    builtins = {
        name
        for name, obj in vars(pl_callbacks).items()
        if inspect.isclass(obj) and issubclass(obj, pl.Callback) and obj is not pl.Callback
    }
    assert builtins - set(COUNTERPARTS) - set(RUNS_AS_IS) == set()


@pytest.mark.parametrize("name", sorted(COUNTERPARTS))
def test_a_builtin_callback_is_refused_at_construction_with_its_counterpart(name):
    cls = getattr(pl_callbacks, name)
    try:
        instance = object.__new__(cls)  # the refusal reads the class only
    except TypeError:
        pytest.skip(f"{name} cannot be allocated")
    with pytest.raises(TypeError, match=rf"got Lightning's {name}, .*: ") as info:
        nt.Trainer(max_steps=1, callbacks=[instance])
    assert COUNTERPARTS[name] in str(info.value)


def test_lambda_callback_runs_its_hooks(tmp_path):
    from nanotrain.testing import BlobsData, Classifier

    seen = []
    callback = pl_callbacks.LambdaCallback(on_train_batch_end=lambda *a: seen.append(a[-1]))
    trainer = nt.Trainer(max_steps=3, callbacks=[callback], default_root_dir=str(tmp_path),
                         logger=False, enable_progress_bar=False, enable_checkpointing=False)  # fmt: skip
    trainer.fit(Classifier(), BlobsData())
    assert seen == [0, 1, 2]
