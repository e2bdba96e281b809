"""experiments/ is a leaf harness and one folder per study, its imports in one direction."""

from __future__ import annotations

import ast
import graphlib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "experiments"


def _module(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> tuple[set[str], set[str]]:
    """The experiments modules ``path`` imports: at module level, and inside functions."""
    tree = ast.parse(path.read_text())
    top: set[str] = set()
    nested: set[str] = set()
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        names = [n for n in names if n.split(".")[0] == "experiments"]
        (top if node in tree.body else nested).update(names)
    return top, nested


def _package(module: str) -> str:
    """The folder a module belongs to: ``experiments.<folder>``."""
    return ".".join(module.split(".")[:2])


def test_the_harness_is_a_leaf_and_the_imports_go_one_way() -> None:
    paths = {_module(p): p for p in sorted(ROOT.rglob("*.py"))}
    modules: dict[str, set[str]] = {}
    for module, path in paths.items():
        top, nested = _imports(path)
        assert not nested, f"{module} imports {sorted(nested)} inside a function"
        # Only the names that are modules (``from experiments.harness import problems``
        # names both the package and the module).
        modules[module] = {name for name in top if name in paths and name != module}
        if _package(module) == "experiments.harness":
            outside = sorted(n for n in top if _package(n) != "experiments.harness")
            assert not outside, f"the harness's {module} imports {outside}"
    # Modules, and the folders they make up, import in one direction: no cycle.
    graphlib.TopologicalSorter(modules).prepare()
    folders: dict[str, set[str]] = {}
    for module, names in modules.items():
        others = {_package(n) for n in names} - {_package(module)}
        folders.setdefault(_package(module), set()).update(others)
    graphlib.TopologicalSorter(folders).prepare()


def test_every_study_has_its_own_command() -> None:
    studies = [p for p in ROOT.iterdir() if p.is_dir() and (p / "__init__.py").exists()]
    assert {p.name for p in studies} >= {"harness", "outcome", "trace_replay", "loss_floor"}
    for study in studies:
        if study.name != "harness":
            assert (study / "__main__.py").exists(), f"{study.name} has no command"
