"""Each distribution ships the licence, a PEP 561 marker and metadata that pins its siblings."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[2]
DISTRIBUTIONS = {
    "adaptdl-core": "core",
    "adaptdl-torch": "torch",
    "adaptdl-sched": "sched",
    "adaptdl-sim": "sim",
}


def _project(dist: str) -> dict[str, object]:
    data = tomllib.loads((ROOT / "packages" / dist / "pyproject.toml").read_text())
    project = data["project"]
    assert isinstance(project, dict)
    return project


@pytest.mark.parametrize("dist", sorted(DISTRIBUTIONS))
def test_each_distribution_ships_the_apache_licence(dist: str) -> None:
    licence = (ROOT / "LICENSE").read_text()
    assert "Apache License" in licence and "Version 2.0" in licence
    assert (ROOT / "packages" / dist / "LICENSE").read_text() == licence
    project = _project(dist)
    assert project["license"] == "Apache-2.0"
    assert project["license-files"] == ["LICENSE"]


@pytest.mark.parametrize(("dist", "module"), sorted(DISTRIBUTIONS.items()))
def test_each_distribution_is_marked_typed(dist: str, module: str) -> None:
    assert (ROOT / "packages" / dist / "src" / "adaptdl" / module / "py.typed").is_file()
    classifiers = _project(dist)["classifiers"]
    assert isinstance(classifiers, list)
    assert "Typing :: Typed" in classifiers
    assert "License :: OSI Approved :: Apache Software License" not in classifiers  # PEP 639


@pytest.mark.parametrize("dist", ["adaptdl-torch", "adaptdl-sched", "adaptdl-sim"])
def test_siblings_require_a_compatible_core(dist: str) -> None:
    core_version = str(_project("adaptdl-core")["version"])
    assert _project(dist)["version"] == core_version
    major, minor, _ = (int(p) for p in core_version.split("."))
    deps = _project(dist)["dependencies"]
    assert isinstance(deps, list)
    (core_dep,) = [d for d in deps if re.match(r"adaptdl-core\b", d)]
    # The same release series: at least this version, below the next minor (0.x) or major.
    upper = f"{major}.{minor + 1}" if major == 0 else f"{major + 1}"
    assert core_dep == f"adaptdl-core>={core_version},<{upper}"
