"""Where this process stands in the job: rank, replicas, nodes, restarts, paths.

Read once from the environment into an immutable value. torchrun's variables
describe the processes it launched; AdaptDL's own variables, set by a scheduler,
describe the replicas AdaptDL should assume. When both are set, AdaptDL's own
``ADAPTDL_*`` variable wins, so a scheduler can override what the launcher
reports (for example the number of nodes when torchrun runs one agent per node).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import attrs

from adaptdl.core._validate import check_int

# Variables read, in order of precedence (first one set wins).
RANK_VARS = ("ADAPTDL_REPLICA_RANK", "RANK")
REPLICAS_VARS = ("ADAPTDL_NUM_REPLICAS", "WORLD_SIZE")
NODES_VARS = ("ADAPTDL_NUM_NODES", "GROUP_WORLD_SIZE")
RESTARTS_VARS = ("ADAPTDL_NUM_RESTARTS", "TORCHELASTIC_RESTART_COUNT")
LOCAL_WORLD_SIZE_VAR = "LOCAL_WORLD_SIZE"
CHECKPOINT_PATH_VAR = "ADAPTDL_CHECKPOINT_PATH"
SHARE_PATH_VAR = "ADAPTDL_SHARE_PATH"
JOB_ID_VAR = "ADAPTDL_JOB_ID"


def _positive(instance: object, attribute: attrs.Attribute[int], value: int) -> None:
    check_int(attribute.name, value, min=1)


def _non_negative(instance: object, attribute: attrs.Attribute[int], value: int) -> None:
    check_int(attribute.name, value, min=0)


@attrs.frozen
class Topology:
    """This process's place in the job.

    ``num_nodes`` defaults to ``ceil(num_replicas / local_world_size)`` when no
    variable names it.
    """

    rank: int = attrs.field(default=0, validator=_non_negative)
    num_replicas: int = attrs.field(default=1, validator=_positive)
    num_nodes: int = attrs.field(default=1, validator=_positive)
    num_restarts: int = attrs.field(default=0, validator=_non_negative)
    local_world_size: int = attrs.field(default=1, validator=_positive)
    checkpoint_path: str | None = None
    share_path: str | None = None
    job_id: str | None = None

    def __attrs_post_init__(self) -> None:
        if self.rank >= self.num_replicas:
            raise ValueError(
                f"rank must be in [0, num_replicas={self.num_replicas}), got {self.rank}"
            )
        if self.num_nodes > self.num_replicas:
            raise ValueError(
                f"num_nodes must be <= num_replicas={self.num_replicas}, got {self.num_nodes}"
            )

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Topology:
        """Read the topology from ``env`` (default ``os.environ``).

        Raises ValueError naming the variable when a value is not an integer or
        is out of range (rank >= replicas, zero replicas, negative restarts).
        """
        env = os.environ if env is None else env
        rank, rank_var = _read_int(env, RANK_VARS, 0, min=0)
        replicas, replicas_var = _read_int(env, REPLICAS_VARS, 1, min=1)
        local, _ = _read_int(env, (LOCAL_WORLD_SIZE_VAR,), replicas, min=1)
        nodes, nodes_var = _read_int(env, NODES_VARS, -(-replicas // local), min=1)
        restarts, _ = _read_int(env, RESTARTS_VARS, 0, min=0)
        if rank >= replicas:
            raise ValueError(
                f"{rank_var}={rank} must be less than {replicas_var}={replicas} "
                "(ranks count from 0)"
            )
        if nodes > replicas:
            raise ValueError(
                f"{nodes_var}={nodes} must not exceed {replicas_var}={replicas} "
                "(every node runs at least one replica)"
            )
        return cls(
            rank=rank,
            num_replicas=replicas,
            num_nodes=nodes,
            num_restarts=restarts,
            local_world_size=min(local, replicas),
            checkpoint_path=env.get(CHECKPOINT_PATH_VAR) or None,
            share_path=env.get(SHARE_PATH_VAR) or None,
            job_id=env.get(JOB_ID_VAR) or None,
        )


def _read_int(
    env: Mapping[str, str], names: tuple[str, ...], default: int, *, min: int
) -> tuple[int, str]:
    for name in names:
        raw = env.get(name)
        if raw is None or raw.strip() == "":
            continue
        try:
            value = int(raw.strip(), 10)
        except ValueError:
            raise ValueError(
                f"environment variable {name}={raw!r} must be an integer >= {min}"
            ) from None
        if value < min:
            raise ValueError(f"environment variable {name}={raw!r} must be an integer >= {min}")
        return value, name
    return default, names[0]
