"""Each test gets a fresh default job in an environment without launcher variables."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # the harness lives in faults/ at the repository root
    sys.path.insert(0, str(ROOT))


@pytest.fixture(autouse=True)
def _fresh_job(fresh_torch_job: None) -> None:
    """Every test here gets a fresh default job (see tests/conftest.py)."""
