"""Each test gets a fresh default job in an environment without launcher variables."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from adaptdl.torch import _context

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # the harness lives in faults/ at the repository root
    sys.path.insert(0, str(ROOT))

ENV = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_WORLD_SIZE",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_USE_AGENT_STORE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "ADAPTDL_REPLICA_RANK",
    "ADAPTDL_NUM_REPLICAS",
    "ADAPTDL_NUM_NODES",
    "ADAPTDL_NUM_RESTARTS",
    "ADAPTDL_CHECKPOINT_PATH",
    "ADAPTDL_CHECKPOINT_INTERVAL",
    "ADAPTDL_CHECKPOINT_STEPS",
    "ADAPTDL_SHARE_PATH",
    "ADAPTDL_JOB_ID",
    "ADAPTDL_COLLECTIVE_TIMEOUT",
)


@pytest.fixture(autouse=True)
def fresh_job(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for name in ENV:
        monkeypatch.delenv(name, raising=False)
    _context._reset()
    yield
    _context._reset()
