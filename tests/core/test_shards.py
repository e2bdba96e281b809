"""Properties of adaptdl.core.order.shards: block order, chunks, prefix, once."""

from __future__ import annotations

import bisect
import itertools
import json
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from adaptdl.core.order.permutation import MAX_N
from adaptdl.core.order.shards import (
    DEFAULT_BLOCK_SIZE,
    BlockOrder,
    Chunk,
    ShardIndex,
    StreamPlan,
    _mix,
    replica_chunk,
)


def micro_batches(n: int, index: int, replicas: int, rank: int, local_bsz: int) -> Iterator[Chunk]:
    """Replica ``rank``'s chunks of a fixed size from ``index`` to the pass end."""
    return StreamPlan(n, 1, 0, 0, index, replicas, rank, local_bsz).chunks()


# Shard sizes 1 to 10^4, 1 to 1000 shards (of which only ranges are ever built).
shard_counts = st.one_of(
    st.lists(st.integers(1, 10), min_size=1, max_size=30),
    st.lists(st.integers(1, 10**4), min_size=1, max_size=1000),
)
block_sizes = st.one_of(st.integers(1, 8), st.integers(1, 300), st.just(DEFAULT_BLOCK_SIZE))
seeds = st.integers(0, 2**32)


def index_of(counts: list[int]) -> ShardIndex:
    return ShardIndex([f"shard-{i}.jsonl" for i in range(len(counts))], counts)


# --- the shard index ---------------------------------------------------------------


