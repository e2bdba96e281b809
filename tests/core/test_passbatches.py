"""Batch sizes that change in place: the loop counts each batch at the size it was issued at.

An adapter that draws batches ahead (DataLoader workers) hands the loop
`ResizableBatches`; a decision in the middle of a pass then changes the size of
the batches issued from a batch number all replicas agree on, and neither the
pass nor its readers start anew. Whatever each replica drew ahead, every sample
of a pass is consumed once and the replicas stay in step.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from itertools import pairwise

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tests.core.test_loader import Alternating, assert_each_pass_once
from tests.fakes import ManualClock
from tests.threadcollective import ThreadCollective, run_replicas

from adaptdl.core.job import Job
from adaptdl.core.loop.loader import LoaderHelper
from adaptdl.core.loop.passbatches import IssuedSizes, ResizableBatches
from adaptdl.core.order.sampling import Shard
from adaptdl.core.topology import Topology

Batch = list[tuple[int, bool]]


class Prefetching:
    """A replica's batches of a pass, issued ``depth`` batches ahead of the loop.

    As torch's DataLoader does: the next batch is issued when one is handed to the
    loop, before the loop trains on it.
    """

    def __init__(self, shard: Shard, depth: int, sizes: IssuedSizes) -> None:
        self.shard, self.depth, self.sizes = shard, depth, sizes

    def __iter__(self) -> Iterator[Batch]:
        shard, pending, lo = self.shard, deque[Batch](), 0

        def issue() -> None:
            nonlocal lo
            if lo < shard.count:
                hi = min(lo + self.sizes.issue(), shard.count)
                indices, padding = shard.indices(lo, hi).tolist(), shard.is_padding(lo, hi)
                pending.append(list(zip(indices, padding.tolist(), strict=True)))
                lo = hi

        for _ in range(self.depth + 1):
            issue()
        while pending:
            batch = pending.popleft()
            issue()
            yield batch


def test_a_new_size_applies_from_the_agreed_batch() -> None:
    sizes = IssuedSizes(4)
    sizes.start(4)
    assert [sizes.issue() for _ in range(3)] == [4, 4, 4]
    sizes.resize(2, at=5)
    assert [sizes.issue() for _ in range(4)] == [4, 4, 2, 2]
    sizes.resize(3, at=sizes.issued)  # at once
    assert sizes.issue() == 3 and sizes.issued == 8


def test_every_resize_applies_at_its_batch_even_when_several_wait() -> None:
    """A replica that issued little applies each decision at the batch agreed for it."""
    sizes = IssuedSizes(4)
    sizes.resize(2, at=2)
    sizes.resize(3, at=3)
    assert [sizes.issue() for _ in range(5)] == [4, 4, 2, 3, 3]


def test_issued_batches_keep_their_size() -> None:
    sizes = IssuedSizes(4)
    sizes.issue()
    with pytest.raises(ValueError, match="at must be"):
        sizes.resize(2, at=0)
    with pytest.raises(ValueError, match="size must be"):
        sizes.resize(0, at=1)


@settings(max_examples=30, deadline=None)
@given(
    n=st.integers(20, 80),
    depths=st.lists(st.integers(0, 4), min_size=1, max_size=3),
    choices=st.lists(st.tuples(st.integers(1, 5), st.integers(0, 2)), min_size=2, max_size=4),
    tick=st.floats(0.3, 2.0),
)
def test_in_place_decisions_keep_every_sample_once_and_replicas_in_step(
    n: int, depths: list[int], choices: list[tuple[int, int]], tick: float
) -> None:
    """Each replica draws its own number of batches ahead; sizes change mid-pass."""
    replicas = len(depths)
    passes_started: list[int] = []

    def replica(collective: ThreadCollective) -> tuple[list[tuple[int, list[int]]], list[int]]:
        rank = collective.rank
        job = Job(
            Topology(rank=rank, num_replicas=replicas),
            collective=collective,
            clock=ManualClock(tick),
            batch_size_decision=Alternating(choices),
        )
        loader = LoaderHelper(job, batch_size=1)
        loader.autoscale_batch_size(64, gradient_accumulation=True)
        sizes = IssuedSizes()

        def batches(epoch: int, index: int, local_bsz: int) -> Prefetching:
            if rank == 0:
                passes_started.append(index)
            sizes.start(local_bsz)
            shard = Shard(n, index, replicas, rank, epoch=epoch)
            return Prefetching(shard, depths[rank], sizes)

        seen, lengths, step_lengths, step_passes = [], [], [], set[int]()
        for _epoch in job.epoch.remaining_epochs_until(1):
            for batch in loader.iterate(n, batches):
                seen.append((loader.current_index, [i for i, pad in batch if not pad]))
                lengths.append(len(batch))
                # The size reported is the batch's in hand (what scaling and the noise
                # estimate read), also while batches issued before a decision arrive.
                left = (loader.current_index // n + 1) * n - loader.current_index
                assert len(batch) == loader.current_local_bsz or (
                    left < replicas * loader.current_local_bsz
                ), (len(batch), loader.current_local_bsz)
                step_lengths.append(len(batch))
                step_passes.add(loader.current_index // n)
                if loader.is_optim_step():
                    job.metrics.add_progress(1.0)
                    # A step is whole micro-batches of the reported size and count, also
                    # across an in-place decision (a step that crosses into the next pass,
                    # decided anew at its start, or ends with its short batch, aside).
                    if left > replicas * loader.current_local_bsz and len(step_passes) == 1:
                        assert len(step_lengths) == loader.accumulation_steps + 1, step_lengths
                        assert set(step_lengths) == {loader.current_local_bsz}, step_lengths
                    step_lengths.clear()
                    step_passes.clear()
        return seen, lengths

    outcome = run_replicas(replicas, replica)
    # Every replica took batches of the same sizes, batch by batch.
    assert all(lengths == outcome[0][1] for _, lengths in outcome)
    assert_each_pass_once([seen for seen, _ in outcome], n)
    # No pass started anew for a decision: only at multiples of n.
    assert all(index % n == 0 for index in passes_started)


def test_the_torch_adapter_s_pass_is_resizable() -> None:
    class Pass:
        sizes = IssuedSizes()

        def __iter__(self) -> Iterator[int]:
            return iter(())

    assert isinstance(Pass(), ResizableBatches)
    assert not isinstance(iter(()), ResizableBatches)


@pytest.mark.parametrize("choices", [[(4, 0), (2, 0)], [(4, 0), (4, 1)]])
def test_the_first_batch_at_a_new_size_and_spikes_go_unprofiled(
    choices: list[tuple[int, int]],
) -> None:
    """The first batch of a pass and the first at each new size (its new shapes cost
    once; a change of accumulation alone makes none) are not profiled, nor is a
    spike; every other batch is, at its own size."""
    n = 400
    clock = ManualClock()
    job = Job(Topology(), clock=clock, batch_size_decision=Alternating(choices))
    loader = LoaderHelper(job, batch_size=1)
    loader.autoscale_batch_size(64, gradient_accumulation=True)
    sizes = IssuedSizes()
    passes: list[tuple[int, int]] = []  # (index, batch number) of each pass's start

    def batches(epoch: int, index: int, local_bsz: int) -> Prefetching:
        passes.append((index, len(sizes_seen)))
        sizes.start(local_bsz)
        return Prefetching(Shard(n, index, 1, 0, epoch=epoch), 1, sizes)

    sizes_seen: list[int] = []
    spike_at = 150
    for _epoch in job.epoch.remaining_epochs_until(1):
        for _batch in loader.iterate(n, batches):
            size = loader.current_local_bsz
            new_size = not sizes_seen or size != sizes_seen[-1]
            sizes_seen.append(size)
            # Steady steps take 1 s per sample of the size; the first at a size 50 s more.
            clock.now += size + (50.0 if new_size else 0.0)
            if len(sizes_seen) == spike_at:
                clock.now += 100.0
            job.metrics.add_progress(1.0)
    changes = sum(a != b for a, b in pairwise(sizes_seen))
    assert changes >= 2 or choices[0][0] == choices[1][0]
    assert all(index % n == 0 for index, _ in passes)  # in place
    assert len(job.batch_size_decision.choices) == 2 and job.batch_size_decision.calls > 4
    timings = job.metrics.profiler.timings
    assert {key[2] for key in timings} == set(sizes_seen)
    for (_, _, size), timing in timings.items():
        for part in (timing.accum, timing.optim):
            assert part.count == 0 or part.mean_step == pytest.approx(size)
    profiled = sum(t.optim.count + t.accum.count for t in timings.values())
    assert job.metrics.profiler.spikes == 1
    # Each pass's first batch, the first at each new size and the spike are left out.
    left_out = {number for _, number in passes} | {
        i for i in range(1, len(sizes_seen)) if sizes_seen[i] != sizes_seen[i - 1]
    }
    assert spike_at - 1 not in left_out
    assert profiled == len(sizes_seen) - len(left_out) - 1
