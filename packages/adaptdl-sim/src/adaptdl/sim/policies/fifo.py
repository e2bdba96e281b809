"""First in, first out: each job gets the GPUs it asked for, strictly in submission order."""

from __future__ import annotations

from adaptdl.sim.policies.base import Allocation, ClusterState, pack


class FifoPolicy:
    """Non-preemptive FIFO: a waiting job blocks every later one (no backfilling)."""

    name = "fifo"
    adaptive = False

    def allocate(self, state: ClusterState) -> Allocation:
        counts: dict[str, int] = {}
        free = state.total_gpus
        for job in state.jobs:  # submission order
            want = min(job.spec.num_replicas, state.total_gpus)
            if job.nodes and len(job.nodes) == want and all(state.up[n] for n in job.nodes):
                counts[job.name] = want
                free -= want
        blocked = False
        for job in state.jobs:
            if job.name in counts:
                continue
            want = min(job.spec.num_replicas, state.total_gpus)
            if blocked or want > free:
                blocked = True
                continue
            counts[job.name] = want
            free -= want
        return pack(state, counts)
