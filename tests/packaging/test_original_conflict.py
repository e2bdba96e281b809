"""Installed beside the original AdaptDL distribution, importing ours fails with what to do."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import adaptdl.core

CORE = Path(adaptdl.core.__file__).parent
SOURCES = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]


def _import(code: str, path: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "PYTHONPATH": os.pathsep.join(path)},
        capture_output=True,
        text=True,
        timeout=120,
    )


def _fake_dist_info(site: Path, name: str, version: str) -> None:
    info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")


def _assert_clear(done: subprocess.CompletedProcess[str]) -> None:
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: the original AdaptDL"), done.stderr
    for needle in ("'adaptdl'", "adaptdl-core", "adaptdl-torch", "pip uninstall adaptdl"):
        assert needle in last


@pytest.mark.parametrize("module", ["adaptdl.core", "adaptdl.env", "adaptdl.core.job"])
def test_the_originals_metadata_makes_every_import_fail_clearly(
    tmp_path: Path, module: str
) -> None:
    _fake_dist_info(tmp_path, "adaptdl", "0.2.11")
    done = _import(f"import {module}", [str(tmp_path), *SOURCES])
    _assert_clear(done)
    assert "version 0.2.11" in done.stderr


def test_the_originals_package_file_in_our_directory_fails_clearly(tmp_path: Path) -> None:
    # Both installed into one site-packages: its adaptdl/__init__.py beside our core.
    package = tmp_path / "adaptdl"
    shutil.copytree(CORE, package / "core", ignore=shutil.ignore_patterns("__pycache__"))
    (package / "__init__.py").write_text("# the original's package marker\n")
    done = _import("import adaptdl.core", [str(tmp_path)])
    _assert_clear(done)
    assert str(package / "__init__.py") in done.stderr


def test_a_distribution_of_ours_is_no_conflict(tmp_path: Path) -> None:
    _fake_dist_info(tmp_path, "adaptdl-core", "0.1.0")
    _fake_dist_info(tmp_path, "adaptdl-sim", "0.1.0")
    done = _import("import adaptdl.core, adaptdl.env; print('ok')", [str(tmp_path), *SOURCES])
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"
