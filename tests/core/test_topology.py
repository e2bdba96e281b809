"""Topology from the environment: precedence and errors naming the variable."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from adaptdl.core.config import JobConfig
from adaptdl.core.topology import Topology


def _topology(env: dict[str, str]) -> Topology:
    return JobConfig.from_env(env).topology


def test_defaults_are_one_replica():
    topo = _topology({})
    assert (topo.rank, topo.num_replicas, topo.num_nodes, topo.num_restarts) == (0, 1, 1, 0)


def test_torchrun_variables():
    env = {
        "RANK": "3",
        "WORLD_SIZE": "8",
        "LOCAL_WORLD_SIZE": "4",
        "GROUP_WORLD_SIZE": "2",
        "TORCHELASTIC_RESTART_COUNT": "5",
    }
    topo = _topology(env)
    assert (topo.rank, topo.num_replicas, topo.num_nodes, topo.num_restarts) == (3, 8, 2, 5)
    assert topo.local_world_size == 4


def test_nodes_derived_from_local_world_size():
    topo = _topology({"RANK": "0", "WORLD_SIZE": "6", "LOCAL_WORLD_SIZE": "4"})
    assert topo.num_nodes == 2


def test_adaptdl_variables_win_over_torchrun():
    env = {
        "RANK": "1",
        "WORLD_SIZE": "2",
        "ADAPTDL_REPLICA_RANK": "4",
        "ADAPTDL_NUM_REPLICAS": "6",
        "ADAPTDL_NUM_NODES": "3",
        "TORCHELASTIC_RESTART_COUNT": "1",
        "ADAPTDL_NUM_RESTARTS": "7",
    }
    topo = _topology(env)
    assert (topo.rank, topo.num_replicas, topo.num_nodes, topo.num_restarts) == (4, 6, 3, 7)


@pytest.mark.parametrize(
    ("env", "variable"),
    [
        ({"RANK": "x"}, "RANK"),
        ({"WORLD_SIZE": "0"}, "WORLD_SIZE"),
        ({"WORLD_SIZE": "2.5"}, "WORLD_SIZE"),
        ({"ADAPTDL_NUM_REPLICAS": "-1"}, "ADAPTDL_NUM_REPLICAS"),
        ({"RANK": "2", "WORLD_SIZE": "2"}, "RANK"),
        ({"ADAPTDL_REPLICA_RANK": "5", "ADAPTDL_NUM_REPLICAS": "5"}, "ADAPTDL_REPLICA_RANK"),
        ({"TORCHELASTIC_RESTART_COUNT": "-3"}, "TORCHELASTIC_RESTART_COUNT"),
        ({"ADAPTDL_NUM_NODES": "3", "WORLD_SIZE": "2"}, "ADAPTDL_NUM_NODES"),
        ({"LOCAL_WORLD_SIZE": "zero"}, "LOCAL_WORLD_SIZE"),
    ],
)
def test_garbage_raises_naming_the_variable(env, variable):
    with pytest.raises(ValueError, match=variable):
        _topology(env)


@given(
    replicas=st.integers(1, 64),
    data=st.data(),
)
def test_any_valid_rank_round_trips(replicas, data):
    rank = data.draw(st.integers(0, replicas - 1))
    topo = _topology({"RANK": str(rank), "WORLD_SIZE": str(replicas)})
    assert topo.rank == rank and topo.num_replicas == replicas
    assert 1 <= topo.num_nodes <= replicas


def test_constructor_validates():
    with pytest.raises(ValueError, match="rank"):
        Topology(rank=2, num_replicas=2)
    with pytest.raises(ValueError, match="num_replicas"):
        Topology(num_replicas=0)
    with pytest.raises(TypeError, match="num_nodes"):
        Topology(num_nodes="1")  # type: ignore[arg-type]
