"""First in, first out: each job gets the GPUs it asked for, strictly in submission order."""

from __future__ import annotations

from adaptdl.sched.policies.base import Allocation, pack
from adaptdl.sched.view import ClusterState, JobView


def wanted(job: JobView, state: ClusterState) -> int:
    """The GPUs a non-adaptive policy gives ``job``: its request, cut to the cluster
    (0 where the cluster is below the job's minimum)."""
    want = min(job.requested_replicas, job.max_replicas, state.total_gpus)
    return want if want >= job.min_replicas else 0


class FifoPolicy:
    """Non-preemptive FIFO: a waiting job blocks every later one (no backfilling)."""

    name = "fifo"
    adaptive = False

    def allocate(self, state: ClusterState) -> Allocation:
        counts: dict[str, int] = {}
        free = state.total_gpus
        for job in state.jobs:  # submission order
            want = wanted(job, state)
            if (
                want
                and job.nodes
                and len(job.nodes) == want
                and all(state.up[n] for n in job.nodes)
            ):
                counts[job.name] = want
                free -= want
        blocked = False
        for job in state.jobs:
            if job.name in counts:
                continue
            want = wanted(job, state)
            if blocked or want == 0 or want > free:
                blocked = True
                continue
            counts[job.name] = want
            free -= want
        return pack(state, counts)
