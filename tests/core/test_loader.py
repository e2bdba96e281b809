"""The loader state machine: loops, replay, exactly-once over restarts and resizes."""

from __future__ import annotations

import math
import time
from collections import Counter

import attrs
import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from tests.core.test_batchsize import grad_params, job_settings, perf_params
from tests.fakes import ManualClock
from tests.threadcollective import run_replicas

from adaptdl.core.decide.batchsize import BatchSizeQuery, GoodputDecision, even_split
from adaptdl.core.goodput import GoodputFunction
from adaptdl.core.job import Job
from adaptdl.core.loop.boundary import AgreementCadence, CheckpointPolicy, Preempted
from adaptdl.core.loop.loader import LoaderHelper
from adaptdl.core.loop.loaderjob import LoaderJob
from adaptdl.core.order.sampling import Shard
from adaptdl.core.persist.checkpoint import MemoryCheckpointStore
from adaptdl.core.topology import Topology


def shard_batches(n, rank, replicas, shuffle=True):
    """The batches callback a real adapter gives the loader: this replica's indices."""

    def batches(epoch, index, local_bsz):
        shard = Shard(n, index, replicas, rank, epoch=epoch, shuffle=shuffle)
        for lo in range(0, shard.count, local_bsz):
            hi = min(lo + local_bsz, shard.count)
            yield list(
                zip(shard.indices(lo, hi).tolist(), shard.is_padding(lo, hi).tolist(), strict=True)
            )

    return batches


def one_replica_job(**kwargs):
    return Job(Topology(), **kwargs)


def test_one_pass_without_autoscale():
    job = one_replica_job()
    loader = LoaderHelper(job, batch_size=4)
    seen = []
    for _epoch in job.epoch.remaining_epochs_until(2):
        assert loader.current_index is None
        for batch in loader.iterate(10, shard_batches(10, 0, 1)):
            seen.append(batch)
        assert loader.current_index is None
    assert [len(b) for b in seen] == [4, 4, 2] * 2
    epoch0 = [i for b in seen[:3] for i, _ in b]
    assert sorted(epoch0) == list(range(10))


def test_current_index_counts_all_replicas_samples():
    job = one_replica_job()
    loader = LoaderHelper(job, batch_size=3)
    indices = []
    for _ in job.epoch.remaining_epochs_until(1):
        for _batch in loader.iterate(7, shard_batches(7, 0, 1)):
            indices.append(loader.current_index)
    assert indices == [0, 3, 6]


def test_loops_outside_epoch_loops_walk_one_pass_keyed_by_free_epoch():
    # The seed allows a test pass after the epoch loop; its order is that of free_epoch.
    job = one_replica_job()
    loader = LoaderHelper(job, batch_size=2)
    loader.autoscale_batch_size(4)  # an adaptive loop outside epochs walks one pass too
    got = [
        i for batch in loader.iterate(9, shard_batches(9, 0, 1), free_epoch=3) for i, _ in batch
    ]
    assert got == Shard(9, 0, 1, 0, epoch=3).indices(0, 9).tolist()
    assert loader.current_index is None and job.current_loader is None


def test_a_loop_after_the_epoch_loop_is_replayed_like_one_inside():
    store = MemoryCheckpointStore()

    def program(stop_at: int | None) -> list[list[int]]:
        job = one_replica_job(store=store)
        train, test = LoaderHelper(job, 2), LoaderHelper(job, 2)
        seen: list[list[int]] = []
        for _ in job.epoch.remaining_epochs_until(2):
            for batch in train.iterate(6, shard_batches(6, 0, 1)):
                seen.append([i for i, _ in batch])
        for loop in range(2):  # two passes after training, each its own loop
            for batch in test.iterate(6, shard_batches(6, 0, 1), free_epoch=loop):
                seen.append([i for i, _ in batch])
                if len(seen) == stop_at:
                    job.request_stop()  # takes effect at the boundary after the next batch
        return seen

    whole = program(None)
    assert store.labels() == []
    # Stop in the second test loop, then rerun: every earlier loop is skipped.
    with pytest.raises(Preempted):
        program(6 + 3 + 1)
    resumed = program(None)
    assert resumed == whole[-1:]


