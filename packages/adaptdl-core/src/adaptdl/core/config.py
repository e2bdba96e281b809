"""The job's configuration, read from the environment in one place.

Every environment variable the library reads is read here, by
:meth:`JobConfig.from_env`, into one validated immutable value; nothing else in
the library looks at ``os.environ``. A value that is not what the variable
allows raises ValueError naming the variable, its value and the rule.

Two sources describe the job. torchrun's variables describe the processes it
launched; AdaptDL's own ``ADAPTDL_*`` variables, set by a scheduler, describe the
replicas AdaptDL should assume. **When both name the same thing, the
``ADAPTDL_*`` variable wins**, so that a scheduler can override what the launcher
reports (for example the number of nodes when torchrun runs one agent per node):

===================  ========================  =================================
what                 AdaptDL (wins)            torchrun
===================  ========================  =================================
rank                 ``ADAPTDL_REPLICA_RANK``  ``RANK``
replicas             ``ADAPTDL_NUM_REPLICAS``  ``WORLD_SIZE``
nodes                ``ADAPTDL_NUM_NODES``     ``GROUP_WORLD_SIZE``
restarts             ``ADAPTDL_NUM_RESTARTS``  ``TORCHELASTIC_RESTART_COUNT``
===================  ========================  =================================

``LOCAL_WORLD_SIZE`` (replicas per node) has no AdaptDL counterpart; without a
nodes variable, nodes are ``ceil(replicas / LOCAL_WORLD_SIZE)``. The rest are
AdaptDL's alone: ``ADAPTDL_CHECKPOINT_PATH``, ``ADAPTDL_SHARE_PATH``,
``ADAPTDL_JOB_ID``, ``ADAPTDL_CHECKPOINT_INTERVAL``, ``ADAPTDL_CHECKPOINT_STEPS``,
``ADAPTDL_COLLECTIVE_TIMEOUT``, ``ADAPTDL_STOP_WAIT``, ``ADAPTDL_ALLOW_MISSING_STATE``,
``ADAPTDL_REPORT_INTERVAL``,
``ADAPTDL_LOG_LEVEL``;
and torchrun's rendezvous: ``MASTER_ADDR``, ``MASTER_PORT``,
``TORCHELASTIC_USE_AGENT_STORE``. An empty variable counts as unset.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar

import attrs

from adaptdl.core.topology import Topology
from adaptdl.core.validate import check_float, check_int

__all__ = [
    "DEFAULT_CHECKPOINT_INTERVAL",
    "DEFAULT_COLLECTIVE_TIMEOUT",
    "DEFAULT_LOG_LEVEL",
    "DEFAULT_REPORT_INTERVAL",
    "DEFAULT_STOP_WAIT",
    "ENV_VARS",
    "LOG_LEVELS",
    "JobConfig",
]

T = TypeVar("T")

# Variables read, in order of precedence (first one set wins).
RANK_VARS = ("ADAPTDL_REPLICA_RANK", "RANK")
REPLICAS_VARS = ("ADAPTDL_NUM_REPLICAS", "WORLD_SIZE")
NODES_VARS = ("ADAPTDL_NUM_NODES", "GROUP_WORLD_SIZE")
RESTARTS_VARS = ("ADAPTDL_NUM_RESTARTS", "TORCHELASTIC_RESTART_COUNT")
LOCAL_WORLD_SIZE_VAR = "LOCAL_WORLD_SIZE"
CHECKPOINT_PATH_VAR = "ADAPTDL_CHECKPOINT_PATH"
SHARE_PATH_VAR = "ADAPTDL_SHARE_PATH"
JOB_ID_VAR = "ADAPTDL_JOB_ID"
CHECKPOINT_INTERVAL_VAR = "ADAPTDL_CHECKPOINT_INTERVAL"
CHECKPOINT_STEPS_VAR = "ADAPTDL_CHECKPOINT_STEPS"
COLLECTIVE_TIMEOUT_VAR = "ADAPTDL_COLLECTIVE_TIMEOUT"
STOP_WAIT_VAR = "ADAPTDL_STOP_WAIT"
REPORT_INTERVAL_VAR = "ADAPTDL_REPORT_INTERVAL"
ALLOW_MISSING_STATE_VAR = "ADAPTDL_ALLOW_MISSING_STATE"
MASTER_ADDR_VAR = "MASTER_ADDR"
MASTER_PORT_VAR = "MASTER_PORT"
ELASTIC_RESTART_VAR = "TORCHELASTIC_RESTART_COUNT"
AGENT_STORE_VAR = "TORCHELASTIC_USE_AGENT_STORE"
LOG_LEVEL_VAR = "ADAPTDL_LOG_LEVEL"

ENV_VARS: tuple[str, ...] = (
    *RANK_VARS,
    *REPLICAS_VARS,
    *NODES_VARS,
    *RESTARTS_VARS,
    LOCAL_WORLD_SIZE_VAR,
    CHECKPOINT_PATH_VAR,
    SHARE_PATH_VAR,
    JOB_ID_VAR,
    CHECKPOINT_INTERVAL_VAR,
    CHECKPOINT_STEPS_VAR,
    COLLECTIVE_TIMEOUT_VAR,
    STOP_WAIT_VAR,
    REPORT_INTERVAL_VAR,
    ALLOW_MISSING_STATE_VAR,
    LOG_LEVEL_VAR,
    MASTER_ADDR_VAR,
    MASTER_PORT_VAR,
    AGENT_STORE_VAR,
)
"""Every environment variable :meth:`JobConfig.from_env` reads."""

DEFAULT_CHECKPOINT_INTERVAL = 600.0
"""Seconds between periodic checkpoints when ``ADAPTDL_CHECKPOINT_INTERVAL`` is unset."""

DEFAULT_COLLECTIVE_TIMEOUT = 300.0
"""Seconds a collective waits for a peer when ``ADAPTDL_COLLECTIVE_TIMEOUT`` is unset."""

DEFAULT_STOP_WAIT = 20.0
"""Seconds a stop outside any loop waits for the replicas to meet when ``ADAPTDL_STOP_WAIT``
is unset: well inside the 30 s that torchrun, Kubernetes and Slurm give a signalled process
before they kill it, leaving time for the checkpoint."""

DEFAULT_REPORT_INTERVAL = 30.0
"""Seconds between a job's reports to its scheduler (`jobreport`) when
``ADAPTDL_REPORT_INTERVAL`` is unset, as the original AdaptDL's jobs reported."""

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
"""The values ``ADAPTDL_LOG_LEVEL`` takes (in any case): the level of the ``adaptdl`` logger."""

