"""The state machine behind ``AdaptiveDataLoaderHelper``: one adaptive loop at a time.

A loop walks the passes of an epoch. ``current_index`` counts the samples all
replicas consumed in the current loop; the sampler turns it into each replica's
next indices, so that whatever sequence of world sizes and batch sizes produced
it, the consumed samples are a prefix of the pass's permutation. A loop without
adaptive batch size ends after one pass; an adaptive loop ends once the job's
scale-invariant progress reaches what one pass at the target batch size would
make (AdaptDL's rule), and may walk several passes to get there.
"""

from __future__ import annotations

import logging
import math
from collections import defaultdict, deque
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any, TypeVar

from adaptdl.core.collective import maximum
from adaptdl.core.decide.batchsize import BatchSizeDecision, batch_size_query
from adaptdl.core.loop import lifecycle
from adaptdl.core.loop.loaderjob import LoaderJob
from adaptdl.core.loop.loaderstate import LoaderState, check_local_bsz_bounds
from adaptdl.core.loop.passbatches import BatchesFn, IssuedSizes
from adaptdl.core.persist.checkpoint import CheckpointError
from adaptdl.core.validate import check_int

__all__ = ["LoaderHelper"]

LOG = logging.getLogger("adaptdl.core.loop.loader")
_POSITION_FORMAT = 1
_NEVER = 2**63  # the batch number of a decision that is not coming
T = TypeVar("T")


