"""What a scheduling round sees: each job through a small read-only protocol, and the cluster.

The simulator (``adaptdl.sim.jobs.SimJob``) and the live scheduler both fill
:class:`JobView`, so one policy code decides for both. A view is read-only: a policy
never changes a job, it returns an allocation (``adaptdl.sched.round``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import attrs

#: One job's GPUs: the node index of each GPU it holds (a node repeats per GPU on it).
Nodes = Sequence[int]


class JobView(Protocol):
    """One job as a scheduling round sees it (every member read-only).

    ``hints`` is core's scheduling-hints document (``adaptdl.core.decide.hints``, schema
    ``adaptdl.hints/1``), as the job last published it. ``nodes`` is the placement
    in force: one node index per GPU, empty while the job waits. A job given GPUs
    holds between ``min_replicas`` and ``max_replicas`` of them; non-adaptive
    policies give it ``requested_replicas`` (what its user asked for, within those
    bounds). ``restart_cost`` is the seconds a change of its placement costs it
    (stop requested to first step at the new size), measured where the scheduler
    could, else the cluster's default. ``remaining_progress`` is the scale-invariant
    progress it still needs, or None where nobody knows it (a live job).
    """

    @property
    def name(self) -> str: ...

    @property
    def submit(self) -> float: ...

    @property
    def started(self) -> float | None:
        """When the job first held GPUs (None: never yet)."""
        ...

    @property
    def hints(self) -> Mapping[str, Any]: ...

    @property
    def nodes(self) -> Nodes: ...

    @property
    def min_replicas(self) -> int: ...

    @property
    def max_replicas(self) -> int: ...

    @property
    def requested_replicas(self) -> int: ...

    @property
    def restart_cost(self) -> float: ...

    @property
    def attained_service(self) -> float:
        """GPU-seconds the job has held."""
        ...

    @property
    def run_time(self) -> float:
        """Seconds the job has held any GPU."""
        ...

    @property
    def remaining_progress(self) -> float | None: ...


class OracleJobView(JobView, Protocol):
    """A job whose true speed is known (the simulator's application model): what the
    Optimus-style policy reads, as the Pollux study's "Optimus+Oracle" did."""

    @property
    def epoch(self) -> int: ...

    @property
    def remaining_progress(self) -> float: ...

    @property
    def submitted_batch_size(self) -> int: ...

    @property
    def min_local_bsz(self) -> int: ...

    def estimated_rate(self, placement: tuple[int, ...]) -> float:
        """Progress per second at the submitted batch size with ``placement`` (GPUs per
        node, largest first)."""
        ...


@attrs.frozen
class ClusterState:
    """The cluster at a scheduling round: its nodes and the active (submitted,
    unfinished) jobs, in submission order.

    Nodes are ``0 .. num_nodes - 1``; node ``n`` has ``node_gpus[n]`` GPUs, or
    ``gpus_per_node`` each when ``node_gpus`` is None (a homogeneous cluster, the
    simulator's); a node that is not ``up`` has no usable GPUs. ``gpus_per_node``
    is also the size of a whole node in placement (the largest node's GPUs).
    ``restart_penalty`` is the default restart cost, for jobs that measured none.
    """

    time: float
    num_nodes: int
    gpus_per_node: int
    up: tuple[bool, ...]
    jobs: tuple[JobView, ...]
    interval: float
    restart_penalty: float
    node_gpus: tuple[int, ...] | None = None
    _capacity: tuple[int, ...] = attrs.field(init=False, eq=False, repr=False)

    def __attrs_post_init__(self) -> None:
        if len(self.up) != self.num_nodes:
            raise ValueError(f"up has {len(self.up)} entries for num_nodes={self.num_nodes}")
        if self.node_gpus is not None:
            if len(self.node_gpus) != self.num_nodes:
                raise ValueError(
                    f"node_gpus has {len(self.node_gpus)} entries for num_nodes={self.num_nodes}"
                )
            if any(g < 0 or g > self.gpus_per_node for g in self.node_gpus):
                raise ValueError(
                    f"node_gpus={list(self.node_gpus)}: each must be in "
                    f"[0, gpus_per_node={self.gpus_per_node}]"
                )
        sizes = self.node_gpus or (self.gpus_per_node,) * self.num_nodes
        # Frozen: computed once here, read by every policy call.
        capacity = tuple(g if ok else 0 for g, ok in zip(sizes, self.up, strict=True))
        object.__setattr__(self, "_capacity", capacity)

    def capacity(self) -> list[int]:
        """Usable GPUs on each node (0 on nodes that are down)."""
        return list(self._capacity)

    @property
    def total_gpus(self) -> int:
        """GPUs on the nodes that are up."""
        return sum(self._capacity)

    def current(self) -> dict[str, list[int]]:
        """The allocation in force before this round."""
        return {j.name: list(j.nodes) for j in self.jobs if j.nodes}
