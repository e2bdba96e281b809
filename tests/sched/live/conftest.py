"""Fixtures of the live scheduler's tests: a local Ray cluster of simulated nodes."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest


@pytest.fixture
def cluster(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """A head without GPUs and two nodes of 2 CPUs and 2 declared GPUs, no dashboard."""
    ray = pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", "0")
    c = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 1, "num_gpus": 0, "include_dashboard": False},
    )
    try:
        for _ in range(2):
            c.add_node(num_cpus=2, num_gpus=2)
        c.wait_for_nodes()
        ray.init(address=c.address, namespace="adaptdl", log_to_driver=False)
        yield c
    finally:
        ray.shutdown()
        c.shutdown()  # every process the cluster started, by its handle