def test_position_resumes_the_next_loop_exactly_once():
    job = one_replica_job()
    loader = LoaderHelper(job, batch_size=2)
    first: list[int] = []
    saved = None
    for _ in job.epoch.remaining_epochs_until(1):
        for batch in loader.iterate(10, shard_batches(10, 0, 1)):
            first += [i for i, _ in batch]
            if len(first) == 4:
                saved = loader.position()  # between batches: counts the one just taken
                break
    assert saved is not None and saved["index"] == 4 and saved["epoch"] == 0
    assert loader.position()["index"] == 0  # the loop ended: a fresh one is next
    other = one_replica_job()  # another process, without the job's checkpoint
    resumed = LoaderHelper(other, batch_size=2)
    resumed.load_position(json_round_trip(saved))
    assert resumed.position()["index"] == 4
    rest = [i for b in resumed.iterate(10, shard_batches(10, 0, 1), free_epoch=7) for i, _ in b]
    assert sorted(first + rest) == list(range(10)) and len(rest) == 6
    with pytest.raises(ValueError, match="made by state_dict"):
        resumed.load_position({"index": 3})


def json_round_trip(value):
    import json

    return json.loads(json.dumps(value))


def test_two_loops_at_once_raise():
    job = one_replica_job()
    first, second = LoaderHelper(job, 2), LoaderHelper(job, 2)
    for _ in job.epoch.remaining_epochs_until(1):
        outer = iter(first.iterate(4, shard_batches(4, 0, 1)))
        next(outer)
        with pytest.raises(RuntimeError, match="only one dataloader loop"):
            next(iter(second.iterate(4, shard_batches(4, 0, 1))))
        outer.close()
        assert job.current_loader is None


def test_accumulation_counter():
    job = one_replica_job()
    loader = LoaderHelper(job, batch_size=8)
    loader.autoscale_batch_size(8, local_bsz_bounds=(1, 8), gradient_accumulation=True)
    loader._state.accumulation_steps = 2  # as a decision would set it
    flags = []
    for _ in range(6):
        with loader.profile(commit=False):
            flags.append((loader.is_accum_step(), loader.is_optim_step()))
    assert flags == [(True, False), (True, False), (False, True)] * 2


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"max_batch_size": 8}, "max_batch_size"),
        ({"max_batch_size": 32.0}, "max_batch_size"),
        ({"max_batch_size": True}, "max_batch_size"),
        ({"max_batch_size": 64, "local_bsz_bounds": (32, 16)}, "min <= max"),
        ({"max_batch_size": 64, "local_bsz_bounds": (17, None)}, "batch_size=16"),
        ({"max_batch_size": 64, "local_bsz_bounds": (None, 8)}, "batch_size=16"),
        ({"max_batch_size": 64, "local_bsz_bounds": (0, 32)}, "int >= 1"),
        ({"max_batch_size": 64, "local_bsz_bounds": (1, 2, 3)}, "pair"),
        ({"max_batch_size": 64, "gradient_accumulation": "yes"}, "gradient_accumulation"),
    ],
)
def test_autoscale_validation_raises_value_error(kwargs, match):
    loader = LoaderHelper(one_replica_job(), batch_size=16)
    with pytest.raises(ValueError, match=match):
        loader.autoscale_batch_size(**kwargs)
    assert loader.max_batch_size is None


@pytest.mark.parametrize("bad", [0, -1, 2.5, "4", None])
def test_bad_batch_size(bad):
    with pytest.raises(ValueError, match="batch_size"):
        LoaderHelper(one_replica_job(), batch_size=bad)


def test_only_one_training_loader():
    job = one_replica_job()
    a, b = LoaderHelper(job, 4), LoaderHelper(job, 4)
    a.train()
    a.train()
    assert a.training and not b.training
    with pytest.raises(RuntimeError, match="only one dataloader"):
        b.autoscale_batch_size(16)


def test_current_batch_size_and_even_split():
    topo = Topology(rank=0, num_replicas=1)
    job = Job(topo)
    loader = LoaderHelper(job, batch_size=10)
    assert loader.sync_local_bsz() == 10
    assert loader.current_batch_size == 10


def test_skipdone_replays_finished_loops():
    store = MemoryCheckpointStore()
    job = one_replica_job(store=store)
    train, valid = LoaderHelper(job, 2), LoaderHelper(job, 2)
    for _ in job.epoch.remaining_epochs_until(1):
        list(train.iterate(4, shard_batches(4, 0, 1)))
        job.checkpoint()  # the process dies after this, inside the epoch
        break
    again = one_replica_job(store=store)
    train2, valid2 = LoaderHelper(again, 2), LoaderHelper(again, 2)
    for _ in again.epoch.remaining_epochs_until(1):
        assert list(train2.iterate(4, shard_batches(4, 0, 1))) == []
        assert len(list(valid2.iterate(4, shard_batches(4, 0, 1)))) == 2
    del train, valid, valid2


# --- the central property: exactly once through restarts and resizes ---------------

segments = st.lists(
    st.tuples(st.integers(1, 6), st.integers(1, 9), st.integers(0, 12)),  # R, local bsz, steps
    min_size=1,
    max_size=5,
)


