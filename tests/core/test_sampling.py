"""Properties of adaptdl.core.order.sampling: prefix, exactly once, determinism, padding."""

from __future__ import annotations

import attrs
import numpy as np
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from adaptdl.core.order.permutation import Identity, Permutation, make_permutation
from adaptdl.core.order.sampling import Shard

# Biased to small values (n below the world size, single-sample passes) with some
# large ones, of which only what a test draws is ever materialised.
lengths = st.one_of(
    st.integers(1, 16), st.integers(1, 2000), st.integers(1, 10**6), st.integers(10**5, 10**6)
)
world_sizes = st.one_of(st.integers(1, 4), st.integers(1, 64))
local_batch_sizes = st.one_of(st.integers(1, 8), st.integers(1, 512))
seeds = st.integers(0, 2**32)

# Cap on the samples one simulated schedule draws, so that each example stays fast.
MAX_SAMPLES = 200_000


# --- one shard ---------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(
    n=st.one_of(st.integers(1, 16), st.integers(1, 2000)),
    passes=st.integers(0, 3),
    offset=st.data(),
    num_replicas=world_sizes,
    seed=seeds,
    shuffle=st.booleans(),
)
def test_replicas_split_the_rest_of_a_pass_into_equal_strided_shares(
    n: int, passes: int, offset: st.DataObject, num_replicas: int, seed: int, shuffle: bool
) -> None:
    start = offset.draw(st.integers(0, n - 1))
    index = passes * n + start
    shards = [
        Shard(n, index, num_replicas, rank, seed=seed, epoch=2, shuffle=shuffle)
        for rank in range(num_replicas)
    ]
    counts = {len(s) for s in shards}
    assert counts == {-(-(n - start) // num_replicas)}
    count = counts.pop()
    perm = make_permutation(n, seed=seed, epoch=2, pass_=passes, shuffle=shuffle)
    real_positions = []
    for rank, shard in enumerate(shards):
        assert (shard.pass_, shard.start, shard.count) == (passes, start, count)
        assert shard.permutation == perm
        raw = start + rank + num_replicas * np.arange(count)
        flags = shard.is_padding()
        np.testing.assert_array_equal(flags, raw >= n)
        # At most the last local sample is padding, and `padding` counts it.
        assert not flags[:-1].any()
        assert shard.padding == int(flags[-1])
        positions = shard.positions()
        np.testing.assert_array_equal(positions, raw % n)
        np.testing.assert_array_equal(shard.indices(), perm.take(positions))
        real_positions.append(positions[~flags])
    consumed = np.sort(np.concatenate(real_positions))
    np.testing.assert_array_equal(consumed, np.arange(start, n))
    total = sum(s.padding for s in shards)
    assert total == num_replicas * count - (n - start)
    assert all(s.total_padding == total for s in shards)


@settings(max_examples=100, deadline=None)
@given(
    n=lengths,
    index=st.integers(0, 10**7),
    num_replicas=world_sizes,
    data=st.data(),
    shuffle=st.booleans(),
)
def test_slices_iteration_and_length_agree(
    n: int, index: int, num_replicas: int, data: st.DataObject, shuffle: bool
) -> None:
    rank = data.draw(st.integers(0, num_replicas - 1))
    shard = Shard(n, index, num_replicas, rank, seed=7, shuffle=shuffle)
    count = len(shard)
    assert count == shard.count
    lo = data.draw(st.integers(0, min(count, 5000)))
    hi = data.draw(st.integers(lo, min(count, lo + 5000)))
    whole = shard.positions(0, min(count, 10_000))
    np.testing.assert_array_equal(shard.positions(lo, hi), whole[lo:hi])
    np.testing.assert_array_equal(
        shard.indices(lo, hi), shard.permutation.take(shard.positions(lo, hi))
    )
    np.testing.assert_array_equal(shard.is_padding(lo, hi), shard.is_padding(0, hi)[lo:])
    if count <= 20_000:
        listed = list(shard)
        assert listed == shard.indices().tolist()
        assert all(type(i) is int for i in listed[:100])
    else:
        head = [i for i, _ in zip(shard, range(3000), strict=False)]
        assert head == shard.indices(0, 3000).tolist()


def test_worked_example_with_padding() -> None:
    # n = 10, index 23: pass 2 resumes at position 3; 7 samples left for 3 replicas,
    # so each takes 3 and two of them pad (total 9 = 7 + 2).
    shards = [Shard(10, 23, 3, rank, shuffle=False) for rank in range(3)]
    assert [s.pass_ for s in shards] == [2, 2, 2]
    assert [s.start for s in shards] == [3, 3, 3]
    assert [s.positions().tolist() for s in shards] == [[3, 6, 9], [4, 7, 0], [5, 8, 1]]
    assert [s.is_padding().tolist() for s in shards] == [
        [False, False, False],
        [False, False, True],
        [False, False, True],
    ]
    assert [s.padding for s in shards] == [0, 1, 1]
    assert {s.total_padding for s in shards} == {2}
    assert [list(s) for s in shards] == [[3, 6, 9], [4, 7, 0], [5, 8, 1]]


def test_fewer_samples_than_replicas() -> None:
    shards = [Shard(3, 0, 8, rank, seed=1) for rank in range(8)]
    assert {len(s) for s in shards} == {1}
    assert [s.padding for s in shards] == [0, 0, 0, 1, 1, 1, 1, 1]
    assert shards[0].total_padding == 5
    # Padding wraps to real positions of the same pass: rank r takes r % 3.
    assert [int(s.positions()[0]) for s in shards] == [0, 1, 2, 0, 1, 2, 0, 1]
    perm = Permutation(3, seed=1)
    assert [next(iter(s)) for s in shards] == [perm[r % 3] for r in range(8)]


def test_single_sample_dataset() -> None:
    for index in (0, 1, 5):
        shards = [Shard(1, index, 4, rank, seed=3) for rank in range(4)]
        assert [list(s) for s in shards] == [[0], [0], [0], [0]]
        assert [s.padding for s in shards] == [0, 1, 1, 1]
        assert shards[0].pass_ == index


def test_large_dataset_is_never_materialised() -> None:
    n = 10**12
    shard = Shard(n, 5 * n + 7, 3, 2, seed=11, epoch=4)
    assert shard.pass_ == 5
    assert shard.start == 7
    assert len(shard) == -(-(n - 7) // 3)
    head = shard.indices(0, 1000)
    tail = shard.indices(len(shard) - 1000, len(shard))
    perm = Permutation(n, seed=11, epoch=4, pass_=5)
    np.testing.assert_array_equal(head, perm.take(7 + 2 + 3 * np.arange(1000)))
    assert tail.min() >= 0
    assert tail.max() < n
    assert next(iter(shard)) == perm[9]


def test_passes_of_an_epoch_and_epochs_differ() -> None:
    n = 1000
    a = Shard(n, 0, 1, 0, seed=5, epoch=0).indices()
    b = Shard(n, n, 1, 0, seed=5, epoch=0).indices()
    c = Shard(n, 0, 1, 0, seed=5, epoch=1).indices()
    assert np.count_nonzero(a == b) < 10
    assert np.count_nonzero(a == c) < 10
    assert np.count_nonzero(b == c) < 10


def test_without_shuffle_indices_are_positions() -> None:
    shard = Shard(100, 250, 4, 3, shuffle=False)
    assert isinstance(shard.permutation, Identity)
    np.testing.assert_array_equal(shard.indices(), shard.positions())
    assert shard.positions()[:3].tolist() == [53, 57, 61]


def test_shard_is_a_frozen_value() -> None:
    shard = Shard(100, 3, 2, 1, seed=4, epoch=1)
    assert shard == Shard(100, 3, 2, 1, seed=4, epoch=1)
    assert shard != Shard(100, 3, 2, 0, seed=4, epoch=1)
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        shard.index = 5  # type: ignore[misc]
    assert Shard(np.int64(10), np.int32(3), np.uint8(2), np.int16(1)).n == 10


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"n": 0}, "^n must be"),
        ({"n": 5.0}, "^n must be an int"),
        ({"index": -1}, "^index must be"),
        ({"index": None}, "^index must be an int"),
        ({"num_replicas": 0}, "^num_replicas must be"),
        ({"num_replicas": True}, "^num_replicas must be an int"),
        ({"rank": -1}, "^rank must be"),
        ({"rank": 4}, r"^rank must be in \[0, 3\] for num_replicas=4, got 4"),
        ({"rank": 1.0}, "^rank must be an int"),
        ({"seed": -1}, "^seed must be"),
        ({"epoch": -2}, "^epoch must be"),
        ({"shuffle": 1}, "^shuffle must be a bool"),
        ({"shuffle": None}, "^shuffle must be a bool"),
    ],
)
def test_bad_arguments_raise_value_error_naming_them(
    kwargs: dict[str, object], message: str
) -> None:
    arguments: dict[str, object] = {"n": 10, "index": 0, "num_replicas": 4, "rank": 0, **kwargs}
    with pytest.raises(ValueError, match=message):
        Shard(**arguments)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("lo", "hi", "message"),
    [
        (-1, None, "^lo must be in"),
        (5, None, "^lo must be in"),
        (2, 1, "^hi must be in"),
        (0, 5, "^hi must be in"),
        (0.5, None, "^lo must be an int"),
        (0, 2.0, "^hi must be an int"),
    ],
)
def test_bad_slices_raise_value_error_naming_them(lo: object, hi: object, message: str) -> None:
    shard = Shard(10, 0, 3, 0)  # count 4
    for method in (shard.positions, shard.indices, shard.is_padding):
        with pytest.raises(ValueError, match=message):
            method(lo, hi)  # type: ignore[arg-type]


