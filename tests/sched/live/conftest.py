"""Fixtures of the live scheduler's tests: a local Ray cluster of simulated nodes, one
per test module (starting one takes most of a test's time)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

NODES = 2


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[Any]:
    """A head without GPUs and `NODES` nodes of 2 CPUs and 2 declared GPUs, no
    dashboard, for the module's tests; every process it started is stopped after them."""
    ray = pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("RAY_USAGE_STATS_ENABLED", "0")
        c = Cluster(
            initialize_head=True,
            head_node_args={"num_cpus": 1, "num_gpus": 0, "include_dashboard": False},
        )
        try:
            for _ in range(NODES):
                c.add_node(num_cpus=2, num_gpus=2)
            c.wait_for_nodes()
            ray.init(address=c.address, namespace="adaptdl", log_to_driver=False)
            yield c
        finally:
            ray.shutdown()
            c.shutdown()  # every process the cluster started, by its handle


@pytest.fixture
def cluster(ray_cluster: Any) -> Iterator[Any]:
    """The module's cluster, idle, with `NODES` nodes; a node a test removed is
    replaced after it, and nothing a test placed outlives it."""
    yield ray_cluster
    while len(ray_cluster.worker_nodes) < NODES:
        ray_cluster.add_node(num_cpus=2, num_gpus=2)
    ray_cluster.wait_for_nodes()
    # Every job of the test ended (its placement groups removed, which the GCS may
    # finish a moment later): the next test sees the whole cluster free.
    from ray.util import placement_group_table

    deadline = time.monotonic() + 30.0
    while live := [g for g in placement_group_table().values() if g["state"] != "REMOVED"]:
        assert time.monotonic() < deadline, live
        time.sleep(0.2)
