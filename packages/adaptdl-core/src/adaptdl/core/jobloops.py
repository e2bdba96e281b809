"""What a job knows of the dataloader loops that run in it: `JobLoops`, a part of `Job`.

The replay after a restart, until a loop that is not skipped starts (`replaying`,
`on_resume`, `loop_resumes`); the loop that runs now and the one that trains
(`enter_loader`, `exit_loader`, `accumulating`, `set_training_loader`); and what the
training loop measures: the gradient-synchronisation time of the step being
profiled and the goodput of the training loader's configuration (`goodput`,
`goodput_fn`, `bound_goodput_fn`). `adaptdl.core.job.Job` inherits all of it and
sets every attribute it reads.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from adaptdl.core.goodput import GoodputFunction
from adaptdl.core.metrics import MetricsState
from adaptdl.core.topology import Topology

if TYPE_CHECKING:
    from adaptdl.core.loader import LoaderHelper

__all__ = ["JobLoops"]


class JobLoops:
    """The loops' side of `adaptdl.core.job.Job` (which sets the attributes declared here)."""

    topology: Topology
    metrics: MetricsState
    current_loader: LoaderHelper | None
    training_loader: LoaderHelper | None
    #: Loop runs entered so far in this process: a run's identity, where the index
    #: alone repeats (every run of a loader starts at 0).
    loop_runs: int
    _replaying: bool
    _on_resume: list[Callable[[], None]]
    _sync_time: float

    # -- replay ----------------------------------------------------------------------
    @property
    def replaying(self) -> bool:
        """Whether the program is re-running code that ran before the restart.

        True from the restore of a checkpoint taken inside a dataloader loop until a
        loop that is not skipped starts (`loop_resumes`): the interrupted one, since
        every loop that finished before it in its epoch is skipped.
        """
        return self._replaying

    def on_resume(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` when the replay ends (never if the job is not replaying)."""
        if self._replaying:
            self._on_resume.append(callback)

    def loop_resumes(self) -> None:
        """A dataloader loop that was not skipped starts: any replay ends here."""
        if not self._replaying:
            return
        self._replaying = False
        callbacks, self._on_resume = self._on_resume, []
        for callback in callbacks:
            callback()

    # -- loops ------------------------------------------------------------------------
    def enter_loader(self, loader: LoaderHelper) -> None:
        if self.current_loader is not None:
            raise RuntimeError(
                f"{loader.name} started while {self.current_loader.name} is still being "
                "iterated: only one dataloader loop may run at a time"
            )
        self.current_loader = loader
        self.loop_runs += 1

    def in_training_loop(self) -> bool:
        """Whether a loop runs and it is the training loader's (any loop, before one is
        marked for training)."""
        current = self.current_loader
        return current is not None and current is (self.training_loader or current)

    def exit_loader(self, loader: LoaderHelper) -> None:
        if self.current_loader is loader:
            self.current_loader = None

    def accumulating(self) -> bool:
        """Whether the micro-batch in hand only accumulates its gradient (no optimiser
        step follows it): the running loop's `LoaderHelper.is_accum_step`, False
        outside a loop. What the model wrappers ask before each micro-batch."""
        loader = self.current_loader
        return loader is not None and loader.is_accum_step()

    def set_training_loader(self, loader: LoaderHelper) -> None:
        if self.training_loader is not None and self.training_loader is not loader:
            raise RuntimeError(
                f"{self.training_loader.name} is already the training loader; only one "
                f"dataloader may be used for training, not also {loader.name}"
            )
        self.training_loader = loader
        # Keep the parameter groups of a restored estimator: the model's adapter, built
        # later, knows them; reshaping to one group here would drop its statistics.
        gns = self.metrics.gns
        self.metrics.ensure_gns(loader.batch_size, gns.num_groups if gns is not None else 1)

    # -- metrics ------------------------------------------------------------------------
    def record_sync_time(self, seconds: float) -> None:
        """Add gradient-synchronisation time to the step being profiled."""
        self._sync_time += seconds

    def take_sync_time(self) -> float:
        seconds, self._sync_time = self._sync_time, 0.0
        return seconds

    def goodput(self) -> float | None:
        """Goodput (useful samples per second) of the training loader's configuration now.

        None before the model is fitted or the training loader decided its batch size.
        """
        loader = self.training_loader
        fn = self.goodput_fn()
        if fn is None or loader is None or loader.current_local_bsz == 0:
            return None
        topo = self.topology
        return float(
            fn.evaluate(
                topo.num_nodes,
                topo.num_replicas,
                loader.current_local_bsz,
                loader.accumulation_steps,
            )
        )

    def goodput_fn(self) -> GoodputFunction | None:
        """The goodput model fitted so far, or None before enough has been profiled."""
        loader = self.training_loader
        return None if loader is None else self.metrics.goodput_fn(loader.batch_size)

    def bound_goodput_fn(self, z: float) -> GoodputFunction | None:
        """`goodput_fn` with the noise scale at its lower confidence bound (``z`` errors)."""
        loader = self.training_loader
        return None if loader is None else self.metrics.bound_goodput_fn(z, loader.batch_size)
