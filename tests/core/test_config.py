"""JobConfig: every environment variable read in one place, validated, ADAPTDL_* winning."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from adaptdl.core.config import (
    DEFAULT_CHECKPOINT_INTERVAL,
    DEFAULT_COLLECTIVE_TIMEOUT,
    ENV_VARS,
    JobConfig,
)
from adaptdl.core.loop.boundary import CheckpointPolicy
from adaptdl.core.topology import Topology

PACKAGES = Path(__file__).resolve().parents[2] / "packages"


def test_an_empty_environment_is_one_replica_without_checkpoints() -> None:
    config = JobConfig.from_env({})
    assert config == JobConfig()
    assert config.topology == Topology()
    assert (config.checkpoint_path, config.share_path, config.job_id) == (None, None, None)
    assert config.checkpoint_every_seconds == DEFAULT_CHECKPOINT_INTERVAL
    assert config.checkpoint_every_steps is None
    assert config.collective_timeout == DEFAULT_COLLECTIVE_TIMEOUT
    assert (config.master_addr, config.master_port, config.elastic_restart) == (None, None, None)
    assert config.use_agent_store is False


def test_every_variable_is_read() -> None:
    env = {
        "RANK": "1",
        "WORLD_SIZE": "4",
        "LOCAL_WORLD_SIZE": "2",
        "TORCHELASTIC_RESTART_COUNT": "3",
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "MASTER_ADDR": "10.0.0.1",
        "MASTER_PORT": "29500",
        "ADAPTDL_CHECKPOINT_PATH": "/ckpt",
        "ADAPTDL_SHARE_PATH": "/share",
        "ADAPTDL_JOB_ID": "job-a",
        "ADAPTDL_CHECKPOINT_INTERVAL": "0",
        "ADAPTDL_CHECKPOINT_STEPS": "50",
        "ADAPTDL_COLLECTIVE_TIMEOUT": "2.5",
        "ADAPTDL_STOP_WAIT": "7.5",
        "ADAPTDL_REPORT_INTERVAL": "2",
    }
    config = JobConfig.from_env(env)
    assert config.topology == Topology(
        rank=1, num_replicas=4, num_nodes=2, num_restarts=3, local_world_size=2
    )
    assert (config.checkpoint_path, config.share_path, config.job_id) == (
        "/ckpt",
        "/share",
        "job-a",
    )
    assert (config.checkpoint_every_seconds, config.checkpoint_every_steps) == (None, 50)
    assert config.collective_timeout == 2.5
    assert config.stop_wait == 7.5
    assert config.report_interval == 2.0
    assert JobConfig.from_env({}).report_interval == 30.0
    assert (config.master_addr, config.master_port) == ("10.0.0.1", 29500)
    assert (config.elastic_restart, config.use_agent_store) == (3, True)


@pytest.mark.parametrize(
    ("ours", "theirs", "field"),
    [
        ("ADAPTDL_REPLICA_RANK", "RANK", "rank"),
        ("ADAPTDL_NUM_REPLICAS", "WORLD_SIZE", "num_replicas"),
        ("ADAPTDL_NUM_NODES", "GROUP_WORLD_SIZE", "num_nodes"),
        ("ADAPTDL_NUM_RESTARTS", "TORCHELASTIC_RESTART_COUNT", "num_restarts"),
    ],
)
def test_an_adaptdl_variable_wins_over_its_torchrun_counterpart(
    ours: str, theirs: str, field: str
) -> None:
    base = {"ADAPTDL_NUM_REPLICAS": "8", "WORLD_SIZE": "8"}
    config = JobConfig.from_env({**base, ours: "3", theirs: "2"})
    assert getattr(config.topology, field) == 3
    if theirs == "TORCHELASTIC_RESTART_COUNT":
        assert config.elastic_restart == 2  # still names torchrun's rendezvous attempt


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"ADAPTDL_CHECKPOINT_INTERVAL": "soon"}, "ADAPTDL_CHECKPOINT_INTERVAL='soon' must be"),
        ({"ADAPTDL_CHECKPOINT_STEPS": "1e3"}, "ADAPTDL_CHECKPOINT_STEPS='1e3' must be"),
        ({"ADAPTDL_COLLECTIVE_TIMEOUT": "inf"}, "ADAPTDL_COLLECTIVE_TIMEOUT='inf' must be"),
        ({"ADAPTDL_STOP_WAIT": "-1"}, "ADAPTDL_STOP_WAIT='-1' must be a number of seconds"),
        ({"ADAPTDL_REPORT_INTERVAL": "nan"}, "ADAPTDL_REPORT_INTERVAL='nan' must be"),
        ({"MASTER_ADDR": "h", "MASTER_PORT": "0"}, "MASTER_PORT='0' must be a port number"),
        ({"MASTER_ADDR": "h"}, "MASTER_PORT='' must be a port number"),
        ({"RANK": "x"}, "RANK='x' must be an integer"),
        ({"ADAPTDL_NUM_RESTARTS": "1", "TORCHELASTIC_RESTART_COUNT": "z"}, "RESTART_COUNT='z'"),
    ],
)
def test_garbage_raises_naming_the_variable_and_value(env: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        JobConfig.from_env(env)


def test_a_port_without_an_address_is_not_read() -> None:
    assert JobConfig.from_env({"MASTER_PORT": "http"}).master_port is None


@given(
    seconds=st.one_of(st.none(), st.floats(0.001, 1e6)),
    steps=st.one_of(st.none(), st.integers(1, 10**6)),
    timeout=st.floats(0.001, 1e6),
)
def test_values_round_trip_through_their_variables(
    seconds: float | None, steps: int | None, timeout: float
) -> None:
    env = {
        "ADAPTDL_CHECKPOINT_INTERVAL": "0" if seconds is None else repr(seconds),
        "ADAPTDL_CHECKPOINT_STEPS": "0" if steps is None else str(steps),
        "ADAPTDL_COLLECTIVE_TIMEOUT": repr(timeout),
    }
    config = JobConfig.from_env(env)
    assert (config.checkpoint_every_seconds, config.checkpoint_every_steps) == (seconds, steps)
    assert config.collective_timeout == timeout
    assert _policy_from_env(env) == CheckpointPolicy(seconds, steps)


def test_the_constructor_validates() -> None:
    with pytest.raises(ValueError, match="collective_timeout"):
        JobConfig(collective_timeout=0.0)
    with pytest.raises(ValueError, match="checkpoint_every_steps"):
        JobConfig(checkpoint_every_steps=0)
    with pytest.raises(ValueError, match="master_port"):
        JobConfig(master_port=70000)
    with pytest.raises(ValueError, match="checkpoint_every_seconds"):
        JobConfig(checkpoint_every_seconds=-1.0)


def _library_sources() -> list[Path]:
    return sorted(PACKAGES.glob("*/src/adaptdl/**/*.py"))


def test_only_the_config_module_reads_the_environment() -> None:
    allowed = {
        "core/config.py",
        "sim/cli.py",  # only sets BLAS thread counts
        # The scheduler's console, a process of the operator's, not a job's: it reads
        # its own settings (ADAPTDL_STORAGE, RAY_ADDRESS) at its start.
        "sched/cli.py",
    }
    readers = []
    for path in _library_sources():
        text = path.read_text()
        where = "/".join(path.parts[-2:])
        # Handing os.environ to JobConfig.from_env (the torch adapter does), or whole to
        # a replica's process (the scheduler's backends, as torchrun does), is no read.
        uses = re.findall(r"(?<!\*\*)os\.environ(?!\))|getenv\(", text)
        if uses and where not in allowed:
            readers.append(where)
    assert readers == []


#: The scheduler console's own setting (its state directory): the operator's, read by
#: `adaptdl.sched.cli` alone, never by a job.
OPERATOR_VARS = {"ADAPTDL_STORAGE"}


def test_every_variable_the_library_names_is_a_config_variable() -> None:
    named = set()
    for path in _library_sources():
        names = set(re.findall(r"\b(ADAPTDL_[A-Z_]+|TORCHELASTIC_[A-Z_]+)\b", path.read_text()))
        if "/".join(path.parts[-2:]) == "sched/cli.py":
            names -= OPERATOR_VARS
        named |= names
    assert named <= set(ENV_VARS)


@pytest.mark.parametrize("raw", ["1e15", "1e-9", "0.0001", "1e400", "nan", "-3"])
def test_a_collective_timeout_out_of_range_names_the_range(raw: str) -> None:
    with pytest.raises(ValueError, match=r"ADAPTDL_COLLECTIVE_TIMEOUT=.* between 0.001 and"):
        JobConfig.from_env({"ADAPTDL_COLLECTIVE_TIMEOUT": raw})


@pytest.mark.parametrize("raw", ["0.001", "86400", "31536000"])
def test_a_collective_timeout_in_range_is_read(raw: str) -> None:
    assert JobConfig.from_env({"ADAPTDL_COLLECTIVE_TIMEOUT": raw}).collective_timeout == float(raw)


@pytest.mark.parametrize("raw", [" /ckpt", "/ckpt ", "/ckpt\n", "\t/ckpt"])
def test_a_checkpoint_path_with_surrounding_whitespace_is_refused(raw: str) -> None:
    with pytest.raises(ValueError, match=r"ADAPTDL_CHECKPOINT_PATH=.*whitespace"):
        JobConfig.from_env({"ADAPTDL_CHECKPOINT_PATH": raw})


@given(st.floats(allow_nan=True, allow_infinity=True) | st.integers(-(10**20), 10**20))
def test_any_collective_timeout_is_in_range_or_refused(value: float) -> None:
    try:
        config = JobConfig.from_env({"ADAPTDL_COLLECTIVE_TIMEOUT": repr(value)})
    except ValueError as exc:
        assert "ADAPTDL_COLLECTIVE_TIMEOUT" in str(exc)
        return
    assert 0.001 <= config.collective_timeout <= 365 * 86400


def _policy_from_env(env):
    return CheckpointPolicy.from_config(JobConfig.from_env(env))


@given(st.sampled_from(["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"]), st.booleans())
def test_the_log_level_is_read_in_any_case(level: str, lower: bool) -> None:
    raw = level.lower() if lower else level
    assert JobConfig.from_env({"ADAPTDL_LOG_LEVEL": f" {raw} "}).log_level == level


@given(st.text(max_size=12))
def test_a_log_level_is_a_level_name_or_refused_naming_the_variable(raw: str) -> None:
    try:
        level = JobConfig.from_env({"ADAPTDL_LOG_LEVEL": raw}).log_level
    except ValueError as exc:
        assert f"ADAPTDL_LOG_LEVEL={raw!r}" in str(exc)
        assert "DEBUG, INFO, WARNING, ERROR, CRITICAL" in str(exc)
        return
    assert level is None if not raw.strip() else level == raw.strip().upper()


def test_an_unset_log_level_is_none_and_a_bad_field_is_refused() -> None:
    assert JobConfig.from_env({}).log_level is None
    with pytest.raises(ValueError, match="log_level must be one of"):
        JobConfig(log_level="info")
