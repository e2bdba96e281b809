"""What a loader needs of its job: the `LoaderJob` protocol (`adaptdl.core.job.Job` has it)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from adaptdl.core.collective import Collective
    from adaptdl.core.decide.batchsize import BatchSizeDecision
    from adaptdl.core.loop.boundary import Boundary
    from adaptdl.core.loop.epoch import EpochState
    from adaptdl.core.loop.loader import LoaderHelper
    from adaptdl.core.persist.checkpoint import State
    from adaptdl.core.persist.jobstate import JobState
    from adaptdl.core.persist.restore import Store
    from adaptdl.core.stats.metrics import MetricsState
    from adaptdl.core.topology import Topology

__all__ = ["LoaderJob"]


class LoaderJob(Protocol):
    """What a loader needs of its job: `adaptdl.core.job.Job` has it all.

    Read-only: the topology, collective, clock, batch-size decision, epoch
    counter, counters (`JobState`: samples consumed), metrics (progress and
    profiler), checkpoint store and the loops that run; the loader changes the job
    only through the methods below. Every member is one `LoaderHelper` uses: the
    protocol exists so that the loop layer needs nothing of the job above it.
    """

    @property
    def topology(self) -> Topology: ...

    @property
    def collective(self) -> Collective: ...

    @property
    def clock(self) -> Callable[[], float]: ...

    @property
    def batch_size_decision(self) -> BatchSizeDecision: ...

    @property
    def epoch(self) -> EpochState: ...

    @property
    def metrics(self) -> MetricsState: ...

    @property
    def state(self) -> JobState: ...

    @property
    def store(self) -> Store | None: ...

    @property
    def restored_from(self) -> str | None: ...

    @property
    def current_loader(self) -> LoaderHelper | None: ...

    @property
    def training_loader(self) -> LoaderHelper | None: ...

    def register(self, state: State, *, allow_missing: bool = False) -> None: ...

    def unique_name(self, prefix: str) -> str: ...

    def set_training_loader(self, loader: LoaderHelper) -> None: ...

    def enter_loader(self, loader: LoaderHelper) -> None: ...

    def exit_loader(self, loader: LoaderHelper) -> None: ...

    def take_sync_time(self) -> float: ...

    def samples_recorder(self) -> Callable[[int], None] | None: ...

    def count_samples(self, samples: int) -> None: ...

    def step_boundary(self, *, training: bool = True) -> Boundary: ...

    def loop_resumes(self) -> None: ...

    def end_loop(self) -> None: ...

    def batch_size_changed(self) -> None: ...