DEFAULT_LOG_LEVEL = "INFO"
"""The ``adaptdl`` logger's level when ``ADAPTDL_LOG_LEVEL`` is unset: lifecycle lines show."""

# torch takes the timeout in milliseconds (so less is 0, no timeout at all) and as a
# timedelta (so 1e15 s overflows); a year is longer than any collective may wait.
MIN_COLLECTIVE_TIMEOUT = 0.001
MAX_COLLECTIVE_TIMEOUT = 365 * 86400.0


def _frozen(names: Iterable[str]) -> frozenset[str]:
    return frozenset(names)


@attrs.frozen
class JobConfig:
    """What the environment says about this process's job; see the module docstring.

    ``checkpoint_every_seconds``/``checkpoint_every_steps`` None turn that periodic
    checkpoint trigger off. ``master_port`` is set whenever ``master_addr`` is;
    ``elastic_restart`` is torchrun's own restart count (None outside torchrun),
    which names the rendezvous keys of one attempt even when a scheduler
    overrides the topology's ``num_restarts``. ``allow_missing_state`` names the
    registered states that may start fresh when the restored checkpoint lacks
    them (``"*"``: any); every other missing state is an error.
    ``log_level`` is the ``adaptdl`` logger's level (one of `LOG_LEVELS`), None
    when ``ADAPTDL_LOG_LEVEL`` is unset. ``report_interval`` is the seconds between
    the job's reports to its scheduler (under ``ADAPTDL_SHARE_PATH``; `jobreport`).
    """

    topology: Topology = attrs.field(factory=Topology)
    checkpoint_path: str | None = attrs.field(default=None)
    share_path: str | None = None
    job_id: str | None = None
    checkpoint_every_seconds: float | None = attrs.field(default=DEFAULT_CHECKPOINT_INTERVAL)
    checkpoint_every_steps: int | None = attrs.field(default=None)
    collective_timeout: float = attrs.field(default=DEFAULT_COLLECTIVE_TIMEOUT)
    stop_wait: float = attrs.field(default=DEFAULT_STOP_WAIT)
    report_interval: float = attrs.field(default=DEFAULT_REPORT_INTERVAL)
    master_addr: str | None = None
    master_port: int | None = attrs.field(default=None)
    elastic_restart: int | None = attrs.field(default=None)
    use_agent_store: bool = False
    allow_missing_state: frozenset[str] = attrs.field(default=frozenset(), converter=_frozen)

    @allow_missing_state.validator
    def _check_allowed(self, attribute: attrs.Attribute[frozenset[str]], value: Any) -> None:
        for name in value:
            if not isinstance(name, str) or not name or name != name.strip():
                raise ValueError(
                    f"allow_missing_state must hold state names (non-empty, without "
                    f"surrounding whitespace) or '*', got {sorted(map(repr, value))}"
                )

    log_level: str | None = attrs.field(default=None)

    @log_level.validator
    def _check_log_level(self, attribute: attrs.Attribute[str | None], value: str | None) -> None:
        if value is not None and value not in LOG_LEVELS:
            raise ValueError(f"log_level must be one of {', '.join(LOG_LEVELS)}, got {value!r}")

    @checkpoint_every_seconds.validator
    def _check_seconds(self, attribute: attrs.Attribute[float | None], value: Any) -> None:
        if value is not None:
            check_float("checkpoint_every_seconds", value, min=0.0, min_exclusive=True)

    @checkpoint_every_steps.validator
    def _check_steps(self, attribute: attrs.Attribute[int | None], value: int | None) -> None:
        if value is not None:
            check_int("checkpoint_every_steps", value, min=1)

    @collective_timeout.validator
    def _check_timeout(self, attribute: attrs.Attribute[float], value: float) -> None:
        check_float(
            "collective_timeout", value, min=MIN_COLLECTIVE_TIMEOUT, max=MAX_COLLECTIVE_TIMEOUT
        )

    @stop_wait.validator
    def _check_stop_wait(self, attribute: attrs.Attribute[float], value: float) -> None:
        check_float("stop_wait", value, min=0.0, max=MAX_COLLECTIVE_TIMEOUT)

    @report_interval.validator
    def _check_report_interval(self, attribute: attrs.Attribute[float], value: float) -> None:
        check_float("report_interval", value, min=0.0)

    @checkpoint_path.validator
    def _check_path(self, attribute: attrs.Attribute[str | None], value: str | None) -> None:
        if value is not None and value != value.strip():
            raise ValueError(
                f"checkpoint_path {value!r} has surrounding whitespace; it would name "
                "another directory than intended"
            )

    @master_port.validator
    def _check_port(self, attribute: attrs.Attribute[int | None], value: int | None) -> None:
        if value is not None:
            check_int("master_port", value, min=1, max=65535)

    @elastic_restart.validator
    def _check_restart(self, attribute: attrs.Attribute[int | None], value: int | None) -> None:
        if value is not None:
            check_int("elastic_restart", value, min=0)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> JobConfig:
        """Read the configuration from ``env`` (``os.environ`` when None).

        Raises ValueError naming the variable when a value is malformed or out of
        range (rank >= replicas, zero replicas, negative restarts, a checkpoint
        interval that is not a number, a timeout that is not positive, ...).
        """
        env = os.environ if env is None else env
        master_addr = _text(env, MASTER_ADDR_VAR)
        return cls(
            topology=_read_topology(env),
            checkpoint_path=_read_path(env, CHECKPOINT_PATH_VAR),
            share_path=_text(env, SHARE_PATH_VAR),
            job_id=_text(env, JOB_ID_VAR),
            checkpoint_every_seconds=_read_interval(env),
            checkpoint_every_steps=_read_steps(env),
            collective_timeout=_read_timeout(env),
            stop_wait=_read_stop_wait(env),
            report_interval=_read_report_interval(env),
            master_addr=master_addr,
            # Only a configured rendezvous uses the port (torchrun sets both).
            master_port=_read_port(env) if master_addr is not None else None,
            elastic_restart=_read_elastic_restart(env),
            use_agent_store=env.get(AGENT_STORE_VAR) == "True",
            allow_missing_state=_read_names(env, ALLOW_MISSING_STATE_VAR),
            log_level=_read_log_level(env),
        )


