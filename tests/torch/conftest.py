"""Each torch test gets a fresh default job in a clean environment."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from adaptdl.torch import _context

_ENV = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_WORLD_SIZE",
    "TORCHELASTIC_RESTART_COUNT",
    "MASTER_ADDR",
    "MASTER_PORT",
    "ADAPTDL_REPLICA_RANK",
    "ADAPTDL_NUM_REPLICAS",
    "ADAPTDL_NUM_NODES",
    "ADAPTDL_NUM_RESTARTS",
    "ADAPTDL_CHECKPOINT_PATH",
    "ADAPTDL_SHARE_PATH",
    "ADAPTDL_JOB_ID",
    "ADAPTDL_COLLECTIVE_TIMEOUT",
)


@pytest.fixture(autouse=True)
def fresh_job(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for name in _ENV:
        monkeypatch.delenv(name, raising=False)
    _context._reset()
    yield
    _context._reset()


class FakeWriter:
    """Records add_scalar calls like a SummaryWriter."""

    def __init__(self) -> None:
        self.scalars: dict[str, tuple[float, int]] = {}

    def add_scalar(self, tag: str, value: float, global_step: int) -> None:
        self.scalars[tag] = (float(value), global_step)


@pytest.fixture
def writer() -> FakeWriter:
    return FakeWriter()
