"""The seam between the scheduler and the engine that runs replicas (Ray today).

The scheduler (``adaptdl.sched.scheduler``) decides; a :class:`Backend` only knows
the nodes, starts a job's replicas on given nodes, signals them, and reports how
they exited. Kubernetes or Slurm would be one more module implementing it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

import attrs

#: The status a replica exits with after a graceful stop (SIGTERM: checkpoint, then 143).
PREEMPTED = 143
#: What :meth:`Backend.poll` reports for a replica whose process or node is gone
#: without an exit status (its node died, its actor was lost).
LOST = -1000


@attrs.frozen
class Node:
    """One node of the cluster: its id, its GPUs and CPUs, its address."""

    node_id: str
    gpus: int
    cpus: float
    address: str


@attrs.frozen
class Launch:
    """One launch of a job: every replica's node (by rank), command and environment."""

    job: str
    #: Counts the job's launches: names this launch's replicas, so that a restarted
    #: scheduler finds them.
    number: int
    node_ids: tuple[str, ...]
    command: tuple[str, ...]
    cpus_per_replica: float
    #: Environment shared by every replica (the torchrun and ADAPTDL_* variables
    #: that depend on the replica are added by the backend, :func:`replica_env`).
    env: Mapping[str, str]
    #: Where each replica's output goes: ``<log_dir>/replica-<rank>.log``.
    log_dir: str


class Backend(Protocol):
    """What the scheduler needs from a cluster engine."""

    def nodes(self) -> list[Node]:
        """The nodes alive now."""
        ...

    def launch(self, launch: Launch) -> tuple[str, ...]:
        """Start the replicas of ``launch``; return the node each replica runs on, by
        rank (the engine may place them elsewhere than asked where it must). Returns
        once they are placed and started.

        Raises :class:`LaunchError` when they cannot be placed in time (nothing of
        the launch is left behind then).
        """
        ...

    def attach(self, job: str, number: int, replicas: int) -> bool:
        """Find the replicas of launch ``number`` of ``job`` started by an earlier
        scheduler; return whether all of them were found."""
        ...

    def poll(self, job: str) -> list[int | None]:
        """Each replica's exit status by rank (None: still running; :data:`LOST`)."""
        ...

    def terminate(self, job: str) -> None:
        """Ask every replica of ``job`` to stop (SIGTERM): checkpoint and exit 143."""
        ...

    def release(self, job: str) -> None:
        """Kill whatever is left of ``job``'s replicas and free their resources."""
        ...


class LaunchError(RuntimeError):
    """A launch could not be placed or started."""


def replica_env(launch: Launch, rank: int, master_addr: str, master_port: int) -> dict[str, str]:
    """The environment of replica ``rank``: what torchrun would give it (RANK,
    WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_WORLD_SIZE, MASTER_ADDR,
    MASTER_PORT) and AdaptDL's own (``ADAPTDL_REPLICA_RANK``, ``ADAPTDL_NUM_REPLICAS``,
    ``ADAPTDL_NUM_NODES``), over ``launch.env`` (which holds the job's
    ``ADAPTDL_JOB_ID``, checkpoint and share paths and restart count)."""
    nodes = launch.node_ids
    world = len(nodes)
    node = nodes[rank]
    local_rank = sum(1 for n in nodes[:rank] if n == node)
    local_world = sum(1 for n in nodes if n == node)
    distinct = list(dict.fromkeys(nodes))
    env = dict(launch.env)
    env.update(
        {
            "RANK": str(rank),
            "WORLD_SIZE": str(world),
            "LOCAL_RANK": str(local_rank),
            "LOCAL_WORLD_SIZE": str(local_world),
            "GROUP_RANK": str(distinct.index(node)),
            "GROUP_WORLD_SIZE": str(len(distinct)),
            "MASTER_ADDR": master_addr,
            "MASTER_PORT": str(master_port),
            "ADAPTDL_REPLICA_RANK": str(rank),
            "ADAPTDL_NUM_REPLICAS": str(world),
            "ADAPTDL_NUM_NODES": str(len(distinct)),
        }
    )
    return env


def by_rank(node_ids: Sequence[str]) -> tuple[str, ...]:
    """Ranks in node order: a node's replicas take consecutive ranks (as torchrun's)."""
    order = list(dict.fromkeys(node_ids))
    return tuple(sorted(node_ids, key=order.index))
