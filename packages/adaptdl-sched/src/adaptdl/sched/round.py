"""One allocation round: call the policy, check its answer, and say what changes.

Both drivers run a round the same way: the simulator applies the :class:`Round` to
its modelled jobs, the live scheduler stops, places and relaunches replicas for it.
The round decides nothing itself; it only makes sure the policy's answer fits the
cluster and the jobs' bounds, and classifies each job's change.
"""

from __future__ import annotations

import enum
from collections import Counter
from collections.abc import Mapping, Sequence

import attrs
import numpy as np

from adaptdl.sched.policies.base import Policy
from adaptdl.sched.view import ClusterState


class AllocationError(RuntimeError):
    """A policy returned an allocation the cluster or a job's bounds cannot hold."""


class ChangeKind(enum.Enum):
    """How a job's placement changes in a round."""

    #: First GPUs of a job that never ran.
    START = "start"
    #: GPUs again for a job that ran before (it resumes from its checkpoint).
    RESUME = "resume"
    #: Another number of GPUs.
    RESIZE = "resize"
    #: The same number of GPUs on other nodes.
    MOVE = "move"
    #: No GPUs any more (the job waits, checkpointed).
    SUSPEND = "suspend"


@attrs.frozen
class Change:
    """One job's placement before and after the round (node index per GPU, sorted)."""

    job: str
    before: tuple[int, ...]
    after: tuple[int, ...]
    kind: ChangeKind

    @property
    def restart(self) -> bool:
        """Whether the change restarts the job (everything but its first start)."""
        return self.kind is not ChangeKind.START


@attrs.frozen
class Round:
    """A round's outcome: the allocation in force until the next one, and the changes."""

    time: float
    allocation: Mapping[str, tuple[int, ...]]
    changes: tuple[Change, ...]

    def nodes(self, job: str) -> tuple[int, ...]:
        """The job's GPUs after the round (empty: none)."""
        return self.allocation.get(job, ())


def check_allocation(
    state: ClusterState, allocation: Mapping[str, Sequence[int]], policy: str
) -> None:
    """Raise :class:`AllocationError` unless ``allocation`` fits ``state``: only active
    jobs, only nodes that exist and are up, no node over its GPUs, and every job
    given GPUs within its ``min_replicas .. max_replicas``."""
    capacity = state.capacity()
    jobs = {j.name: j for j in state.jobs}
    per_node: Counter[int] = Counter()
    for name, nodes in allocation.items():
        job = jobs.get(name)
        if job is None:
            raise AllocationError(
                f"policy {policy!r} allocated GPUs to {name!r}, not an active job"
            )
        for n in nodes:
            if not (isinstance(n, (int, np.integer)) and 0 <= n < state.num_nodes):
                raise AllocationError(
                    f"policy {policy!r} gave {name!r} node {n!r}; "
                    f"nodes are 0..{state.num_nodes - 1}"
                )
            if not state.up[n]:
                raise AllocationError(f"policy {policy!r} gave {name!r} node {n}, which is down")
        if nodes and not job.min_replicas <= len(nodes) <= job.max_replicas:
            raise AllocationError(
                f"policy {policy!r} gave {name!r} {len(nodes)} GPUs; it takes "
                f"{job.min_replicas}..{job.max_replicas}"
            )
        per_node.update(nodes)
    for n, count in per_node.items():
        if count > capacity[n]:
            raise AllocationError(
                f"policy {policy!r} put {count} GPUs on node {n}, which has {capacity[n]}"
            )


def diff(state: ClusterState, allocation: Mapping[str, Sequence[int]]) -> tuple[Change, ...]:
    """Each job whose GPUs differ under ``allocation`` from those it holds, and how."""
    changes = []
    for job in state.jobs:
        before = tuple(sorted(job.nodes))
        after = tuple(sorted(int(n) for n in allocation.get(job.name, ())))
        if before == after:
            continue
        if not after:
            kind = ChangeKind.SUSPEND
        elif not before:
            kind = ChangeKind.START if job.started is None else ChangeKind.RESUME
        elif len(before) != len(after):
            kind = ChangeKind.RESIZE
        else:
            kind = ChangeKind.MOVE
        changes.append(Change(job.name, before, after, kind))
    return tuple(changes)


def allocation_round(policy: Policy, state: ClusterState) -> Round:
    """Run ``policy`` on ``state``: its checked allocation and the changes it makes."""
    allocation = policy.allocate(state)
    check_allocation(state, allocation, policy.name)
    kept = {name: tuple(sorted(int(n) for n in nodes)) for name, nodes in allocation.items()}
    return Round(
        time=state.time,
        allocation={k: v for k, v in kept.items() if v},
        changes=diff(state, allocation),
    )
