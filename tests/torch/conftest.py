"""Each torch test gets a fresh default job in a clean environment."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _fresh_job(fresh_torch_job: None) -> None:
    """Every test here gets a fresh default job (see tests/conftest.py)."""


class FakeWriter:
    """Records add_scalar calls like a SummaryWriter."""

    def __init__(self) -> None:
        self.scalars: dict[str, tuple[float, int]] = {}

    def add_scalar(self, tag: str, value: float, global_step: int) -> None:
        self.scalars[tag] = (float(value), global_step)


@pytest.fixture
def writer() -> FakeWriter:
    return FakeWriter()
