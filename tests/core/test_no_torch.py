"""adaptdl.core is framework-free: no core module imports torch, and lint refuses one that does."""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

_IMPORT_ALL = textwrap.dedent(
    """
    import importlib, pkgutil, sys
    import adaptdl.core as core
    names = [m.name for m in pkgutil.walk_packages(core.__path__, "adaptdl.core.")]
    for name in names:
        importlib.import_module(name)
    heavy = sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))
    print(len(names), heavy)
    """
)


def test_importing_every_core_module_imports_no_torch() -> None:
    # A fresh interpreter: this test process may have imported torch already.
    done = subprocess.run(
        [sys.executable, "-c", _IMPORT_ALL], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    count, heavy = done.stdout.split(" ", 1)
    assert int(count) >= 10  # the walk found the package's modules
    assert heavy.strip() == "[]"


@pytest.mark.skipif(shutil.which("ruff") is None, reason="ruff is not installed")
@pytest.mark.parametrize(
    ("path", "banned"),
    [
        ("packages/adaptdl-core/src/adaptdl/core/_probe.py", True),
        ("packages/adaptdl-torch/src/adaptdl/torch/_probe.py", False),
    ],
)
def test_lint_bans_torch_in_core_only(path: str, banned: bool) -> None:
    done = subprocess.run(
        ["ruff", "check", "--select", "TID251", "--stdin-filename", path, "-"],
        input="import torch\n\nprint(torch)\n",
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
    )
    assert ("TID251" in done.stdout) is banned, done.stdout + done.stderr