class LoaderHelper:
    """Fine-grained control over one adaptive loader of a job (the seed's helper).

    Its properties are the seed API's view of the loader: its name, the loop's index
    and the user's end index (which survives restarts), the limits set by
    `autoscale_batch_size`, the sizes and accumulation count of the batch in hand, and
    the one accumulation predicate (`is_accum_step`) that the loop, the job's
    `accumulating` and the model wrappers all ask.
    """

    def __init__(
        self,
        job: LoaderJob,
        batch_size: int = 1,
        *,
        name: str | None = None,
        decision: BatchSizeDecision | None = None,
    ) -> None:
        self.job = job
        self.batch_size = check_int("batch_size", batch_size, min=1)
        self._state = LoaderState(name or job.unique_name("adaptdl-dataloader"))
        # A loader the checkpoint lacks was made after it (a test loader after
        # training): its loops have not run, so it starts at their beginning.
        job.register(self._state, allow_missing=True)
        self._decision = decision
        self._max_batch_size: int | None = None
        self._local_bsz_bounds: tuple[int | None, int | None] | None = None
        self._gradient_accumulation = False
        # Loops entered so far in each epoch (None: outside epoch loops) during this
        # run of the program.
        self._position: defaultdict[int | None, int] = defaultdict(int)
        self._accum_count = 0
        self._skipped = False  # whether the loop in `context` was skipped by replay
        self._in_flight = 0  # samples of the batch the loop has yielded and not yet counted
        # The size and accumulation count of the batch in hand while batches issued
        # before an in-place decision arrive (None: the decided ones, in `_state`).
        self._arrived_bsz: int | None = None
        self._arrived_accum: int | None = None
        # Decisions still to apply: (from batch number, local_bsz, accumulation steps).
        self._changes: deque[tuple[int, int, int]] = deque()
        self._loop_epoch: int | None = None  # the epoch keying the running loop's passes
        self._resume_epoch: int | None = None  # set by load_position: keys the next loop

    # -- configuration --------------------------------------------------------------
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

    def train(self) -> None:
        """Make this the job's training loader (only one may be)."""
        self.job.set_training_loader(self)

    def autoscale_batch_size(
        self,
        max_batch_size: int,
        local_bsz_bounds: tuple[int | None, int | None] | None = None,
        gradient_accumulation: bool = False,
    ) -> None:
        """Enable adaptive batch size up to ``max_batch_size`` in total.

        Raises ValueError when ``max_batch_size`` is not an int at least the target
        batch size, or when ``local_bsz_bounds`` is not a pair (min, max) of ints
        (either may be None) with 1 <= min <= batch_size <= max, as the seed API
        requires.
        """
        if (
            isinstance(max_batch_size, bool)
            or not isinstance(max_batch_size, int)
            or max_batch_size < self.batch_size
        ):
            raise ValueError(
                f"max_batch_size must be an int >= batch_size={self.batch_size}, "
                f"got {max_batch_size!r}"
            )
        bounds = check_local_bsz_bounds(local_bsz_bounds, self.batch_size)
        if not isinstance(gradient_accumulation, bool):
            raise ValueError(
                f"gradient_accumulation must be a bool, got {gradient_accumulation!r}"
            )
        self._max_batch_size = max_batch_size
        self._local_bsz_bounds = bounds
        self._gradient_accumulation = gradient_accumulation
        self.train()

    # -- loop protocol ----------------------------------------------------------------
    @contextmanager
    def context(self) -> Iterator[None]:
        """Enter this loader's loop; only one loop of a job may run at a time.

        Inside an epoch loop, loops are counted per epoch; outside one, they are
        counted apart (the seed's rule), so that replay skips them alike.
        """
        epoch = self.job.epoch.current_epoch
        self.job.enter_loader(self)
        self._skipped = False
        try:
            yield
        finally:
            self.job.exit_loader(self)
            if not self._skipped:
                # A skipped loop leaves the restored position to the loop it belongs to.
                self._state.current_index = 0
                self._state.last_position[epoch] = self._position[epoch]
                self._accum_count = 0
                self._resume_epoch = None
            self._position[epoch] += 1
            self._in_flight = 0
            self._loop_epoch = None

    def skipdone(self) -> bool:
        """True when this loop already finished before a restart (replay skips it)."""
        epoch = self.job.epoch.current_epoch
        position = self._position[epoch]
        if position <= self._state.last_position.get(epoch, -1):
            where = "outside epoch loops" if epoch is None else f"of epoch {epoch}"
            LOG.debug("skipping %s loop %d %s: done before restart", self.name, position, where)
            self._skipped = True
            return True
        return False

    # -- position as a JSON-safe dict (torchdata's StatefulDataLoader protocol) ---------
    def position(self) -> dict[str, Any]:
        """Where this loader's loop stands, as a JSON-safe dict for `load_position`.

        Taken between batches of a loop, it counts the batch the loop last yielded
        as consumed; taken outside a loop, it describes the loop that the next
        iteration starts (fresh, or resumed after `load_position` or a restore).
        Only the position: which loops finished is the job's checkpoint's business.
        """
        in_loop = self.job.current_loader is self
        accum_count = 0
        if in_loop and self._in_flight:  # the yielded micro-batch counts as done
            accum_count = 0 if self.is_optim_step() else self._accum_count + 1
        return {
            "format": _POSITION_FORMAT,
            "index": self._state.current_index + (self._in_flight if in_loop else 0),
            "epoch": self._loop_epoch if in_loop else self._resume_epoch,
            "local_bsz": self._state.current_local_bsz,
            "accumulation_steps": self._state.accumulation_steps,
            "accum_count": accum_count,
            "dataset_len": self._state.dataset_len,
            "end_index": self._state.end_index,
        }

    def load_position(self, position: Mapping[str, Any]) -> None:
        """Make the next loop of this loader resume where ``position`` stands.

        The resumed loop walks the passes of the epoch it was taken in, from the
        sample after the last one counted, so that every sample of the pass is
        consumed once. Raises RuntimeError inside this loader's loop, ValueError
        for a dict `position` did not make.
        """
        if self.job.current_loader is self:
            raise RuntimeError(f"{self.name}: load_state_dict() inside its own loop")
        if not isinstance(position, Mapping) or position.get("format") != _POSITION_FORMAT:
            raise ValueError(
                f"state_dict must be a dict made by state_dict() (format {_POSITION_FORMAT}), "
                f"got {position!r:.80}"
            )
        try:
            index = check_int("index", position["index"], min=0)
            epoch = position["epoch"]
            if epoch is not None:
                epoch = check_int("epoch", epoch, min=0)
            values = {
                key: check_int(key, position[key], min=0)
                for key in ("local_bsz", "accumulation_steps", "accum_count", "dataset_len")
            }
            end_index = check_int("end_index", position["end_index"], min=0)
        except KeyError as exc:
            raise ValueError(f"state_dict lacks {exc}: make it with state_dict()") from None
        self._state.current_index = index
        self._state.current_local_bsz = values["local_bsz"]
        self._state.accumulation_steps = values["accumulation_steps"]
        self._state.dataset_len = values["dataset_len"]
        self._state.end_index = end_index
        self._accum_count = values["accum_count"]
        self._resume_epoch = epoch if index > 0 else None

    def sync_local_bsz(self) -> int:
        """Choose (local_bsz, accum_steps) for the replicas the job has, the same on all.

        The query is core's `batch_size_query`, the one the cluster simulator asks
        too; an adaptive loop's total is capped at its dataset's size.
        """
        topo = self.job.topology
        previous = self._state.current_local_bsz
        query = batch_size_query(
            topo.num_nodes,
            topo.num_replicas,
            self.batch_size,
            max_batch_size=self._max_batch_size,
            local_bsz_bounds=self._local_bsz_bounds,
            gradient_accumulation=self._gradient_accumulation,
            local_bsz=previous,
            accum_steps=self._state.accumulation_steps,
            dataset_size=self._state.dataset_len,
        )
        decide = self._decision or self.job.batch_size_decision
        local, accum = decide(query) if self.job.topology.rank == 0 else (0, 0)
        local, accum = self.job.collective.broadcast([int(local), int(accum)])
        before = (previous, self._state.accumulation_steps, self._state.num_replicas)
        self._state.current_local_bsz = local
        self._state.accumulation_steps = accum
        self._state.num_replicas = topo.num_replicas
        # Any change of the total, a restart on other replicas included.
        if (local, accum, topo.num_replicas) != before and topo.rank == 0:
            if self.job.training_loader in (None, self):
                self.job.batch_size_changed()  # the scheduler hears of it at the next step
            lifecycle.batch_size_changed(
                self.name,
                local=local,
                micro_batches=accum + 1,
                replicas=topo.num_replicas,
                total=self.current_batch_size,
            )
        return local

    @contextmanager
    def profile(self, commit: bool) -> Iterator[None]:
        """Time one micro-batch; record it in the job's profiler when ``commit``.

        For a custom loop (the seed's helper API); `iterate` does the same for its
        batches.
        """
        start = self._start_profile()
        yield
        if commit:
            self._record_profile(start, self._state.current_local_bsz)
        self._count_micro_batch()

    def _start_profile(self) -> float:
        start = self.job.clock()
        self.job.take_sync_time()
        return start

    def _recorder(self, local_bsz: int) -> Callable[[bool, float, float], None]:
        """The profiler's record of micro-batches of ``local_bsz`` in this configuration."""
        topo = self.job.topology
        return self.job.metrics.profiler.recorder(topo.num_nodes, topo.num_replicas, local_bsz)

    def _record_profile(self, start: float, local_bsz: int) -> None:
        self._recorder(local_bsz)(
            self.is_accum_step(), self.job.clock() - start, self.job.take_sync_time()
        )

    def _count_micro_batch(self) -> bool:
        """Count one micro-batch; True when it ends an optimiser step (the next starts one)."""
        if self.is_accum_step():
            self._accum_count += 1
            return False
        self._accum_count = 0
        return True

    def _defer_change(self, arrived: int, at: int, size: int, accum: int) -> int:
        """Where a decision made after ``arrived`` batches applies, sizes issued up to
        ``at`` kept: the first step boundary at or after ``at`` of the batches issued
        before it (of ``size`` and accumulation count ``accum`` from ``arrived``, or
        the last pending decision's from its batch). Until then the batch in hand's
        size and count stay theirs."""
        changes = self._changes
        base, _, period = changes[-1] if changes else (arrived, size, accum)
        period += 1
        at = base + -(-max(at - base, 0) // period) * period
        if self._arrived_bsz is None:
            self._arrived_bsz, self._arrived_accum = size, accum
        changes.append((at, self._state.current_local_bsz, self._state.accumulation_steps))
        return at

    def _apply_changes(self, number: int) -> tuple[int, int]:
        """Apply the decisions due at batch ``number``: (its size, the batch number of
        the next decision, or `_NEVER`)."""
        changes = self._changes
        size, accum = self.current_local_bsz, self.accumulation_steps
        while changes and changes[0][0] <= number:
            _, size, accum = changes.popleft()
        if changes:
            self._arrived_bsz, self._arrived_accum = size, accum
            return size, changes[0][0]
        self._arrived_bsz = self._arrived_accum = None  # the decided ones
        return size, _NEVER

    def iterate(
        self,
        dataset_len: int,
        batches: BatchesFn[T],
        *,
        free_epoch: int = 0,
        after: Callable[[], object] | None = None,
    ) -> Iterator[T]:
        """Drive one loop: yield the batches that ``batches`` makes, pass after pass.

        Inside an epoch loop the epoch keys the passes' permutations; outside one
        (the seed allows it, e.g. a test pass after training), ``free_epoch`` does
        (an adaptive loop then stops after one pass). Raises RuntimeError while
        another loop runs, and ValueError when a whole pass yields no batch
        (``batches`` drops a short last batch, as ``drop_last=True`` does, and the
        local batch size exceeds a replica's share): such a loop would never end.
        At each optimiser-step boundary, and at the loop's end (`end_loop`), the
        job's stop flag is checked; when set, the job checkpoints and raises
        `Preempted`. A batch size decided in the middle of a pass applies in place
        when ``batches`` gives `passbatches.ResizableBatches` (from a batch number all replicas
        agree on; the batches issued before it keep their size), and otherwise
        from a new call of ``batches`` at the current index. ``after``, when given,
        is called once the loop has ended, however it ended (so that an adapter
        needs no generator of its own around this one: each level costs every batch).
        """
        n = check_int("dataset length", dataset_len, min=1)
        check_int("free_epoch", free_epoch, min=0)
        job_epoch = self.job.epoch.current_epoch
        self._check_dataset_len(n)
        resume_epoch, accum_count = self._resume_epoch, self._accum_count
        with self.context(), _calling(after):
            if self.skipdone():
                return
            self.job.loop_resumes()
            epoch = job_epoch if job_epoch is not None else free_epoch
            if resume_epoch is not None and resume_epoch != epoch:
                LOG.warning(
                    "%s resumes a loop of epoch %d in epoch %d: it finishes the pass it was "
                    "saved in",
                    self.name,
                    resume_epoch,
                    epoch,
                )
                epoch = resume_epoch
            self._loop_epoch = epoch
            self._accum_count = accum_count
            if self._state.current_index > 0 and self.job.topology.rank == 0:
                # Only a restore leaves a loop's index past 0 when the loop starts.
                lifecycle.loop_resumed(
                    self.name, epoch=epoch, index=self._state.current_index, dataset_len=n
                )
            # The passes, from the current index until `_finished` (inline: a generator
            # level more costs every batch).
            job, state = self.job, self._state
            replicas = job.topology.num_replicas
            adaptive = self._max_batch_size is not None
            clock, take_sync, counting = job.clock, job.take_sync_time, job.count_samples
            # Without a journal, taking a batch records nothing: no call for it.
            journal_taken, counts = job.samples_recorder(), job.state
            # Checked first too: a restart may land exactly where the loop had ended.
            decided = False  # whether (local_bsz, accum) was just decided mid-pass
            local_bsz, progress, steps = 0, 0.0, 0
            while not self._finished(n, job_epoch):
                if not decided:  # a pass starts
                    local_bsz = self.sync_local_bsz()
                    progress, steps = job.metrics.progress, 0
                decided = False
                start = state.current_index
                pass_end = (start // n + 1) * n
                made = batches(epoch, start, local_bsz)
                # Batches that can change size in place: a decision applies from a batch
                # number (`_changes`); until then batches arrive at the size issued.
                # (Not isinstance of the protocol: that inspects the protocol at every call.)
                sizes = getattr(made, "sizes", None)
                if not isinstance(sizes, IssuedSizes):
                    sizes = None
                # What follows runs once per batch, where every Python call shows in the
                # loader's throughput: invariants of the pass are hoisted, the micro-batch
                # is counted here (`_count_micro_batch`), and a decision's batch number
                # is the only check per batch.
                size, full, change_at = local_bsz, replicas * local_bsz, _NEVER
                record: Callable[[bool, float, float], None] | None = None
                # Batches up to this one go unprofiled: the pass's first waits for the
                # data, the first at a new size pays for its new shapes (allocations,
                # kernel selection: 1.5-1.9x a steady step of a CNN on CPU, far more
                # with cuDNN's autotuning), which no later step at that size pays again.
                warm = 0
                try:
                    for i, batch in enumerate(made):
                        if i >= change_at:
                            before, (size, change_at) = size, self._apply_changes(i)
                            full, record = replicas * size, None
                            if size != before:
                                warm = i
                        index = state.current_index
                        # The pass's last batch may be short: count only real positions.
                        step = full if index + full <= pass_end else pass_end - index
                        if journal_taken is not None:
                            journal_taken(counts.samples_consumed + step)
                        self._in_flight = step
                        trainer = job.training_loader
                        if trainer is not self:
                            yield batch
                            accumulating = self.is_accum_step()
                        elif i > warm:
                            if record is None:
                                record = self._recorder(size)
                            began = clock()
                            yield batch
                            accumulating = self.is_accum_step()
                            record(accumulating, clock() - began, take_sync())
                        else:
                            yield batch
                            accumulating = self.is_accum_step()
                            take_sync()  # not profiled: its sync time counts for no batch
                        self._in_flight = 0
                        state.current_index = index + step
                        counting(step)
                        if accumulating:
                            self._accum_count += 1
                            continue
                        self._accum_count = 0
                        steps += 1
                        # Without a designated training loader, every loop trains.
                        boundary = job.step_boundary(training=trainer is None or trainer is self)
                        if adaptive and self._finished(n, job_epoch):
                            break
                        if boundary.redecide:
                            before = self.accumulation_steps
                            if not self._redecided():
                                continue
                            local_bsz = state.current_local_bsz
                            if sizes is None:
                                # Go on from the current index with the new batch size.
                                decided = True
                                break
                            # From the first batch no replica has issued yet, rounded up
                            # to a step boundary: batches already issued make whole steps
                            # of the old size and count, then both change.
                            at = job.collective.allreduce(sizes.issued, maximum)
                            at = self._defer_change(i + 1, at, size, before)
                            sizes.resize(local_bsz, at)
                            change_at = self._changes[0][0]
                    else:
                        # The pass ran to its end.
                        if start % n == 0 and state.current_index == start:
                            raise self._empty_pass(n, local_bsz)
                        if (
                            adaptive
                            and steps > 0
                            and job.metrics.progress == progress
                            and not self._finished(n, job_epoch)
                        ):
                            raise RuntimeError(
                                f"{self.name}: a whole pass with adaptive batch size made no "
                                "training progress; train with AdaptiveDataParallel, which "
                                "records it"
                            )
                        # The next pass starts at the next multiple of n.
                        state.current_index = math.ceil(state.current_index / n) * n
                finally:
                    # Drop the pass's iterator (a DataLoader's, with its workers) now, also
                    # when an exception (`Preempted`) keeps this frame alive in its traceback.
                    made = sizes = record = None  # type: ignore[assignment]
                    self._arrived_bsz = self._arrived_accum = None
                    self._changes.clear()
            # Every replica ends the loop here, at the same boundary.
            self.job.end_loop()

    def _empty_pass(self, n: int, local_bsz: int) -> ValueError:
        """A whole pass yielded no batch: the loop would never end (nor see a SIGTERM)."""
        replicas = self.job.topology.num_replicas
        share = n // replicas
        allowed = f"batch_size <= {share * replicas}"
        if self._max_batch_size is not None:
            allowed += f" and local_bsz_bounds min <= {max(share, 1)}"
        return ValueError(
            f"{self.name}: a whole pass of {n} samples yielded no batch at local batch size "
            f"{local_bsz} on {replicas} replicas (batch_size={self.batch_size}): with "
            f"drop_last=True every batch smaller than {local_bsz} is dropped, and a "
            f"replica's share of the pass is {share} samples. Use {allowed}, or "
            "drop_last=False."
        )

    def _redecided(self) -> bool:
        """Ask the decision again mid-pass (the job said so); True if it changed."""
        if not (self.training and self._max_batch_size is not None):
            return False
        before = (self._state.current_local_bsz, self._state.accumulation_steps)
        self.sync_local_bsz()
        return (self._state.current_local_bsz, self._state.accumulation_steps) != before

    def _check_dataset_len(self, n: int) -> None:
        """Refuse to resume a loop over a dataset whose length changed; record ``n``."""
        recorded = self._state.dataset_len
        if recorded and recorded != n:
            store = self.job.store
            root = store.root if store is not None else None
            where = f"'{root}'" if root is not None else "the checkpoint store"
            if self._state.current_index > 0:
                raise CheckpointError(
                    f"{self.name} resumes a loop over a dataset of {recorded} samples (from "
                    f"checkpoint {self.job.restored_from}) but the dataset now has {n}: the "
                    "dataset changed since the checkpoint, and its positions no longer name "
                    f"the same samples. Restore the original dataset, or remove {where} to "
                    "start the job from scratch."
                )
            LOG.warning(
                "%s: the dataset had %d samples in the previous loop and has %d now",
                self.name,
                recorded,
                n,
            )
        self._state.dataset_len = n

    def _finished(self, n: int, epoch: int | None) -> bool:
        """One pass without adaptive batch size or outside epoch loops; with it, one
        pass's worth of progress, after one whole pass at least, at an optimiser-step
        boundary."""
        walked = self._state.current_index >= n
        if self._max_batch_size is None or epoch is None:
            return walked
        # The target is cumulative, so progress credited beyond one epoch's target
        # (a step's gain is up to its scale, and a step cut short by the end of a
        # pass is credited at the decided batch size) counts toward the next one:
        # without `walked`, that epoch could end early, or yield no batch at all.
        # Once a pass ends inside an accumulated step, the step ends in the next pass.
        return (
            walked
            and self._accum_count == 0
            and self.job.metrics.progress >= n * (epoch + 1) / self.batch_size
        )


@contextmanager
def _calling(after: Callable[[], object] | None) -> Iterator[None]:
    """Call ``after`` (unless None) on leaving the block, however it is left."""
    try:
        yield
    finally:
        if after is not None:
            after()
