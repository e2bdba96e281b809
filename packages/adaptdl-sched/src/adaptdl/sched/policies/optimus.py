"""Optimus-style (Peng et al., EuroSys 2018) greedy on estimated remaining time.

Every job (in submission order, while GPUs last) gets one GPU; then each further GPU
goes to the job whose estimated remaining time it reduces the most. Remaining time is
the remaining progress over the job's progress rate at its submitted batch size, from
the application model (an oracle, as the Pollux study's "Optimus+Oracle"): the jobs
must be ``OracleJobView`` (the simulator's), with ``min_replicas`` 1. Batch size is as
submitted.
"""

from __future__ import annotations

from typing import cast

import numpy as np

from adaptdl.sched.policies.base import Allocation, greedy_allocate, pack
from adaptdl.sched.view import ClusterState, JobView, OracleJobView


def _oracle(job: JobView) -> OracleJobView:
    # Checked by the one member only the oracle has: a protocol isinstance() would
    # evaluate every property (the hints among them) of every job, every round.
    if not callable(getattr(job, "estimated_rate", None)):
        raise TypeError(
            f"optimus needs each job's true speed (an OracleJobView, the simulator's "
            f"jobs); job {job.name!r} is a {type(job).__name__}"
        )
    if job.min_replicas > 1:
        raise ValueError(
            f"optimus gives every job one GPU first; job {job.name!r} has "
            f"min_replicas={job.min_replicas} (allowed: 1)"
        )
    return cast(OracleJobView, job)


class OptimusPolicy:
    """Greedy marginal reduction of estimated remaining time."""

    name = "optimus"
    adaptive = False

    def __init__(self, max_gpus_per_job: int | None = None) -> None:
        self.max_gpus_per_job = max_gpus_per_job
        # Rates change only with the epoch (gradient statistics): cache them per job.
        self._rates: dict[str, tuple[int, int, np.ndarray]] = {}

    def remaining_times(self, job: OracleJobView, max_gpus: int, gpus_per_node: int) -> np.ndarray:
        """Estimated remaining seconds with 1..max_gpus GPUs (index k-1)."""
        cached = self._rates.get(job.name)
        if cached is None or cached[0] != job.epoch or cached[1] != max_gpus:
            rates = np.empty(max_gpus)
            for k in range(1, max_gpus + 1):
                full, rem = divmod(k, gpus_per_node)
                placement = (gpus_per_node,) * full + ((rem,) if rem else ())
                rates[k - 1] = max(job.estimated_rate(placement), 1e-12)
            cached = (job.epoch, max_gpus, rates)
            self._rates[job.name] = cached
        return job.remaining_progress / cached[2]

    def allocate(self, state: ClusterState) -> Allocation:
        cap = state.total_gpus
        if self.max_gpus_per_job is not None:
            cap = min(cap, self.max_gpus_per_job)
        utilities = []
        for view in state.jobs:
            job = _oracle(view)
            # More GPUs than the batch has samples (at the smallest local batch) are useless.
            top = min(cap, job.max_replicas, job.submitted_batch_size // job.min_local_bsz)
            k_max = max(1, top)
            t = self.remaining_times(job, k_max, state.gpus_per_node)
            # Utility: negated remaining time, offset so that 1 GPU has value t1 + 1.
            u = np.concatenate([[0.0], t[0] + 1.0 - t])
            utilities.append(u)
        active = {j.name for j in state.jobs}
        for name in [n for n in self._rates if n not in active]:
            del self._rates[name]
        alloc = greedy_allocate(utilities, state.total_gpus, min_first=True)
        counts = {j.name: a for j, a in zip(state.jobs, alloc, strict=True) if a > 0}
        return pack(state, counts)
