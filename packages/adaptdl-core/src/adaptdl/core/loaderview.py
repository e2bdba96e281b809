"""A loader's state as the seed API shows it: `LoaderView`, the properties of `LoaderHelper`.

Its name, the loop's index and the user's end index (the end index survives restarts), the
batch-size limits set by ``autoscale_batch_size``, the sizes and accumulation
count of the batch in hand, whether it is the job's training loader, and the one
accumulation predicate (`is_accum_step`) that the loop, the job's `accumulating`
and the model wrappers all ask. `adaptdl.core.loader.LoaderHelper` inherits all of
it and sets every attribute it reads.
"""

from __future__ import annotations

from adaptdl.core._validate import check_int
from adaptdl.core.loaderjob import LoaderJob
from adaptdl.core.loaderstate import LoaderState

__all__ = ["LoaderView"]


class LoaderView:
    """The seed API's properties of `adaptdl.core.loader.LoaderHelper` (which sets the
    attributes declared here)."""

    job: LoaderJob
    _state: LoaderState
    _max_batch_size: int | None
    _local_bsz_bounds: tuple[int | None, int | None] | None
    _gradient_accumulation: bool
    _accum_count: int
    _arrived_bsz: int | None
    _arrived_accum: int | None

    @property
    def name(self) -> str:
        return self._state.name

    # -- properties of the seed API -------------------------------------------------
    @property
    def current_index(self) -> int | None:
        """Samples processed by all replicas in the current loop; None outside a loop."""
        return self._state.current_index if self.job.current_loader is self else None

    @current_index.setter
    def current_index(self, value: int) -> None:
        self._state.current_index = check_int("current_index", value, min=0)

    @property
    def end_index(self) -> int:
        """A user-defined end index that survives restarts."""
        return self._state.end_index

    @end_index.setter
    def end_index(self, value: int) -> None:
        self._state.end_index = check_int("end_index", value, min=0)

    @property
    def max_batch_size(self) -> int | None:
        """Maximum total batch size; None when adaptive batch size is off."""
        return self._max_batch_size

    @property
    def local_bsz_bounds(self) -> tuple[int | None, int | None] | None:
        """(min_local_bsz, max_local_bsz) on each replica, or None."""
        return self._local_bsz_bounds

    @property
    def gradient_accumulation(self) -> bool:
        return self._gradient_accumulation

    @property
    def current_local_bsz(self) -> int:
        """The logical local batch size of one micro-batch on each replica.

        Inside a pass, the size of the batch in hand: batches issued ahead before a
        decision (DataLoader workers' prefetch) arrive at the size they were issued
        with, and the gradient's scaling and noise estimate must read that size.
        """
        arrived = self._arrived_bsz
        return self._state.current_local_bsz if arrived is None else arrived

    @property
    def accumulation_steps(self) -> int:
        """Micro-batches accumulated before the one that takes the optimiser step.

        Inside a pass, the count in force for the batch in hand: it changes together
        with `current_local_bsz`, at the first batch issued at the new size.
        """
        accum = self._arrived_accum
        return self._state.accumulation_steps if accum is None else accum

    @property
    def current_batch_size(self) -> int:
        """Total samples per optimiser step over all replicas and micro-batches."""
        replicas = self.job.topology.num_replicas
        return self.current_local_bsz * (self.accumulation_steps + 1) * replicas

    @property
    def training(self) -> bool:
        """Whether this is the job's training loader."""
        return self.job.training_loader is self

    def is_accum_step(self) -> bool:
        """Whether the current micro-batch's gradient is accumulated (no optimiser step).

        The one definition of it: the job's `accumulating`, the model wrappers and the
        loop itself ask here.
        """
        accum = self._arrived_accum
        return self._accum_count < (self._state.accumulation_steps if accum is None else accum)

    def is_optim_step(self) -> bool:
        """Whether the optimiser step is taken after the current micro-batch."""
        return not self.is_accum_step()