def run_segment(store, n, epochs, replicas, batch_size, stop_after):
    """Run every replica of one segment of the job; return what each consumed."""

    def replica(collective):
        topo = Topology(rank=collective.rank, num_replicas=replicas)
        job = Job(topo, collective=collective, store=store)
        loader = LoaderHelper(job, batch_size=batch_size)
        consumed = []
        steps = 0
        try:
            for epoch in job.epoch.remaining_epochs_until(epochs):
                for batch in loader.iterate(n, shard_batches(n, collective.rank, replicas)):
                    # Prefix invariant, checked on every replica at every boundary.
                    consumed.append((epoch, batch))
                    steps += 1
                    if steps == stop_after and collective.rank == 0:
                        job.request_stop()
        except Preempted:
            return consumed, True
        return consumed, False

    return run_replicas(replicas, replica)


@settings(max_examples=40)
@given(
    n=st.one_of(st.integers(1, 20), st.integers(21, 400)),
    epochs=st.integers(1, 3),
    timeline=segments,
)
def test_every_sample_once_per_epoch_across_restarts_and_resizes(n, epochs, timeline):
    store = MemoryCheckpointStore()
    per_epoch: dict[int, Counter] = {e: Counter() for e in range(epochs)}
    padding: Counter = Counter()
    finished = False
    for replicas, bsz, steps in [*timeline, (3, 4, 0)]:
        outcome = run_segment(store, n, epochs, replicas, bsz * replicas, steps or -1)
        for consumed, _stopped in outcome:
            for epoch, batch in consumed:
                for index, is_pad in batch:
                    (padding if is_pad else per_epoch[epoch])[epoch if is_pad else index] += 1
        if not any(stopped for _, stopped in outcome):
            finished = True
            break
    assert finished
    for epoch in range(epochs):
        assert per_epoch[epoch] == Counter(range(n)), f"epoch {epoch}"


def test_prefix_at_every_boundary_with_two_replicas():
    """After each step, the consumed positions of the pass are exactly [0, current_index)."""
    n, replicas = 23, 2
    seen_positions = []

    def replica(collective):
        job = Job(Topology(rank=collective.rank, num_replicas=replicas), collective=collective)
        loader = LoaderHelper(job, batch_size=6)
        mine = []
        for epoch in job.epoch.remaining_epochs_until(1):

            def batches(epoch, index, local_bsz, rank=collective.rank):
                shard = Shard(n, index, replicas, rank, epoch=epoch)
                for lo in range(0, shard.count, local_bsz):
                    hi = min(lo + local_bsz, shard.count)
                    yield shard.positions(lo, hi).tolist()

            for batch in loader.iterate(n, batches):
                mine.append((loader.current_index, batch))
        return mine

    outcome = run_replicas(replicas, replica)
    seen_positions = [a + b for a, b in zip(*[[p for _, p in o] for o in outcome], strict=True)]
    boundaries = [idx for idx, _ in outcome[0]]
    consumed: list[int] = []
    for start, batch in zip(boundaries, seen_positions, strict=True):
        assert sorted(set(consumed)) == list(range(min(start, n)))
        consumed.extend(batch)
    assert sorted(set(consumed)) == list(range(n))
    assert math.ceil(n / 6) == len(boundaries)
    assert np.all(np.array(boundaries) % 6 == 0)


def adaptive_segment(
    store,
    n,
    epochs,
    replicas,
    batch_size,
    stop_after,
    credit,
    *,
    decision=None,
    tick=None,
    agreement_cadence=None,
):
    """One launch of an adaptive job; each replica's [(epoch, index, batch, optim)], stopped.

    ``credit(loader)`` is the progress added after each optimiser step, in place of
    what AdaptiveDataParallel adds (the gain at the loader's batch size).
    """

    def replica(collective):
        topo = Topology(rank=collective.rank, num_replicas=replicas)
        job = Job(
            topo,
            collective=collective,
            store=store,
            clock=time.perf_counter if tick is None else ManualClock(tick),
            batch_size_decision=decision,
            agreement_cadence=agreement_cadence,
        )
        loader = LoaderHelper(job, batch_size=batch_size)
        loader.autoscale_batch_size(batch_size * 4, gradient_accumulation=True)
        consumed, steps = [], 0
        try:
            for epoch in job.epoch.remaining_epochs_until(epochs):
                for batch in loader.iterate(n, shard_batches(n, collective.rank, replicas)):
                    optim = loader.is_optim_step()
                    consumed.append((epoch, loader.current_index, batch, optim))
                    if optim:
                        job.metrics.add_progress(credit(loader))
                    steps += 1
                    if steps == stop_after and collective.rank == 0:
                        job.request_stop()
        except Preempted:
            return consumed, True
        return consumed, False

    return run_replicas(replicas, replica)


