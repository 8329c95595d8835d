"""The package's import graph has no cycles: not between modules, not between top-level rooms
(`nanotrain.trainer`, `nanotrain.checkpoint`, ...), counting imports inside functions (only
`if TYPE_CHECKING:` blocks are left out). The root holds the public API and a few contracts."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "nanotrain"
# besides __init__, __main__, module.py and loss_terms.py (the module <-> strategy contract)
MAX_OTHER_ROOT_MODULES = 6


def _module_names() -> dict[str, Path]:
    names = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    inside = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            inside |= {id(n) for child in node.body for n in ast.walk(child)}
    return inside


def _owner(name: str, modules: dict[str, Path]) -> str | None:
    """The module that defines `name` (a module, or an attribute of one)."""
    while name not in modules and "." in name:
        name = name.rsplit(".", 1)[0]
    return name if name in modules else None


def import_graph() -> dict[str, set[str]]:
    """module -> the nanotrain modules it imports anywhere in its body (TYPE_CHECKING aside).
    `from pkg import x` counts as importing `pkg.x` when x is a module, else `pkg`."""
    modules = _module_names()
    graph: dict[str, set[str]] = defaultdict(set)
    for name, path in modules.items():
        tree = ast.parse(path.read_text())
        skip = _type_checking_nodes(tree)
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            targets = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join(anchor + ([base] if base else []))
                targets = [f"{base}.{alias.name}" for alias in node.names]
            for target in targets:
                owner = _owner(target, modules)
                if owner is not None and owner != name:
                    graph[name].add(owner)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in graph.get(node, ()):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in list(graph):
        if node not in index:
            visit(node)
    return found


def room(module: str) -> str:
    """The top-level room of a module: `nanotrain.trainer.loaders` -> `nanotrain.trainer`."""
    return ".".join(module.split(".")[:2])


def test_no_import_cycle_between_modules():
    assert cycles(import_graph()) == []


def test_no_import_cycle_between_rooms():
    rooms: dict[str, set[str]] = defaultdict(set)
    for source, targets in import_graph().items():
        for target in targets:
            if room(source) != room(target) and room(target) != "nanotrain":
                rooms[room(source)].add(room(target))
    assert cycles(rooms) == []


def test_the_checker_finds_cycles_inside_functions():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_function_level_imports_are_counted(tmp_path, monkeypatch):
    package = tmp_path / "nanotrain"
    (package / "x").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "x" / "__init__.py").write_text("")
    (package / "x" / "a.py").write_text("def f():\n    from nanotrain.x import b\n")
    (package / "x" / "b.py").write_text("from . import a\n")
    (package / "x" / "c.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from nanotrain.x import a\n"
    )
    monkeypatch.setattr(__import__(__name__, fromlist=["PACKAGE"]), "PACKAGE", package)
    graph = import_graph()
    assert cycles(graph) == [["nanotrain.x.a", "nanotrain.x.b"]]
    assert "nanotrain.x.c" not in graph


def test_the_package_root_holds_few_modules():
    aside = {"__init__.py", "__main__.py", "module.py", "loss_terms.py"}
    others = sorted(p.name for p in PACKAGE.glob("*.py") if p.name not in aside)
    assert len(others) <= MAX_OTHER_ROOT_MODULES, others


@pytest.mark.parametrize("name", ["Trainer", "NanoModule", "MegatronStrategy", "TrainState"])
def test_public_names_import_from_the_root(name):
    import nanotrain

    assert getattr(nanotrain, name).__name__ == name