def _text(env: Mapping[str, str], name: str) -> str | None:
    return env.get(name) or None


def _read_path(env: Mapping[str, str], name: str) -> str | None:
    raw = env.get(name) or None
    if raw is not None and raw != raw.strip():
        # Stripping would silently pick another directory than the one written.
        raise ValueError(
            f"environment variable {name}={raw!r} has surrounding whitespace; remove it "
            "(a directory name is taken exactly as written)"
        )
    return raw


def _read_names(env: Mapping[str, str], name: str) -> frozenset[str]:
    """Comma-separated names (spaces around them ignored); an empty name is an error."""
    raw = env.get(name) or ""
    if not raw.strip():
        return frozenset()
    names = [part.strip() for part in raw.split(",")]
    if not all(names):
        raise ValueError(
            f"environment variable {name}={raw!r} must be state names separated by commas "
            "(for example adaptdl-dataparallel,adaptdl-accumulator-0), or *"
        )
    return frozenset(names)


def _read_topology(env: Mapping[str, str]) -> Topology:
    rank, rank_var = _read_int(env, RANK_VARS, 0, min=0)
    replicas, replicas_var = _read_int(env, REPLICAS_VARS, 1, min=1)
    local, _ = _read_int(env, (LOCAL_WORLD_SIZE_VAR,), replicas, min=1)
    nodes, nodes_var = _read_int(env, NODES_VARS, -(-replicas // local), min=1)
    restarts, _ = _read_int(env, RESTARTS_VARS, 0, min=0)
    if rank >= replicas:
        raise ValueError(
            f"{rank_var}={rank} must be less than {replicas_var}={replicas} (ranks count from 0)"
        )
    if nodes > replicas:
        raise ValueError(
            f"{nodes_var}={nodes} must not exceed {replicas_var}={replicas} "
            "(every node runs at least one replica)"
        )
    return Topology(
        rank=rank,
        num_replicas=replicas,
        num_nodes=nodes,
        num_restarts=restarts,
        local_world_size=min(local, replicas),
    )


def _read(
    env: Mapping[str, str],
    name: str,
    parse: Callable[[str], T],
    ok: Callable[[T], bool],
    rule: str,
) -> T | None:
    """``parse`` of variable ``name``, None when unset; ValueError stating ``rule`` unless ok."""
    raw = env.get(name)
    if raw is None or not raw.strip():
        return None
    try:
        value = parse(raw.strip())
    except ValueError:
        value = None
    if value is None or not ok(value):
        raise ValueError(f"environment variable {name}={raw!r} must be {rule}")
    return value


def _read_int(
    env: Mapping[str, str], names: tuple[str, ...], default: int, *, min: int
) -> tuple[int, str]:
    """The first of ``names`` that is set (an integer >= ``min``) and its name."""
    for name in names:
        value = _read(env, name, _integer, lambda v: v >= min, f"an integer >= {min}")
        if value is not None:
            return value, name
    return default, names[0]


def _integer(raw: str) -> int:
    return int(raw, 10)


def _read_elastic_restart(env: Mapping[str, str]) -> int | None:
    return _read(env, ELASTIC_RESTART_VAR, _integer, lambda v: v >= 0, "an integer >= 0")


def _read_interval(env: Mapping[str, str]) -> float | None:
    seconds = _read(
        env,
        CHECKPOINT_INTERVAL_VAR,
        float,
        lambda v: math.isfinite(v) and v >= 0,
        "a number of seconds >= 0 (0 turns periodic checkpoints by time off)",
    )
    return DEFAULT_CHECKPOINT_INTERVAL if seconds is None else seconds or None


def _read_steps(env: Mapping[str, str]) -> int | None:
    steps = _read(
        env,
        CHECKPOINT_STEPS_VAR,
        _integer,
        lambda v: v >= 0,
        "an integer >= 0 (0 turns periodic checkpoints by steps off)",
    )
    return steps or None


def _read_timeout(env: Mapping[str, str]) -> float:
    seconds = _read(
        env,
        COLLECTIVE_TIMEOUT_VAR,
        float,
        lambda v: MIN_COLLECTIVE_TIMEOUT <= v <= MAX_COLLECTIVE_TIMEOUT,
        f"a number of seconds between {MIN_COLLECTIVE_TIMEOUT:g} and {MAX_COLLECTIVE_TIMEOUT:.0f}",
    )
    return DEFAULT_COLLECTIVE_TIMEOUT if seconds is None else seconds


def _read_stop_wait(env: Mapping[str, str]) -> float:
    seconds = _read(
        env,
        STOP_WAIT_VAR,
        float,
        lambda v: 0 <= v <= MAX_COLLECTIVE_TIMEOUT,
        f"a number of seconds between 0 and {MAX_COLLECTIVE_TIMEOUT:.0f} (0: a stop outside "
        "a loop does not wait for the replicas to meet)",
    )
    return DEFAULT_STOP_WAIT if seconds is None else seconds


def _read_report_interval(env: Mapping[str, str]) -> float:
    rule = "a number of seconds >= 0 (0: report at every step)"
    seconds = _read(env, REPORT_INTERVAL_VAR, float, lambda v: v >= 0, rule)
    return DEFAULT_REPORT_INTERVAL if seconds is None else seconds


def _read_port(env: Mapping[str, str]) -> int:
    rule = "a port number in [1, 65535] (torchrun sets it)"
    port = _read(env, MASTER_PORT_VAR, _integer, lambda v: 0 < v < 65536, rule)
    if port is None:  # required with MASTER_ADDR
        raw = env.get(MASTER_PORT_VAR, "")
        raise ValueError(f"environment variable {MASTER_PORT_VAR}={raw!r} must be {rule}")
    return port


def _read_log_level(env: Mapping[str, str]) -> str | None:
    return _read(
        env,
        LOG_LEVEL_VAR,
        str.upper,
        lambda name: name in LOG_LEVELS,
        f"one of {', '.join(LOG_LEVELS)} (in any case)",
    )