# --- the invariants over whole schedules ----------------------------------------------


@attrs.define
class Simulation:
    """Replicas drawing batches through restarts and resizes, as the loader does.

    The global index advances by ``num_replicas * local_bsz`` per batch; the batch
    that ends a pass (each replica's last, possibly short) moves it to the start
    of the next pass. Every observation is checked against the invariants.
    """

    n: int
    seed: int
    epoch: int
    shuffle: bool
    index: int = 0
    drawn: int = 0
    # Per pass: how often each position was consumed (padding apart), samples
    # yielded, and padding samples yielded.
    counts: np.ndarray = attrs.field(init=False)
    # Per pass: how often each dataset index was yielded, padding included.
    index_counts: np.ndarray = attrs.field(init=False)
    yielded: int = 0
    padded: int = 0
    passes_done: int = 0

    def __attrs_post_init__(self) -> None:
        self.counts = np.zeros(self.n, dtype=np.int32)
        self.index_counts = np.zeros(self.n, dtype=np.int32)

    @property
    def pass_(self) -> int:
        return self.index // self.n

    def remaining(self) -> int:
        return self.n - self.index % self.n

    def run_segment(self, num_replicas: int, local_bsz: int, batches: int) -> None:
        """A restart at the current index with a new world size, then some batches."""
        self.check_prefix()
        shards = self.make_shards(num_replicas)
        done = 0  # local samples consumed since these shards were made
        for _ in range(batches):
            if self.drawn >= MAX_SAMPLES:
                return
            count = shards[0].count
            lo, hi = done, min(done + local_bsz, count)
            self.draw_batch(shards, lo, hi)
            done = hi
            if done == count:
                self.finish_pass(shards)
                shards, done = self.make_shards(num_replicas), 0

    def make_shards(self, num_replicas: int) -> list[Shard]:
        shards = [
            Shard(self.n, self.index, num_replicas, rank, self.seed, self.epoch, self.shuffle)
            for rank in range(num_replicas)
        ]
        # Determinism: every replica derives the same pass order on its own.
        reference = make_permutation(
            self.n, seed=self.seed, epoch=self.epoch, pass_=self.pass_, shuffle=self.shuffle
        )
        assert all(s.permutation == reference for s in shards)
        return shards

    def draw_batch(self, shards: list[Shard], lo: int, hi: int) -> None:
        num_replicas = len(shards)
        base = shards[0].index
        pass_start = self.pass_ * self.n
        positions, indices, padding = [], [], []
        for shard in shards:
            batch = shard.indices(lo, hi)
            # Replicas stay in step: each yields the same number of samples.
            assert batch.size == hi - lo
            positions.append(shard.positions(lo, hi))
            indices.append(batch)
            padding.append(shard.is_padding(lo, hi))
        pos, idx, pad = np.concatenate(positions), np.concatenate(indices), np.concatenate(padding)
        self.drawn += pos.size
        # Determinism: the sample at pass position q is perm[q], whatever schedule
        # of world sizes and batch sizes led there.
        reference = Permutation(self.n, seed=self.seed, epoch=self.epoch, pass_=self.pass_)
        expected = reference.take(pos) if self.shuffle else pos
        np.testing.assert_array_equal(idx, expected)
        # Prefix, batch by batch: this batch consumed exactly the next positions
        # [index, next index) of the pass, so by induction the pass so far is a prefix.
        new_index = min(base + num_replicas * hi, pass_start + self.n)
        np.testing.assert_array_equal(
            np.sort(pos[~pad]), np.arange(self.index - pass_start, new_index - pass_start)
        )
        np.add.at(self.counts, pos[~pad], 1)
        np.add.at(self.index_counts, idx, 1)
        self.yielded += pos.size
        self.padded += int(np.count_nonzero(pad))
        self.index = new_index

    def finish_pass(self, shards: list[Shard]) -> None:
        assert self.index % self.n == 0
        # Exactly once: every position, hence every dataset index, once...
        assert (self.counts == 1).all()
        # ...and the padding flagged is the padding the shards announced, which is
        # exactly the surplus of samples over n (the duplicates).
        assert self.padded == self.yielded - self.n
        assert self.padded == shards[0].total_padding == sum(s.padding for s in shards)
        assert (self.index_counts >= 1).all()
        assert int((self.index_counts - 1).sum()) == self.padded
        self.counts[:] = 0
        self.index_counts[:] = 0
        self.yielded = self.padded = 0
        self.passes_done += 1

    def check_prefix(self) -> None:
        consumed = self.index % self.n
        assert (self.counts[:consumed] == 1).all()
        assert (self.counts[consumed:] == 0).all()


