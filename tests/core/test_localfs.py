"""Core touches files in one module only: `adaptdl.core.persist.localfs`.

Every other module of core reaches files through a storage handed to it
(`adaptdl.core.persist.storage`), so that tests and the fault-injection harness can hand
it another one. This scan of core's source enforces that: outside localfs no
module imports a file-system module (``fcntl``, ``mmap``, ``shutil``, ...), uses
``os`` for more than its environment and path types, calls ``open()``, or calls
a ``pathlib`` method that touches the disk. (Imports under ``if TYPE_CHECKING:``
are types only and are not counted.)

The file primitives the adapters share live in localfs too: torch's shard index
takes its lock and replaces its files through it (`exclusive`, `replace_durably`).
"""

from __future__ import annotations

import ast
import threading
from pathlib import Path

import pytest

import adaptdl.core
from adaptdl.core.persist import localfs

CORE = Path(adaptdl.core.__file__).parent
IO_MODULES = frozenset({"persist/localfs.py"})
"""The modules of core that may touch files (paths relative to the package)."""

FS_MODULES = frozenset({"fcntl", "mmap", "shutil", "tempfile", "glob", "io", "fileinput"})
OS_ALLOWED = frozenset({"environ", "PathLike", "fspath"})  # no file-system effect
PATH_IO = frozenset(
    {
        "open",
        "read_text",
        "read_bytes",
        "write_text",
        "write_bytes",
        "mkdir",
        "rmdir",
        "unlink",
        "rename",
        "touch",
        "iterdir",
        "glob",
        "rglob",
        "exists",
        "is_dir",
        "is_file",
        "is_symlink",
        "lstat",
        "symlink_to",
        "hardlink_to",
        "chmod",
        "resolve",
        "samefile",
    }
)


def _type_checking_only(node: ast.AST) -> bool:
    test = node.test if isinstance(node, ast.If) else None
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def file_system_uses(source: str) -> list[str]:
    """Each use of the file system in ``source`` outside ``if TYPE_CHECKING:``, with its line."""
    found: list[str] = []

    def visit(node: ast.AST) -> None:
        if _type_checking_only(node):
            return
        where = f"line {getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.Import):
            for alias in node.names:
                top = alias.name.split(".")[0]
                if top in FS_MODULES or alias.name.startswith("os."):
                    found.append(f"{where}: import {alias.name}")
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            top = node.module.split(".")[0]
            if top in FS_MODULES or node.module.startswith("os."):
                found.append(f"{where}: from {node.module} import ...")
            elif node.module == "os":
                found.extend(
                    f"{where}: from os import {a.name}"
                    for a in node.names
                    if a.name not in OS_ALLOWED
                )
        elif isinstance(node, ast.Attribute):
            if (
                isinstance(node.value, ast.Name)
                and node.value.id == "os"
                and node.attr not in OS_ALLOWED
            ):
                found.append(f"{where}: os.{node.attr}")
        elif isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Name) and func.id == "open":
                found.append(f"{where}: open()")
            elif isinstance(func, ast.Attribute) and func.attr in PATH_IO:
                found.append(f"{where}: .{func.attr}()")
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(source))
    return found


def core_modules() -> list[Path]:
    return sorted(p for p in CORE.rglob("*.py") if str(p.relative_to(CORE)) not in IO_MODULES)


def test_only_localfs_touches_files() -> None:
    modules = core_modules()
    assert len(modules) > 30  # the scan sees core (an installed copy would too)
    offences = {
        str(path.relative_to(CORE)): uses
        for path in modules
        if (uses := file_system_uses(path.read_text(encoding="utf-8")))
    }
    assert offences == {}, (
        "only adaptdl.core.persist.localfs may touch files; the others go through a storage: "
        f"{offences}"
    )


@pytest.mark.parametrize(
    "source",
    [
        "import fcntl",
        "import mmap as m",
        "from shutil import rmtree",
        "import os.path",
        "from os.path import join",
        "from os import rename",
        "import os\nos.rename('a', 'b')",
        "import os\nos.path.lexists('a')",
        "open('x')",
        "from pathlib import Path\nPath('x').write_bytes(b'')",
        "def f(p):\n    return p.iterdir()",
    ],
)
def test_the_scan_finds_each_kind_of_file_use(source: str) -> None:
    assert file_system_uses(source)


@pytest.mark.parametrize(
    "source",
    [
        "import os\nos.environ.get('X')",
        "import os\ndef f(p: os.PathLike[str]) -> str:\n    return os.fspath(p)",
        "from pathlib import Path\nPath('a') / 'b'",
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import mmap",
        "'a-b'.replace('-', '_')",
    ],
)
def test_the_scan_lets_pure_uses_pass(source: str) -> None:
    assert file_system_uses(source) == []


def test_exclusive_holds_out_a_second_holder_until_released(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "lock"
    waiting, done = threading.Event(), threading.Event()

    def second() -> None:
        # flock is per open file: a second open in this process is a second holder.
        with localfs.exclusive(path, on_wait=waiting.set):
            done.set()

    with localfs.exclusive(path):
        worker = threading.Thread(target=second)
        worker.start()
        assert waiting.wait(timeout=60)  # it found the lock held and waits
        assert not done.is_set()
    worker.join(timeout=60)
    assert done.is_set()


def test_replace_durably_replaces_whole_and_leaves_no_temporary(tmp_path: Path) -> None:
    path = tmp_path / "index.json"
    localfs.replace_durably(path, b"old")
    localfs.replace_durably(path, b"new")
    assert path.read_bytes() == b"new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["index.json"]
    (tmp_path / "elsewhere").write_bytes(b"x")
    path.unlink()
    path.symlink_to(tmp_path / "elsewhere")
    localfs.replace_durably(path, b"replaced")  # the link is replaced, never written through
    assert (tmp_path / "elsewhere").read_bytes() == b"x" and path.read_bytes() == b"replaced"
