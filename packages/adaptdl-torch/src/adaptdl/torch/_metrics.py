"""The job's training metrics, read the way programs written for the original AdaptDL read them.

Programs read ``_metrics_state().grad_params`` (the gradient statistics, e.g. to
log them), `get_progress` and `get_goodput_fn`. They are views of the process's
job (`adaptdl.core.stats.metrics.MetricsState` and the training loader), read at the
time of the call; the library records them itself. The original's recording
hooks (``profile_step_start``, ``profile_step_commit``, ``update_grad_params``,
``set_batch_size``, ...) were its internals and have no counterpart here.
"""

from __future__ import annotations

from adaptdl.core.goodput import GoodputFunction
from adaptdl.core.job import Job
from adaptdl.torch._context import current_job

__all__ = ["MetricsView", "get_goodput_fn", "get_progress"]


class MetricsView:
    """Read-only view of the job's metrics, with the attribute names the original used."""

    def __init__(self, job: Job) -> None:
        self._job = job

    @property
    def grad_params(self) -> tuple[float, float] | None:
        """``(sqr, var)``: squared norm of the mean gradient and the gradient variance at the
        initial batch size (summed over parameter groups); None before an estimate exists."""
        params = self._job.metrics.grad_params()
        return None if params is None else (params.sqr, params.var)

    @property
    def progress(self) -> float:
        """Scale-invariant progress: optimiser steps, each weighted by its gain."""
        return self._job.metrics.progress

    @property
    def perf_params(self) -> tuple[float, ...] | None:
        """The fitted throughput model's parameters, None before enough has been profiled."""
        fn = self._job.goodput_fn()
        return None if fn is None else tuple(fn.perf_params.to_dict().values())

    @property
    def init_batch_size(self) -> int | None:
        """The training loader's ``batch_size`` (None before a loader trains)."""
        loader = self._job.training_loader
        return None if loader is None else loader.batch_size

    @property
    def max_batch_size(self) -> int | None:
        """``autoscale_batch_size``'s ``max_batch_size``, None when it was not called."""
        loader = self._job.training_loader
        return None if loader is None else loader.max_batch_size

    @property
    def local_bsz_bounds(self) -> tuple[int | None, int | None] | None:
        """``autoscale_batch_size``'s ``local_bsz_bounds``, None when not given."""
        loader = self._job.training_loader
        return None if loader is None else loader.local_bsz_bounds

    @property
    def gradient_accumulation(self) -> bool:
        """Whether ``autoscale_batch_size`` allowed gradient accumulation."""
        loader = self._job.training_loader
        return False if loader is None else loader.gradient_accumulation


def _metrics_state() -> MetricsView:
    """The job's metrics (a live, read-only view)."""
    return MetricsView(current_job())


def get_progress() -> float:
    """The job's scale-invariant progress (optimiser steps weighted by their gain)."""
    return current_job().metrics.progress


def get_goodput_fn() -> GoodputFunction | None:
    """The job's goodput model, None until step times and gradient statistics are known."""
    return current_job().goodput_fn()