segments = st.lists(
    st.tuples(world_sizes, local_batch_sizes, st.integers(1, 8)), min_size=1, max_size=4
)


@settings(max_examples=60, deadline=None)
@given(
    n=lengths,
    schedule=segments,
    last=st.tuples(world_sizes, local_batch_sizes),
    seed=seeds,
    epoch=st.integers(0, 5),
    shuffle=st.booleans(),
)
def test_prefix_exactly_once_and_determinism_over_restarts_and_resizes(
    n: int,
    schedule: list[tuple[int, int, int]],
    last: tuple[int, int],
    seed: int,
    epoch: int,
    shuffle: bool,
) -> None:
    sim = Simulation(n, seed, epoch, shuffle)
    for num_replicas, local_bsz, batches in schedule:
        sim.run_segment(num_replicas, local_bsz, batches)
    sim.check_prefix()
    # Finish the pass (when that fits the sample budget) with one more world size,
    # in at most ~20 batches, so that the exactly-once check at its end runs.
    num_replicas, local_bsz = last
    local_left = -(-sim.remaining() // num_replicas)
    if sim.drawn + num_replicas * local_left <= MAX_SAMPLES:
        passes = sim.passes_done
        sim.run_segment(num_replicas, max(local_bsz, -(-local_left // 20)), 21)
        assert sim.passes_done > passes
    sim.check_prefix()
    event(f"passes completed: {min(sim.passes_done, 3)}")
    event(f"n below some world size: {n < max(r for r, _, _ in schedule)}")


def test_simulation_detects_a_broken_stride() -> None:
    # The invariants checked above must be able to fail: replicas that take
    # contiguous blocks instead of strided positions break the per-batch prefix.
    class Blocked(Shard):
        def positions(self, lo: int = 0, hi: int | None = None) -> np.ndarray:
            hi = self.count if hi is None else hi
            return self.start + self.rank * self.count + np.arange(lo, hi)

    sim = Simulation(100, 0, 0, False)
    shards = [Blocked(100, 0, 2, rank, shuffle=False) for rank in range(2)]
    with pytest.raises(AssertionError):
        sim.draw_batch(shards, 0, 5)
