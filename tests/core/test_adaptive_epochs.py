"""Adaptive loops: every epoch walks whole passes, whatever progress and batch sizes.

An adaptive loop ends on the job's scale-invariant progress, which the adapter
credits after each optimiser step (the AdaScale gain at the loader's batch size,
between 1 and the scale). These tests feed the loop the progress an adapter may
credit, including the maximum gain of a noise-dominated estimate, batch sizes
decided above the dataset size, and restarts at any step, and check what the
loops yield: no epoch may lose a sample or yield one twice within a pass.
"""

from __future__ import annotations

from collections import Counter

import attrs
from hypothesis import given, settings
from hypothesis import strategies as st

from adaptdl.core.batchsize import BatchSizeQuery, even_split
from adaptdl.core.checkpoint import MemoryCheckpointStore
from adaptdl.core.collective import run_replicas
from adaptdl.core.job import Job, Preempted
from adaptdl.core.loader import LoaderHelper
from adaptdl.core.sampling import Shard
from adaptdl.core.topology import Topology


def shard_batches(n, rank, replicas):
    """The batches callback a real adapter gives the loader: (index, is_padding) pairs."""

    def batches(epoch, index, local_bsz):
        shard = Shard(n, index, replicas, rank, epoch=epoch)
        for lo in range(0, shard.count, local_bsz):
            hi = min(lo + local_bsz, shard.count)
            yield list(
                zip(shard.indices(lo, hi).tolist(), shard.is_padding(lo, hi).tolist(), strict=True)
            )

    return batches


class TickingClock:
    """A clock that advances a fixed amount each time it is read (mid-pass decisions)."""

    def __init__(self, tick: float) -> None:
        self.now, self.tick = 0.0, tick

    def __call__(self) -> float:
        self.now += self.tick
        return self.now


class Cycling:
    """A decision that returns its choices in turn, ignoring the query."""

    def __init__(self, choices):
        self.choices, self.calls = choices, 0

    def __call__(self, query):
        choice = self.choices[self.calls % len(self.choices)]
        self.calls += 1
        return choice


def run_segment(store, n, epochs, batch_size, replicas, stop_after, decision, fraction, tick):
    """One launch of the job; returns each replica's (epoch, index, batch) and stopped flag.

    After each optimiser step the job's progress grows by what AdaptiveDataParallel
    credits: the gain at the loader's (nominal) total batch size, here
    ``1 + fraction * (scale - 1)``, with ``fraction = 1`` the noise-dominated maximum.
    """

    def replica(collective):
        job = Job(
            Topology(rank=collective.rank, num_replicas=replicas),
            collective=collective,
            store=store,
            clock=TickingClock(tick),
            batch_size_decision=decision,
        )
        loader = LoaderHelper(job, batch_size=batch_size)
        loader.autoscale_batch_size(batch_size * 64, gradient_accumulation=True)
        consumed, steps = [], 0
        try:
            for epoch in job.epoch.remaining_epochs_until(epochs):
                for batch in loader.iterate(n, shard_batches(n, collective.rank, replicas)):
                    optim = loader.is_optim_step()
                    consumed.append((epoch, loader.current_index, batch, optim))
                    if optim:
                        scale = loader.current_batch_size / batch_size
                        job.gns.progress += 1.0 + fraction * (scale - 1.0)
                        steps += 1
                        if steps == stop_after and collective.rank == 0:
                            job.request_stop()
        except Preempted:
            return consumed, True
        return consumed, False

    return run_replicas(replicas, replica)


def passes_per_epoch(n, epochs, batch_size, timeline, decision, fraction, tick):
    """Run the job through ``timeline`` of (replicas, steps before a stop) to its end."""
    store = MemoryCheckpointStore()
    per_pass: dict[int, dict[int, Counter]] = {e: {} for e in range(epochs)}
    last_optim: dict[int, bool] = {}
    for replicas, stop_after in [*timeline, (2, 0)]:
        outcome = run_segment(
            store, n, epochs, batch_size, replicas, stop_after or -1, decision, fraction, tick
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
    per_pass = passes_per_epoch(n, 3, batch_size, timeline, Cycling(choices), fraction, tick)
    assert_whole_passes(per_pass, n)


def test_a_restart_that_decides_a_batch_above_the_dataset_loses_no_epoch():
    """The accelerator check's job: 512 samples, target 32, 2 replicas, stopped after 6
    steps; the resumed run decides 1024 (local 512) and the noise-dominated estimate
    credits each step the full gain. Every epoch must still see all 512 samples."""

    class ThenBig:
        def __init__(self) -> None:
            self.big = False

        def __call__(self, query: BatchSizeQuery) -> tuple[int, int]:
            return (512, 0) if self.big else even_split(query)

    decision = ThenBig()
    store = MemoryCheckpointStore()
    seen: dict[int, Counter] = {e: Counter() for e in range(3)}
    first = run_segment(store, 512, 3, 32, 2, 5, decision, 1.0, 1e-6)
    decision.big = True
    second = run_segment(store, 512, 3, 32, 2, -1, decision, 1.0, 1e-6)
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
                    job.gns.progress += 1.0
        return loader.current_batch_size

    totals = run_replicas(replicas, replica)
    cap = min(batch_size * factor, max(n, batch_size))
    assert queries and all(q.max_batch_size == cap for q in queries)
    if cap >= replicas:  # even_split keeps one sample per replica at least
        assert all(total <= cap for total in totals)


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
                job.gns.progress += loader.current_batch_size / 32
                step = Counter()
    assert {epoch for epoch, _ in steps} == {0, 1, 2}
    assert all(max(counts.values()) == 1 for _, counts in steps)
