"""The tree's architecture holds: no import cycle between thunderctl's packages, nor between its files."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from graphlib import CycleError, TopologicalSorter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "thunderctl"


def modules() -> dict[str, Path]:
    """Every module by dotted name; a package's __init__ under the package's name."""
    return {
        ".".join(p.relative_to(ROOT.parent).with_suffix("").parts).removesuffix(".__init__"): p
        for p in ROOT.rglob("*.py")
    }


def imported(path: Path) -> Iterator[str]:
    """What a file imports, lazily or not: a lazy import is a dependency all the same."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module
            yield from (f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)


def package(module: str) -> str:
    """The top-level package under thunderctl/ (or the top-level module itself)."""
    return module.split(".")[1] if module.count(".") else module


def cycle(graph: dict[str, set[str]]) -> list[str]:
    try:
        TopologicalSorter(graph).prepare()
    except CycleError as error:
        return error.args[1]
    return []


def test_no_import_cycle_between_packages() -> None:
    graph: dict[str, set[str]] = {}
    known = modules()
    for name, path in known.items():
        for target in imported(path):
            if target in known and package(target) != package(name):
                graph.setdefault(package(name), set()).add(package(target))
    assert cycle(graph) == [], "these packages import each other in a circle"


def test_no_import_cycle_between_files() -> None:
    # An import of a package stands for its __init__'s re-exports, which import down into it: left out.
    known = modules()
    graph = {
        name: {t for t in imported(path) if t in known and t != name and known[t].name != "__init__.py"}
        for name, path in known.items()
    }
    assert cycle(graph) == [], "these modules import each other in a circle"
