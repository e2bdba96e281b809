"""adaptdl.env: the original's environment functions, answered by JobConfig.from_env."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

import adaptdl.env as env
from adaptdl.core.config import ENV_VARS, JobConfig


@pytest.fixture(autouse=True)
def _clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ENV_VARS:
        monkeypatch.delenv(name, raising=False)


def test_nothing_set_is_one_replica_without_paths() -> None:
    assert (env.replica_rank(), env.num_replicas(), env.num_nodes(), env.num_restarts()) == (
        0,
        1,
        1,
        0,
    )
    assert env.checkpoint_path() is None and env.share_path() is None and env.job_id() is None
    assert (env.master_addr(), env.master_port()) == ("0.0.0.0", 0)


def test_concepts_torchrun_lacks_answer_as_outside_the_scheduler() -> None:
    assert env.supervisor_url() is None
    assert env.adaptdl_sched_version() is None
    assert env.from_ray() is False


def test_torchruns_variables_describe_the_replica(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in {
        "RANK": "3",
        "WORLD_SIZE": "4",
        "LOCAL_WORLD_SIZE": "2",
        "TORCHELASTIC_RESTART_COUNT": "5",
        "MASTER_ADDR": "10.0.0.1",
        "MASTER_PORT": "29500",
    }.items():
        monkeypatch.setenv(name, value)
    assert (env.replica_rank(), env.num_replicas(), env.num_nodes(), env.num_restarts()) == (
        3,
        4,
        2,
        5,
    )
    assert (env.master_addr(), env.master_port()) == ("10.0.0.1", 29500)


def test_adaptdl_variables_win_over_torchruns(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in {
        "RANK": "0",
        "WORLD_SIZE": "2",
        "ADAPTDL_REPLICA_RANK": "2",
        "ADAPTDL_NUM_REPLICAS": "3",
        "ADAPTDL_NUM_NODES": "3",
        "ADAPTDL_NUM_RESTARTS": "7",
        "ADAPTDL_CHECKPOINT_PATH": "/ckpt",
        "ADAPTDL_SHARE_PATH": "/share",
        "ADAPTDL_JOB_ID": "job-1",
    }.items():
        monkeypatch.setenv(name, value)
    assert (env.replica_rank(), env.num_replicas(), env.num_nodes(), env.num_restarts()) == (
        2,
        3,
        3,
        7,
    )
    assert (env.checkpoint_path(), env.share_path(), env.job_id()) == ("/ckpt", "/share", "job-1")


def test_a_value_set_after_import_is_seen(monkeypatch: pytest.MonkeyPatch) -> None:
    assert env.job_id() is None
    monkeypatch.setenv("ADAPTDL_JOB_ID", "late")
    assert env.job_id() == "late"


def test_a_malformed_value_names_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "first")
    with pytest.raises(ValueError, match="RANK='first'"):
        env.replica_rank()


@given(
    replicas=st.integers(1, 64),
    data=st.data(),
    restarts=st.integers(0, 1000),
    local=st.integers(1, 8),
)
def test_every_function_agrees_with_the_config(
    replicas: int, data: st.DataObject, restarts: int, local: int
) -> None:
    rank = data.draw(st.integers(0, replicas - 1))
    variables = {
        "RANK": str(rank),
        "WORLD_SIZE": str(replicas),
        "LOCAL_WORLD_SIZE": str(local),
        "TORCHELASTIC_RESTART_COUNT": str(restarts),
    }
    with pytest.MonkeyPatch.context() as mp:
        for name, value in variables.items():
            mp.setenv(name, value)
        topology = JobConfig.from_env(variables).topology
        assert env.replica_rank() == topology.rank == rank
        assert env.num_replicas() == topology.num_replicas == replicas
        assert env.num_nodes() == topology.num_nodes == -(-replicas // min(local, replicas))
        assert env.num_restarts() == topology.num_restarts == restarts
