"""The policy interface, and the helpers the built-in policies share.

A policy is any object with a ``name``, an ``adaptive`` flag and a method
``allocate(state)`` returning, for every job that should hold GPUs, the node index of
each of its GPUs (:data:`Allocation`). Jobs left out get no GPUs. The round
(``adaptdl.sched.round``) checks the result: no node over its GPUs, no node that is
down, every job given GPUs within its ``min_replicas .. max_replicas``.

A new policy is one module: a class with those three members, reading the jobs
through ``adaptdl.sched.view.JobView`` (never a driver's own job type), usually
choosing a GPU count per job and calling :func:`pack` to place the counts; register
it in ``adaptdl.sched.policies.make_policy``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Protocol

import numpy as np

from adaptdl.sched.view import ClusterState

#: A policy's answer: each job that holds GPUs, and the node index of each of its GPUs.
Allocation = dict[str, list[int]]


class Policy(Protocol):
    """A scheduling policy: decides which GPUs each job holds until the next round.

    ``allocate`` may keep state between rounds (caches keyed by job name), but must
    not change the jobs it reads; it is called once per round with every active job.
    """

    #: The name ``make_policy`` and the command lines know it by.
    name: str
    #: Whether jobs under this policy adapt their batch size (goodput-driven); a
    #: driver runs the jobs of a non-adaptive policy at their submitted batch size.
    adaptive: bool

    def allocate(self, state: ClusterState) -> Mapping[str, Sequence[int]]:
        """Return each job's GPUs as a list of node indices (one entry per GPU)."""
        ...


def free_gpus(state: ClusterState) -> list[int]:
    """GPUs free on each node when nothing is allocated (0 on nodes that are down)."""
    return state.capacity()


def pack(
    state: ClusterState,
    counts: Mapping[str, int],
    *,
    keep: bool = True,
    distributed_exclusive: bool = True,
) -> Allocation:
    """Place each job's GPU count onto nodes.

    Jobs whose count is unchanged keep their GPUs (no restart) when ``keep``. The
    others, largest first, take whole free nodes and then the best-fitting node for
    the remainder, so that a job spans as few nodes as possible; with
    ``distributed_exclusive`` a multi-node job's partial node is not shared with
    another multi-node job where that can be avoided. Jobs that cannot be placed
    (too little free capacity) are left out.
    """
    free = free_gpus(state)
    by_name = {j.name: j for j in state.jobs}
    out: Allocation = {}
    shared_by_distributed = [False] * len(free)
    pending: list[tuple[int, float, str]] = []
    for name, count in counts.items():
        if count <= 0:
            continue
        job = by_name[name]
        if (
            keep
            and job.nodes
            and len(job.nodes) == count
            and all(state.up[n] for n in job.nodes)
            # A node that shrank (a live cluster) may no longer hold the job.
            and all(free[n] >= c for n, c in Counter(job.nodes).items())
        ):
            out[name] = list(job.nodes)
            for n in job.nodes:
                free[n] -= 1
            if len(set(job.nodes)) > 1:
                for n in set(job.nodes):
                    shared_by_distributed[n] = True
        else:
            pending.append((count, job.submit, name))
    pending.sort(key=lambda p: (-p[0], p[1], p[2]))
    g = state.gpus_per_node
    for count, _, name in pending:
        if count > sum(f for f in free if f > 0):
            continue
        nodes = _place_one(free, count, g, shared_by_distributed, distributed_exclusive)
        out[name] = nodes
        if len(set(nodes)) > 1:
            for n in set(nodes):
                shared_by_distributed[n] = True
    return out


def _place_one(
    free: list[int], count: int, g: int, shared: list[bool], exclusive: bool
) -> list[int]:
    chosen: list[int] = []
    if count <= g:
        # Fits on one node: best fit (the fullest node that still has room).
        cand = [n for n, f in enumerate(free) if f >= count]
        if cand:
            chosen = [min(cand, key=lambda n: (free[n], n))] * count
    else:
        full, rem = divmod(count, g)
        empty = [n for n, f in enumerate(free) if f == g]
        if len(empty) >= full:
            whole = empty[:full]
            chosen = [n for n in whole for _ in range(g)]
            if rem:
                cand = [n for n, f in enumerate(free) if f >= rem and n not in whole]
                cand.sort(key=lambda n: (exclusive and shared[n], free[n], n))
                chosen = chosen + [cand[0]] * rem if cand else []
    if not chosen:
        # Fragmented: fill the emptiest nodes first, avoiding other multi-node jobs'.
        order = sorted(
            (n for n, f in enumerate(free) if f > 0),
            key=lambda n: (exclusive and shared[n], -free[n], n),
        )
        for n in order:
            take = min(free[n], count - len(chosen))
            chosen += [n] * take
            if len(chosen) == count:
                break
    for n in chosen:
        free[n] -= 1
    return chosen


def greedy_allocate(
    utilities: Sequence[np.ndarray],
    capacity: int,
    min_first: bool = False,
    start: Sequence[int] | None = None,
) -> list[int]:
    """Split ``capacity`` GPUs to maximise the sum of per-job utilities, greedily.

    ``utilities[i][k]`` is job i's value with k GPUs (``[0]`` is its value with none).
    Each step takes the jump (from a job's current count to any larger one that fits)
    with the best value per GPU, so a non-concave utility (a speedup that only pays
    off at a full node) is still found. Ties go to the earlier job. With
    ``min_first``, every job first gets one GPU in order while any is left. With
    ``start``, jobs begin from those counts (their sum at most ``capacity``) and only
    gain GPUs.
    """
    n = len(utilities)
    alloc = (
        [0] * n
        if start is None
        else [min(int(a), len(u) - 1) for a, u in zip(start, utilities, strict=True)]
    )
    free = capacity - sum(alloc)
    if min_first:
        for i in range(n):
            if free <= 0:
                break
            if len(utilities[i]) > 1:
                alloc[i] = 1
                free -= 1
    best: list[tuple[float, int]] = [(-np.inf, 0)] * n

    def refresh(i: int) -> None:
        u = utilities[i]
        a = alloc[i]
        hi = min(len(u) - 1, a + free)
        if hi <= a:
            best[i] = (-np.inf, 0)
            return
        steps = np.arange(1, hi - a + 1)
        ratios = (u[a + 1 : hi + 1] - u[a]) / steps
        j = int(np.argmax(ratios))
        best[i] = (float(ratios[j]), int(steps[j]))

    for i in range(n):
        refresh(i)
    while free > 0:
        i = max(range(n), key=lambda k: (best[k][0], -k)) if n else -1
        if i < 0 or best[i][0] <= 1e-12:
            break
        alloc[i] += best[i][1]
        free -= best[i][1]
        refresh(i)
        for k in range(n):
            if k != i and best[k][1] > free:
                refresh(k)
    return alloc