@settings(max_examples=25)
@given(
    n=st.integers(1, 60),
    timeline=st.lists(st.tuples(st.integers(1, 4), st.integers(1, 15)), min_size=1, max_size=4),
    scale=st.floats(0.3, 3.0),
)
def test_adaptive_loops_walk_whole_passes_in_order(n, timeline, scale):
    """An adaptive loop may take several passes; each pass is walked exactly once, in order."""
    store = MemoryCheckpointStore()
    per_pass: dict[tuple[int, int], Counter] = {}
    for replicas, steps in [*timeline, (2, 0)]:
        # The gain without a noise estimate: what add_progress(scale) adds.
        outcome = adaptive_segment(
            store,
            n,
            2,
            replicas,
            4,
            steps or -1,
            lambda loader: loader.job.metrics.gns.gain(scale),
        )
        for consumed, _ in outcome:
            for epoch, index, batch, _ in consumed:
                key = (epoch, index // n)
                for sample, is_pad in batch:
                    if not is_pad:
                        per_pass.setdefault(key, Counter())[sample] += 1
        if not any(stopped for _, stopped in outcome):
            break
    else:
        raise AssertionError("the job never finished")
    for epoch in range(2):
        passes = sorted(p for e, p in per_pass if e == epoch)
        # Never empty: progress carried over from the previous epoch ends none early.
        assert passes == list(range(max(len(passes), 1)))
        for p in passes[:-1]:
            assert per_pass[(epoch, p)] == Counter(range(n))
        assert all(c == 1 for c in per_pass[(epoch, passes[-1])].values())


def test_adaptive_loop_without_progress_raises():
    job = one_replica_job()
    loader = LoaderHelper(job, batch_size=2)
    loader.autoscale_batch_size(8)
    for _ in job.epoch.remaining_epochs_until(1):
        with pytest.raises(RuntimeError, match="no training progress"):
            list(loader.iterate(4, shard_batches(4, 0, 1)))


class Alternating:
    """A decision that changes its mind every time it is asked."""

    def __init__(self, choices):
        self.choices, self.calls = choices, 0

    def __call__(self, query):
        self.calls += 1
        return self.choices[self.calls % len(self.choices)]


def assert_each_pass_once(outcome, n):
    """Every pass but the last holds each sample once, the last none twice; the passes."""
    per_pass: dict[int, Counter] = {}
    for seen in outcome:
        for index, samples in seen:
            per_pass.setdefault(index // n, Counter()).update(samples)
    passes = sorted(per_pass)
    assert passes == list(range(len(passes)))
    for p in passes[:-1]:
        assert per_pass[p] == Counter(range(n))
    assert all(c == 1 for c in per_pass[passes[-1]].values())
    return passes


@settings(max_examples=25)
@given(
    n=st.integers(20, 80),
    replicas=st.integers(1, 3),
    choices=st.lists(st.tuples(st.integers(1, 5), st.integers(0, 2)), min_size=2, max_size=4),
    tick=st.floats(0.3, 2.0),
)
@example(n=25, replicas=3, choices=[(3, 2), (4, 2)], tick=1.0)  # one step per pass
def test_mid_pass_decisions_keep_every_sample_once(n, replicas, choices, tick):
    """Batch sizes re-decided inside a pass change nothing about what is consumed."""
    decisions = []

    def replica(collective):
        decide = Alternating(choices)
        job = Job(
            Topology(rank=collective.rank, num_replicas=replicas),
            collective=collective,
            clock=ManualClock(tick),
            batch_size_decision=decide,
        )
        # Target batch size 1: one pass's worth of progress is n optimiser steps
        # (each adds gain 1 while there is no noise estimate).
        loader = LoaderHelper(job, batch_size=1)
        loader.autoscale_batch_size(64, gradient_accumulation=True)
        seen = []
        for _epoch in job.epoch.remaining_epochs_until(1):
            for batch in loader.iterate(n, shard_batches(n, collective.rank, replicas)):
                seen.append((loader.current_index, [i for i, pad in batch if not pad]))
                if loader.is_optim_step():
                    job.metrics.add_progress(1.0)
        if collective.rank == 0:
            decisions.append(decide.calls)
        return seen

    outcome = run_replicas(replicas, replica)
    passes = assert_each_pass_once(outcome, n)
    # The clock runs fast enough that the job re-decided inside passes, where a pass
    # holds two steps at every size chosen. (Hypothesis found n = 25, 3 replicas and
    # totals 27 and 36: each pass was one step, with no boundary inside it to decide at.)
    if all(2 * local * replicas * (accum + 1) <= n for local, accum in choices):
        assert decisions[0] > len(passes)


def test_validation_batches_count_no_steps_toward_periodic_checkpoints():
    from adaptdl.core.loop.boundary import CheckpointPolicy

    job = one_replica_job(
        store=MemoryCheckpointStore(keep=100),
        checkpoint_policy=CheckpointPolicy(every_seconds=None, every_steps=4),
    )
    train, valid = LoaderHelper(job, 1), LoaderHelper(job, 1)
    train.train()
    for _ in job.epoch.remaining_epochs_until(1):
        for _batch in train.iterate(8, shard_batches(8, 0, 1)):
            pass
        for _batch in valid.iterate(40, shard_batches(40, 0, 1)):
            pass
    # Training boundaries 4 and 8 only; the 40 validation batches add none.
    assert job.checkpoints_written == 2


# -- adaptive epochs walk whole passes, whatever gain is credited ---------------------
# An adaptive loop ends on the job's scale-invariant progress, which the adapter credits
# after each optimiser step (the AdaScale gain at the loader's batch size, between 1 and
# the scale). These tests feed the loop the progress an adapter may credit, the maximum
# gain of a noise-dominated estimate included, batch sizes decided above the dataset
# size, and restarts at any step: no epoch may lose a sample or yield one twice in a pass.


def nominal_gain(fraction, batch_size):
    """What AdaptiveDataParallel credits a step: the gain at the loader's total batch
    size, ``1 + fraction * (scale - 1)``; ``fraction = 1`` is a noise-dominated estimate."""
    return lambda loader: 1.0 + fraction * (loader.current_batch_size / batch_size - 1.0)


def passes_per_epoch(n, epochs, batch_size, timeline, decision, fraction, tick):
    """Run the job through ``timeline`` of (replicas, batches before a stop) to its end."""
    store = MemoryCheckpointStore()
    per_pass: dict[int, dict[int, Counter]] = {e: {} for e in range(epochs)}
    last_optim: dict[int, bool] = {}
    for replicas, stop_after in [*timeline, (2, 0)]:
        credit = nominal_gain(fraction, batch_size)
        outcome = adaptive_segment(
            store,
            n,
            epochs,
            replicas,
            batch_size,
            stop_after or -1,
            credit,
            decision=decision,
            tick=tick,
        )
        for consumed, _ in outcome:
            for epoch, index, batch, optim in consumed:
                counter = per_pass[epoch].setdefault(index // n, Counter())
                counter.update(sample for sample, is_pad in batch if not is_pad)
                last_optim[epoch] = optim
        if not any(stopped for _, stopped in outcome):
            # Each loop ended on an optimiser step: no accumulated gradient is dropped.
            assert all(last_optim.values()), last_optim
            return per_pass
    raise AssertionError("the job never finished")


def assert_whole_passes(per_pass, n):
    for epoch, passes in per_pass.items():
        order = sorted(passes)
        # At least one pass, walked from the first: an epoch never yields nothing.
        assert order and order == list(range(len(order))), f"epoch {epoch}: passes {order}"
        # Every pass but the last is whole, each sample once; the first is always whole.
        for p in order[:-1] if len(order) > 1 else order:
            assert passes[p] == Counter(range(n)), f"epoch {epoch} pass {p}"
        # The last pass (where progress ran out) is a prefix: no sample twice.
        assert all(c == 1 for c in passes[order[-1]].values()), f"epoch {epoch}"


@settings(max_examples=40)
@given(
    n=st.one_of(st.integers(1, 12), st.integers(13, 60)),
    batch_size=st.integers(1, 8),
    timeline=st.lists(st.tuples(st.integers(1, 3), st.integers(1, 12)), max_size=3),
    choices=st.lists(st.tuples(st.integers(1, 130), st.integers(0, 2)), min_size=1, max_size=4),
    fraction=st.sampled_from([0.0, 0.5, 1.0]),
    tick=st.sampled_from([0.01, 0.7]),
)
def test_every_adaptive_epoch_walks_whole_passes_exactly_once(
    n, batch_size, timeline, choices, fraction, tick
):
    """For any dataset size, replica counts, restart points and batch-size decisions
    (above the dataset size too), and any gain the adapter credits, every epoch walks
    at least one whole pass, every pass in order with each sample once, and ends on an
    optimiser step."""
    per_pass = passes_per_epoch(n, 3, batch_size, timeline, Alternating(choices), fraction, tick)
    assert_whole_passes(per_pass, n)


def test_a_restart_that_decides_a_batch_above_the_dataset_loses_no_epoch():
    """The accelerator check's job: 512 samples, target 32, 2 replicas, stopped after 6
    steps (at index 192); the resumed run decides 1024 (local 512) and the
    noise-dominated estimate credits each step the full gain (32 for the 320 samples
    left in the pass). Every epoch must still see all 512 samples."""

    class ThenBig:
        def __init__(self) -> None:
            self.big = False

        def __call__(self, query: BatchSizeQuery) -> tuple[int, int]:
            return (512, 0) if self.big else even_split(query)

    decision = ThenBig()
    store = MemoryCheckpointStore()
    seen: dict[int, Counter] = {e: Counter() for e in range(3)}
    credit = nominal_gain(1.0, 32)
    # Agreeing at every boundary: a stop requested at the 5th is acted on at the 6th.
    every_boundary = AgreementCadence(max_every=1)
    first = adaptive_segment(
        store, 512, 3, 2, 32, 5, credit, decision=decision, agreement_cadence=every_boundary
    )
    # 6 batches taken from indices 0, 32, ..., 160: the checkpoint is at index 192.
    assert [index for _, index, _, _ in first[0][0]] == [32 * k for k in range(6)]
    decision.big = True
    second = adaptive_segment(store, 512, 3, 2, 32, -1, credit, decision=decision)
    assert all(stopped for _, stopped in first)
    assert not any(stopped for _, stopped in second)
    for consumed, _ in first + second:
        for epoch, _, batch, _ in consumed:
            seen[epoch].update(sample for sample, is_pad in batch if not is_pad)
    for epoch in range(3):
        assert seen[epoch] == Counter(range(512)), f"epoch {epoch}"


def largest(query: BatchSizeQuery) -> tuple[int, int]:
    """A decision that always takes the largest total the query allows, split evenly."""
    assert query.max_batch_size is not None
    return even_split(attrs.evolve(query, batch_size=query.max_batch_size))


@settings(max_examples=30)
@given(
    n=st.integers(1, 3000),
    batch_size=st.integers(1, 64),
    factor=st.integers(1, 64),
    replicas=st.integers(1, 4),
)
def test_decisions_are_asked_for_no_more_than_a_pass(n, batch_size, factor, replicas):
    """The query caps the total batch size at the dataset size (or the target, if larger)."""
    queries = []

    def replica(collective):
        def decide(query):
            queries.append(query)
            return even_split(query)

        job = Job(
            Topology(rank=collective.rank, num_replicas=replicas),
            collective=collective,
            batch_size_decision=decide,
        )
        loader = LoaderHelper(job, batch_size=batch_size)
        loader.autoscale_batch_size(batch_size * factor, gradient_accumulation=True)
        for _ in job.epoch.remaining_epochs_until(1):
            for _batch in loader.iterate(n, shard_batches(n, collective.rank, replicas)):
                if loader.is_optim_step():
                    job.metrics.add_progress(1.0)
        return loader.current_batch_size

    totals = run_replicas(replicas, replica)
    cap = min(batch_size * factor, max(n, batch_size))
    assert queries and all(q.max_batch_size == cap for q in queries)
    # Unless rounding the target up to the replicas passes it (the floor wins).
    floor = -(-batch_size // replicas) * replicas
    assert all(total <= max(cap, floor) for total in totals)


def test_no_step_holds_a_sample_twice_when_the_decision_takes_the_largest_total():
    """1 replica, 512 samples, up to 1024 in total with local at most 512 and
    accumulation: the largest total a pass allows is one step of 512, never two
    micro-batches that each walk the whole pass."""
    job = Job(Topology(), batch_size_decision=largest)
    loader = LoaderHelper(job, batch_size=32)
    loader.autoscale_batch_size(1024, local_bsz_bounds=(16, 512), gradient_accumulation=True)
    steps, step = [], Counter()
    for epoch in job.epoch.remaining_epochs_until(3):
        for batch in loader.iterate(512, shard_batches(512, 0, 1)):
            step.update(sample for sample, _ in batch)
            if loader.is_optim_step():
                steps.append((epoch, step))
                job.metrics.add_progress(loader.current_batch_size / 32)
                step = Counter()
    assert {epoch for epoch, _ in steps} == {0, 1, 2}
    assert all(max(counts.values()) == 1 for _, counts in steps)


def _protocol_members(protocol: type) -> set[str]:
    names = set(getattr(protocol, "__annotations__", {}))
    names |= {name for name in vars(protocol) if not name.startswith("_")}
    return names


class OnlyLoaderJob:
    """A job seen through `LoaderJob` alone: any other member is an AttributeError."""

    def __init__(self, job: Job) -> None:
        self._job = job
        self._allowed = _protocol_members(LoaderJob)

    def __getattr__(self, name: str):
        if name not in self._allowed:
            raise AttributeError(f"the loader read {name!r}, which LoaderJob does not declare")
        return getattr(self._job, name)


def test_loader_needs_only_the_members_of_its_protocol():
    """Adaptive loops with mid-pass decisions, a checkpoint and a stop, on the narrow job."""
    store = MemoryCheckpointStore()
    job = Job(
        Topology(),
        store=store,
        clock=ManualClock(1.0),
        batch_size_decision=Alternating([(2, 0), (3, 1)]),
        checkpoint_policy=CheckpointPolicy(every_steps=3),
    )
    narrow = OnlyLoaderJob(job)
    assert {"topology", "step_boundary", "metrics"} <= narrow._allowed
    assert "progress" not in narrow._allowed and "checkpoint" not in narrow._allowed
    loader = LoaderHelper(narrow, batch_size=2)  # type: ignore[arg-type]
    loader.autoscale_batch_size(8, gradient_accumulation=True)
    n, steps = 30, 0
    with pytest.raises(Preempted):
        for _ in job.epoch.remaining_epochs_until(3):
            for _batch in loader.iterate(n, shard_batches(n, 0, 1)):
                if loader.is_optim_step():
                    job.metrics.add_progress(1.0)
                    steps += 1
                    if steps == 40:
                        job.request_stop()
    assert job.checkpoints_written > 1
    # The same job restored resumes where it stopped, through the narrow view too.
    again = Job(Topology(), store=store)
    resumed = LoaderHelper(OnlyLoaderJob(again), batch_size=2)  # type: ignore[arg-type]
    assert resumed.current_local_bsz == loader.current_local_bsz


def test_one_loader_looped_twice_in_an_epoch_resumes_its_second_loop_exactly_once():
    store = MemoryCheckpointStore()

    def program(stop_at):
        job = one_replica_job(store=store)
        loader = LoaderHelper(job, 2)
        seen = []
        for _ in job.epoch.remaining_epochs_until(1):
            for _loop in range(2):
                for batch in loader.iterate(6, shard_batches(6, 0, 1)):
                    seen.append([i for i, _ in batch])
                    if len(seen) == stop_at:
                        job.request_stop()
        return seen

    whole = program(None)
    with pytest.raises(Preempted):
        program(4)  # the stop lands after batch 5: the second loop's second batch
    assert program(None) == whole[5:]


def test_the_training_loop_profiles_each_micro_batch_but_a_pass_s_first_with_its_own_sync():
    """Each micro-batch after a pass's first is recorded once, in its configuration, as
    accumulation or optimiser step, with its wall time and the sync time recorded
    while the loop trained on it; sync time recorded elsewhere counts for no batch."""
    clock = ManualClock()
    job = Job(Topology(), clock=clock, batch_size_decision=lambda query: (4, 1))
    loader = LoaderHelper(job, batch_size=8)
    loader.autoscale_batch_size(8, gradient_accumulation=True)
    job.record_sync_time(100.0)  # before the loop: no batch's
    expected: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
    for _ in job.epoch.remaining_epochs_until(1):
        for number, _batch in enumerate(loader.iterate(24, shard_batches(24, 0, 1))):
            accum = loader.is_accum_step()
            assert job.accumulating() == accum
            clock.now += 1.0 + number  # the batch's wall time
            job.record_sync_time(0.25 * number)
            if number:
                expected[accum].append((1.0 + number, 0.25 * number))
            if not accum:
                job.metrics.add_progress(1.0)
    assert not job.accumulating()  # outside a loop
    timing = job.metrics.profiler.timing(1, 1, 4)
    assert timing is not None
    for accum, part in ((True, timing.accum), (False, timing.optim)):
        steps = [step for step, _ in expected[accum]]
        syncs = [sync for _, sync in expected[accum]]
        assert part.count == len(steps) and part.step_sum == pytest.approx(sum(steps))
        assert part.sync_sum == pytest.approx(sum(syncs))
    assert timing.accum.count + timing.optim.count == 24 // 4 - 1


def test_a_loop_journals_each_batch_as_taken_with_one_whole_record(tmp_path, monkeypatch):
    """Before the loop sees a batch the journal holds the job's count with it; a loop
    writes one whole record (replays, checkpoint) and a checkpoint rebases it, the
    batches only store the running count."""
    from adaptdl.core.persist.journal import Journal, Mark

    whole: list[str] = []
    for name in ("write_counts", "rebase"):
        method = getattr(Journal, name)

        def counted(self, *args, _method=method, _name=name):
            whole.append(_name)
            _method(self, *args)

        monkeypatch.setattr(Journal, name, counted)
    store = MemoryCheckpointStore()
    job = one_replica_job(store=store, journal=Journal(tmp_path / "j"))
    loader = LoaderHelper(job, batch_size=4)
    read = []
    for _ in job.epoch.remaining_epochs_until(1):
        for i, _batch in enumerate(loader.iterate(10, shard_batches(10, 0, 1))):
            read.append(Journal(tmp_path / "j").read())
            if i == 1:
                job.checkpoint()
    assert [m.samples for m in read] == [4, 8, 10]
    assert [m.checkpoint for m in read] == [0, 0, 1]  # the checkpoint's rebase
    assert whole == ["write_counts", "rebase"]  # the loop's start; the checkpoint
    assert Journal(tmp_path / "j").read() == Mark(samples=10, checkpoint=1)


@pytest.mark.parametrize("mapped", [True, False])
def test_a_batch_taken_and_left_unconsumed_is_not_counted_as_taken(mapped):
    """A loop left right after taking a batch (a ``break``) leaves it unconsumed: the
    next loop takes it again, and the journal then holds what that loop took, not the
    abandoned batch on top (nor refuses the lower count)."""
    from adaptdl.core.persist.journal import Journal, Mark
    from adaptdl.core.persist.storage import MemoryStorage

    class Unmappable(MemoryStorage):
        def mapped(self, name, size):
            raise OSError("no maps")

    storage = MemoryStorage() if mapped else Unmappable()
    job = one_replica_job(store=MemoryCheckpointStore(), journal=Journal(storage))
    first, second = LoaderHelper(job, batch_size=8), LoaderHelper(job, batch_size=4)
    for _ in job.epoch.remaining_epochs_until(1):
        for _batch in first.iterate(16, shard_batches(16, 0, 1)):
            assert Journal(storage).read().samples == 8
            break
        assert job.samples_consumed == 0
        job.checkpoint()  # a whole record between the loops (checkpoint 1)
        for _batch in second.iterate(16, shard_batches(16, 0, 1)):
            assert Journal(storage).read() == Mark(samples=4, checkpoint=1)
            break


def floor_segment(store, n, replicas, settings_, stop_after, decision):
    """One launch of an adaptive job with ``settings_`` (batch size, max, bounds,
    accumulation); rank 0's decided total at every optimiser step, and whether it stopped."""
    batch_size, max_batch_size, bounds, accumulation = settings_

    def replica(collective):
        job = Job(
            Topology(rank=collective.rank, num_replicas=replicas),
            collective=collective,
            store=store,
            clock=ManualClock(0.01),  # every step alike: a flat throughput
            batch_size_decision=decision,
        )
        loader = LoaderHelper(job, batch_size=batch_size)
        loader.autoscale_batch_size(max_batch_size, bounds, gradient_accumulation=accumulation)
        totals, steps = [], 0
        try:
            for _ in job.epoch.remaining_epochs_until(2):
                for _batch in loader.iterate(n, shard_batches(n, collective.rank, replicas)):
                    if loader.is_optim_step():
                        totals.append(loader.current_batch_size)
                        job.metrics.add_progress(1.0)
                    steps += 1
                    if steps == stop_after and collective.rank == 0:
                        job.request_stop()
        except Preempted:
            return totals, True
        return totals, False

    return run_replicas(replicas, replica)[0]


@settings(max_examples=20, deadline=None)
@given(
    settings_=job_settings(),
    timeline=st.lists(st.tuples(st.integers(1, 4), st.integers(1, 12)), min_size=1, max_size=4),
    model=st.one_of(st.none(), st.tuples(perf_params, grad_params)),
)
def test_no_resize_or_restart_trains_a_step_below_the_initial_batch(settings_, timeline, model):
    """Issue 38, through the loader: every optimiser step's total, over restarts on other
    replicas, holds at least the initial batch size rounded up to the replicas (or
    the lower local bound on each). The decision is the job's own over its profile of
    equal step times (small batches rate as well as large ones), or one over a
    drawn fitted model."""
    batch_size, _, (lo, _), _ = settings_
    decision = None
    if model is not None:
        fn = GoodputFunction(model[0], model[1], batch_size)
        decision = GoodputDecision(lambda: fn)
    store = MemoryCheckpointStore()
    for replicas, steps in [*timeline, (1, 0)]:
        totals, stopped = floor_segment(store, 40, replicas, settings_, steps or -1, decision)
        local = -(-batch_size // replicas)
        if batch_size <= 40:  # rounding up stays within each replica's share of the pass
            local = min(local, 40 // replicas)
        floor = max(local, lo or 1) * replicas
        assert all(total >= floor for total in totals), (replicas, totals)
        if not stopped:
            break
