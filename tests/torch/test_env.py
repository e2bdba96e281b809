"""adaptdl.env: the original's environment functions, answered by the job's config once it
has started, by JobConfig.from_env before (each test starts with no job and no variable)."""

from __future__ import annotations

from datetime import timedelta

import pytest
from hypothesis import given
from hypothesis import strategies as st

import adaptdl.env as env
import adaptdl.torch as adl
from adaptdl.core.config import JobConfig
from adaptdl.torch.collective import collective_timeout

FUNCTIONS = (
    "replica_rank",
    "num_replicas",
    "num_nodes",
    "num_restarts",
    "checkpoint_path",
    "share_path",
    "job_id",
    "master_addr",
    "master_port",
)


def _answers() -> dict[str, object]:
    return {name: getattr(env, name)() for name in FUNCTIONS}


def test_after_start_the_environment_changes_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    # The environment is read once, when the job starts; a program (or a library it
    # calls) that changes it later changes neither the job nor what adaptdl.env says.
    monkeypatch.setenv("ADAPTDL_JOB_ID", "first")
    monkeypatch.setenv("ADAPTDL_COLLECTIVE_TIMEOUT", "7")
    adl.init_process_group("gloo")
    job = adl.current_job()
    before = _answers()
    assert before["job_id"] == "first"
    for name, value in {
        "ADAPTDL_JOB_ID": "second",
        "ADAPTDL_COLLECTIVE_TIMEOUT": "9",
        "ADAPTDL_SHARE_PATH": "/elsewhere",
        "ADAPTDL_CHECKPOINT_PATH": "/elsewhere",
        "ADAPTDL_NUM_RESTARTS": "4",
        "RANK": "not a number",  # not even read: a malformed value raises nothing
    }.items():
        monkeypatch.setenv(name, value)
    assert _answers() == before
    assert job.config == JobConfig.from_env(
        {"ADAPTDL_JOB_ID": "first", "ADAPTDL_COLLECTIVE_TIMEOUT": "7"}
    )
    assert collective_timeout(job.config) == timedelta(seconds=7)


def test_the_jobs_config_holds_the_timeout_given_at_start() -> None:
    adl.init_process_group("gloo", timeout=timedelta(seconds=11))
    assert adl.current_job().config.collective_timeout == 11.0


def test_before_start_a_variable_set_late_is_seen(monkeypatch: pytest.MonkeyPatch) -> None:
    # As the original's: a program may set a variable, then ask, before any job.
    assert env.job_id() is None
    monkeypatch.setenv("ADAPTDL_JOB_ID", "late")
    assert env.job_id() == "late"
    adl.init_process_group("gloo")
    monkeypatch.setenv("ADAPTDL_JOB_ID", "later")
    assert env.job_id() == "late"


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
