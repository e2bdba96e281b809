"""Each compatibility test gets a fresh default job in a clean environment."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _fresh_job(fresh_torch_job: None) -> None:
    """Every test here gets a fresh default job (see tests/conftest.py)."""