@settings(max_examples=100, deadline=None)
@given(counts=st.lists(st.integers(0, 50), min_size=1, max_size=40), data=st.data())
def test_offsets_name_the_shard_and_offset_of_every_global_id(
    counts: list[int], data: st.DataObject
) -> None:
    """Readers find a global id's shard by bisecting the offsets (empty shards skipped)."""
    if sum(counts) == 0:
        counts[0] = 1
    index = index_of(counts)
    assert index.total == sum(counts) and index.num_shards == len(counts)
    assert index.offsets == (0, *itertools.accumulate(counts))
    g = data.draw(st.integers(0, index.total - 1))
    shard = bisect.bisect_right(index.offsets, g) - 1
    offset = g - index.offsets[shard]
    assert counts[shard] > 0 and 0 <= offset < counts[shard]
    assert ShardIndex.from_json(json.loads(json.dumps(index.to_json()))) == index


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ([], "'shards' list"),
        ({"shards": [{"name": "a"}]}, r"shards\[0\] must be an object with 'name' and 'count'"),
        ({"shards": [{"name": "a", "count": -1}]}, r"counts\[0\] must be >= 0"),
        ({"shards": [{"name": "a", "count": 1.5}]}, r"counts\[0\] must be an int"),
        ({"shards": [{"name": "", "count": 1}]}, r"names\[0\] must be a non-empty str"),
        ({"shards": [{"name": "a", "count": 0}]}, "must hold 1 to"),
        ({"shards": []}, "at least one shard"),
    ],
)
def test_malformed_index_is_refused_with_what_is_wrong(data: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ShardIndex.from_json(data)


def test_names_and_counts_must_match() -> None:
    with pytest.raises(ValueError, match="same length"):
        ShardIndex(["a", "b"], [1])


# --- the block order ----------------------------------------------------------------


@settings(max_examples=150, deadline=None)
@given(
    n=st.one_of(st.integers(1, 40), st.integers(1, 20_000)),
    block_size=block_sizes,
    seed=seeds,
    epoch=st.integers(0, 3),
    pass_=st.integers(0, 2),
    shuffle=st.booleans(),
)
def test_a_pass_is_a_permutation_of_the_samples(
    n: int, block_size: int, seed: int, epoch: int, pass_: int, shuffle: bool
) -> None:
    order = BlockOrder(n, block_size, seed=seed, epoch=epoch, pass_=pass_, shuffle=shuffle)
    ids = order.take(0, n)
    np.testing.assert_array_equal(np.sort(ids), np.arange(n))
    if not shuffle:
        np.testing.assert_array_equal(ids, np.arange(n))
    # Random access agrees with the range, and a rebuilt order is the same order.
    again = BlockOrder(n, block_size, seed=seed, epoch=epoch, pass_=pass_, shuffle=shuffle)
    for p in {0, n // 2, n - 1}:
        assert order[p] == again[p] == ids[p]


@settings(max_examples=150, deadline=None)
@given(
    n=st.integers(1, 5000),
    block_size=block_sizes,
    seed=seeds,
    data=st.data(),
    shuffle=st.booleans(),
)
def test_runs_read_each_block_once_sequentially_within_its_span(
    n: int, block_size: int, seed: int, data: st.DataObject, shuffle: bool
) -> None:
    lo = data.draw(st.integers(0, n))
    hi = data.draw(st.integers(lo, n))
    order = BlockOrder(n, block_size, seed=seed, shuffle=shuffle)
    runs = list(order.runs(lo, hi))
    # A range touches only the blocks laid out over it, each once.
    assert len(runs) <= -(-(hi - lo) // block_size) + 1
    assert len({r.block for r in runs}) == len(runs)
    ids = []
    for run in runs:
        assert (run.start, run.stop) == order.block_span(run.block)
        assert 0 < run.stop - run.start <= block_size
        # Offsets lie inside the block and name distinct samples of it.
        assert all(0 <= o < run.stop - run.start for o in run.offsets)
        assert len(set(run.offsets)) == len(run.offsets)
        ids += [run.start + o for o in run.offsets]
    assert ids == order.take(lo, hi).tolist() and len(ids) == hi - lo


def test_the_short_last_block_stays_last_and_full_blocks_are_shuffled() -> None:
    order = BlockOrder(103, 10, seed=5)
    assert order.num_blocks == 11 and order.num_full_blocks == 10
    assert order.block_at(10) == 10
    assert [order.block_at(s) for s in range(10)] != list(range(10))
    assert sorted(order.take(100, 103).tolist()) == [100, 101, 102]


def test_orders_are_pinned_and_differ_by_seed_epoch_and_pass() -> None:
    # Golden values: a change of the order is a visible, deliberate break.
    assert BlockOrder(20, 4, seed=1).take(0, 20).tolist() == GOLDEN
    base = BlockOrder(1000, 16, seed=1).take(0, 1000).tolist()
    for kwargs in ({"seed": 2}, {"seed": 1, "epoch": 1}, {"seed": 1, "pass_": 1}):
        assert BlockOrder(1000, 16, **kwargs).take(0, 1000).tolist() != base


GOLDEN = [15, 13, 14, 12, 17, 18, 16, 19, 0, 3, 1, 2, 5, 6, 4, 7, 9, 10, 8, 11]


@settings(max_examples=100, deadline=None)
@given(
    values=st.lists(st.integers(0, 2**63 - 1), min_size=1, max_size=50),
    key=st.integers(0, 2**64 - 1),
)
def test_the_mix_is_splitmix64s_finaliser_on_integers(values: list[int], key: int) -> None:
    """The rotations are a platform-independent integer formula, computed in uint64."""
    mask = (1 << 64) - 1

    def mix(value: int) -> int:
        h = ((value ^ key) * 0xBF58476D1CE4E5B9) & mask
        h ^= h >> 31
        h = (h * 0x94D049BB133111EB) & mask
        return h ^ (h >> 29)

    mixed = _mix(np.array(values, dtype=np.int64), key)
    assert mixed.tolist() == [mix(v) for v in values]


@settings(max_examples=50, deadline=None)
@given(n=st.integers(1, 3000), block_size=st.integers(1, 64), seed=seeds, lo_frac=st.floats(0, 1))
def test_runs_rotate_each_full_block_as_rotation_says(
    n: int, block_size: int, seed: int, lo_frac: float
) -> None:
    """Offsets at place u of a full block are inner[(u + rotation(block)) % B]."""
    order = BlockOrder(n, block_size, seed=seed)
    slots = {order.block_at(s): s for s in range(order.num_full_blocks)}
    inner = order._inner[:block_size].tolist()
    lo = int(lo_frac * n)
    for run in order.runs(lo, n):
        if run.block in slots:
            first = max(lo - slots[run.block] * block_size, 0)
            shift = order.rotation(run.block)
            places = range(first, first + len(run.offsets))
            assert run.offsets == [inner[(u + shift) % block_size] for u in places]


def test_large_blocks_read_their_offsets_from_the_array_not_a_list() -> None:
    """Blocks above 4096 samples keep the in-block permutation as an array only."""
    order = BlockOrder(12_345, 5000, seed=2)
    assert order._inner_list is None
    ids = order.take(0, 12_345)
    np.testing.assert_array_equal(np.sort(ids), np.arange(12_345))
    small = BlockOrder(12_345, 4096, seed=2)
    assert small._inner_list == small._inner.tolist()


@pytest.mark.parametrize("n", [2**40 + 7, MAX_N])
def test_memory_does_not_grow_with_the_corpus(n: int) -> None:
    order = BlockOrder(n, 64, seed=3)
    ids = [order[p] for p in (0, 1, n // 2, n - 1)]
    assert all(0 <= g < n for g in ids) and len(set(ids)) == 4
    # Only the in-block permutations (twice B ints) and a page of the block order
    # are materialised, whatever n.
    assert order._inner.size == 2 * 64 and order._inner_last.size == n % 64
    assert len(order._page[1]) <= 1024


@pytest.mark.parametrize("size", [0, -1])
def test_a_size_below_one_is_refused_not_looped_on(size: int) -> None:
    plan = StreamPlan(10, 4, 0, 0, 0, 2, 0, 3)
    with pytest.raises(ValueError, match=f"sizes\\(\\) must be >= 1, got {size}"):
        next(plan.chunks(lambda: size))


def test_plan_numbers_are_plain_ints() -> None:
    plan = StreamPlan(10, 4, 0, 0, np.int64(3), np.int32(2), np.int64(1), np.int64(2))
    assert all(type(v) is int for v in (plan.index, plan.num_replicas, plan.rank, plan.local_bsz))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"n": 0}, "n must be in"),
        ({"n": 5, "block_size": 0}, "block_size must be in"),
        ({"n": 5, "seed": -1}, "seed must be >= 0"),
        ({"n": 5, "shuffle": 1}, "shuffle must be a bool"),
    ],
)
def test_bad_order_arguments_are_refused(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        BlockOrder(**kwargs)


# --- replica chunks: prefix and exactly once ----------------------------------------


@settings(max_examples=200, deadline=None)
@given(
    n=st.one_of(st.integers(1, 30), st.integers(1, 10**7)),
    data=st.data(),
    replicas=st.integers(1, 64),
    local_bsz=st.one_of(st.integers(1, 8), st.integers(1, 4096)),
)
def test_one_micro_batch_is_split_into_contiguous_runs_with_explicit_padding(
    n: int, data: st.DataObject, replicas: int, local_bsz: int
) -> None:
    index = data.draw(st.integers(0, 3 * n))
    chunks = [replica_chunk(n, index, replicas, r, local_bsz) for r in range(replicas)]
    start = index % n
    step = min(replicas * local_bsz, n - start)
    assert {c.step for c in chunks} == {step}
    # The runs tile [start, start + step) in rank order; all replicas yield `size`.
    assert chunks[0].lo == start and chunks[-1].hi == start + step
    for a, b in itertools.pairwise(chunks):
        assert a.hi == b.lo
    size = chunks[0].size
    assert size == -(-step // replicas) <= local_bsz
    for c in chunks:
        assert c.hi - c.lo + (c.pad is not None) == size
        assert c.pad is None or 0 <= c.pad < n
    assert sum(c.pad is not None for c in chunks) == replicas * size - step


@settings(max_examples=150, deadline=None)
@given(
    counts=shard_counts,
    block_size=block_sizes,
    schedule=st.lists(
        st.tuples(st.integers(1, 8), st.integers(1, 64), st.integers(1, 40)),
        min_size=1,
        max_size=6,
    ),
    seed=seeds,
)
def test_consumed_positions_stay_a_prefix_through_random_resizes_and_restarts(
    counts: list[int], block_size: int, schedule: list[tuple[int, int, int]], seed: int
) -> None:
    """Every micro-batch ends with [0, index) consumed; a pass yields every sample once.

    Each schedule entry is a run of (replicas, local batch size, micro-batches) that
    a restart or a resize ends; the pass is finished by a last run.
    """
    n = index_of(counts).total
    consumed = 0  # the prefix [0, consumed) of pass positions
    index = 0
    for replicas, local_bsz, steps in [*schedule, (3, max(1, n // 7), n + 1)]:
        # Every replica starts again from the index the checkpoint holds.
        streams = [micro_batches(n, index, replicas, r, local_bsz) for r in range(replicas)]
        for _ in range(steps):
            chunks = [next(s, None) for s in streams]
            if chunks[0] is None:
                break
            runs = sorted((c.lo, c.hi) for c in chunks if c is not None)
            assert runs[0][0] == consumed
            for (_, a_hi), (b_lo, _) in itertools.pairwise(runs):
                assert a_hi == b_lo
            consumed = runs[-1][1]
            index += chunks[0].step
            assert index == consumed
        if index >= n:
            break
    assert consumed == index == n
    # And the samples at those positions are each sample once (checked on small n).
    if n <= 20_000:
        ids = BlockOrder(n, block_size, seed=seed).take(0, consumed)
        np.testing.assert_array_equal(np.sort(ids), np.arange(n))


@settings(max_examples=20, deadline=None)
@given(
    counts=st.lists(st.integers(1, 10**4), min_size=1, max_size=1000),
    block_size=st.integers(16, 300),
    seed=seeds,
    epoch=st.integers(0, 3),
    picks=st.lists(st.integers(0, 2**32), max_size=50),
)
@example(counts=[10**4] * 1000, block_size=16, seed=7, epoch=1, picks=list(range(0, 10**6, 997)))
@example(counts=[1] * 1000, block_size=16, seed=7, epoch=0, picks=[3, 5])
def test_a_large_pass_covers_every_sample_once_block_by_block(
    counts: list[int], block_size: int, seed: int, epoch: int, picks: list[int]
) -> None:
    """Exactly once at corpus sizes where listing every id is too slow (up to 10^7).

    The pass lays out slots of ``block_size`` positions; each sample is used once
    iff every block is laid out in exactly one slot and each slot's run lists each
    of its block's samples once. The first is checked for every slot, the second
    for the blocks of random slots (and the short last one).
    """
    n = index_of(counts).total
    order = BlockOrder(n, block_size, seed=seed, epoch=epoch)
    blocks = np.fromiter(
        (order.block_at(s) for s in range(order.num_blocks)), np.int64, order.num_blocks
    )
    np.testing.assert_array_equal(np.sort(blocks), np.arange(order.num_blocks))
    last = order.num_blocks - 1
    slots = {last, *(pick % order.num_blocks for pick in picks)}
    for slot in slots:
        (run,) = order.runs(slot * block_size, min(n, (slot + 1) * block_size))
        assert run.block == blocks[slot]
        assert sorted(run.offsets) == list(range(run.stop - run.start))


def simulate_reads(order: BlockOrder, replicas: int, workers: int, local_bsz: int) -> int:
    """Samples read in a pass by replicas x workers readers, each caching one block."""
    read = 0
    for rank in range(replicas):
        cached = [-1] * workers
        for k, chunk in enumerate(micro_batches(order.n, 0, replicas, rank, local_bsz)):
            w = k % workers
            for run in order.runs(chunk.lo, chunk.hi):
                if run.block != cached[w]:
                    read += run.stop - run.start
                    cached[w] = run.block
    return read


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 3000),
    block_size=st.integers(1, 64),
    replicas=st.integers(1, 6),
    workers=st.integers(1, 3),
    local_bsz=st.integers(1, 128),
    seed=seeds,
)
def test_read_amplification_is_bounded_by_block_size_over_batch(
    n: int, block_size: int, replicas: int, workers: int, local_bsz: int, seed: int
) -> None:
    order = BlockOrder(n, block_size, seed=seed)
    read = simulate_reads(order, replicas, workers, local_bsz)
    chunks = sum(1 for r in range(replicas) for _ in micro_batches(n, 0, replicas, r, local_bsz))
    # Each chunk reads its own samples and at most two partly used blocks beyond them.
    assert n <= read <= n + 2 * (block_size - 1) * chunks
    # A sole reader reads every block exactly once.
    if replicas == workers == 1:
        assert read == n


# --- the stream plan: one decision for every reader --------------------------------


@settings(max_examples=150, deadline=None)
@given(
    counts=shard_counts,
    block_size=block_sizes,
    runs=st.lists(
        st.tuples(
            st.integers(1, 8),  # replicas after a restart
            st.lists(st.integers(1, 64), min_size=1, max_size=5),  # sizes changed in place
            st.integers(1, 40),  # micro-batches before the next restart
        ),
        min_size=1,
        max_size=6,
    ),
    seed=seeds,
    epoch=st.integers(0, 3),
)
def test_plans_keep_a_prefix_and_read_each_sample_once_through_resizes_and_restarts(
    counts: list[int],
    block_size: int,
    runs: list[tuple[int, list[int], int]],
    seed: int,
    epoch: int,
) -> None:
    """Each run restarts every replica's plan from the index a checkpoint would hold,
    at a new replica count, and changes the local batch size in place between
    micro-batches (the same sizes on every replica). After every micro-batch the
    consumed positions are exactly [0, index); the real samples of a pass are each
    sample once, padding is flagged and within the pass."""
    n = index_of(counts).total
    index, real = 0, []
    for replicas, sizes, steps in [*runs, (3, [max(1, n // 7)], n + 1)]:
        plans = [
            StreamPlan(n, block_size, seed, epoch, index, replicas, r, sizes[0])
            for r in range(replicas)
        ]
        assert {p.order() for p in plans} == {plans[0].order()}  # one order for all
        streams = [p.chunks(itertools.cycle(sizes).__next__) for p in plans]
        for _ in range(steps):
            chunks = [next(s, None) for s in streams]
            if chunks[0] is None:
                assert set(chunks) == {None}
                break
            assert len({(c.size, c.step) for c in chunks}) == 1
            assert chunks[0].lo == index
            for a, b in itertools.pairwise(chunks):
                assert a.hi == b.lo
            assert chunks[-1].hi == index + chunks[0].step
            for c in chunks:
                assert c.pad is None or 0 <= c.pad < n
                real.append((c.lo, c.hi))
            index += chunks[0].step
        if index >= n:
            break
    assert index == n
    if n <= 20_000:
        order = plans[0].order()
        ids = np.concatenate([order.take(lo, hi) for lo, hi in real])
        np.testing.assert_array_equal(np.sort(ids), np.arange(n))


@settings(max_examples=100, deadline=None)
@given(
    n=st.integers(1, 500),
    data=st.data(),
    replicas=st.integers(1, 6),
    local_bsz=st.integers(1, 50),
    drop_last=st.booleans(),
)
def test_num_batches_counts_the_chunks_of_a_fixed_size(
    n: int, data: st.DataObject, replicas: int, local_bsz: int, drop_last: bool
) -> None:
    index = data.draw(st.integers(0, 2 * n))
    rank = data.draw(st.integers(0, replicas - 1))
    plan = StreamPlan(n, 4, 0, 0, index, replicas, rank, local_bsz, drop_last=drop_last)
    chunks = list(plan.chunks())
    assert plan.num_batches() == len(chunks)
    at = index
    for chunk in chunks:  # each is replica_chunk's at the index the ones before reached
        assert chunk == replica_chunk(n, at, replicas, rank, local_bsz)
        at += chunk.step
    if drop_last:
        assert all(c.step == replicas * local_bsz for c in chunks)
    assert plan.order() == BlockOrder(n, 4, seed=0, epoch=0, pass_=index // n)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"index": -1}, "index must be >= 0"),
        ({"num_replicas": 0}, "num_replicas must be >= 1"),
        ({"rank": 2}, r"rank must be in \[0, 1\]"),
        ({"local_bsz": 0}, "local_bsz must be >= 1"),
        ({"drop_last": "yes"}, "drop_last must be a bool"),
        ({"block_size": 0}, "block_size must be in"),
    ],
)
def test_bad_plan_arguments_are_refused(kwargs: dict[str, Any], message: str) -> None:
    args = {"n": 10, "block_size": 4, "seed": 0, "epoch": 0, "index": 0}
    args.update(num_replicas=2, rank=0, local_bsz=3)
    with pytest.raises(ValueError, match=message):
        StreamPlan(**{**args, **kwargs})
    with pytest.raises(ValueError, match="sizes must be callable"):
        StreamPlan(**args).chunks(3)  # type: ignore[arg-type]
