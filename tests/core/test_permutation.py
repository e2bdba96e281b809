"""Properties of adaptdl.core.order.permutation: bijection, determinism, shuffle quality."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.stats
from hypothesis import given, settings
from hypothesis import strategies as st

from adaptdl.core.order.permutation import (
    MAX_N,
    Identity,
    Permutation,
    make_permutation,
    round_keys,
)

# Lengths biased to small values, where the network's halves are tiny and edge
# cases (n = 1, 2, one bit per half, cycle walking) live.
small_or_medium_n = st.one_of(st.integers(1, 64), st.integers(1, 10**5))
any_n = st.one_of(st.integers(1, 64), st.integers(1, 10**6), st.integers(1, MAX_N))
seeds = st.integers(0, 2**64)
counters = st.integers(0, 1000)


def vectorised(perm: Permutation, positions: list[int]) -> list[int]:
    """``perm.take`` forced through the numpy path (short inputs use Python ints)."""
    padded = np.array(positions + [0] * 32, dtype=np.int64)
    return perm.take(padded)[: len(positions)].tolist()


@settings(max_examples=100, deadline=None)
@given(n=small_or_medium_n, seed=seeds, epoch=counters, pass_=counters)
def test_take_of_all_positions_is_a_bijection(n: int, seed: int, epoch: int, pass_: int) -> None:
    values = Permutation(n, seed=seed, epoch=epoch, pass_=pass_).take(np.arange(n))
    assert values.dtype == np.int64
    np.testing.assert_array_equal(np.sort(values), np.arange(n))


def test_every_small_n_is_a_bijection() -> None:
    for n in range(1, 600):
        values = Permutation(n, seed=n).take(np.arange(n))
        np.testing.assert_array_equal(np.sort(values), np.arange(n))


@pytest.mark.parametrize("n", [2**16 + 1, 2**20 + 1, 3 * 2**18 + 5, 999_983])
def test_bijection_where_cycle_walking_is_needed(n: int) -> None:
    # These n leave part of the Feistel domain outside [0, n), so some positions
    # only land in range after several passes of the network.
    perm = Permutation(n, seed=5)
    values = perm.take(np.arange(n))
    np.testing.assert_array_equal(np.sort(values), np.arange(n))
    rng = np.random.default_rng(0)
    sample = rng.integers(0, n, 200).tolist()
    assert [perm[i] for i in sample] == values[sample].tolist()


@settings(max_examples=100, deadline=None)
@given(n=any_n, seed=seeds, epoch=counters, pass_=counters, data=st.data())
def test_scalar_and_vectorised_paths_agree(
    n: int, seed: int, epoch: int, pass_: int, data: st.DataObject
) -> None:
    perm = Permutation(n, seed=seed, epoch=epoch, pass_=pass_)
    positions = data.draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=40))
    scalar = [perm[i] for i in positions]
    assert scalar == vectorised(perm, positions)
    assert scalar == perm.take(np.array(positions[:16])).tolist() + scalar[16:]
    assert all(0 <= v < n for v in scalar)
    # A bijection maps distinct positions to distinct values.
    assert len(set(scalar)) == len(set(positions))


@settings(max_examples=50, deadline=None)
@given(n=st.integers(2**30, MAX_N), seed=seeds)
def test_large_n_sampled_positions_are_distinct_and_in_range(n: int, seed: int) -> None:
    rng = np.random.default_rng(seed % 2**32)
    positions = np.unique(rng.integers(0, n, 20_000, dtype=np.int64))
    values = Permutation(n, seed=seed).take(positions)
    assert values.min() >= 0
    assert values.max() < n
    assert np.unique(values).size == positions.size


# Literal outputs: a change of platform, numpy, Python or of the network itself fails
# here. (n, seed, epoch, pass_) -> values at `positions`.
GOLDEN = [
    ((2, 0, 0, 0), [0, 1], [0, 1]),
    ((10, 0, 0, 0), list(range(8)), [1, 2, 9, 7, 6, 8, 5, 0]),
    ((10, 1, 0, 0), list(range(8)), [2, 6, 0, 9, 5, 8, 4, 7]),
    ((1000, 7, 0, 0), list(range(8)), [953, 40, 655, 690, 95, 659, 417, 359]),
    ((1000, 7, 1, 0), list(range(8)), [589, 425, 519, 386, 636, 897, 322, 504]),
    ((1000, 7, 0, 1), list(range(8)), [613, 900, 157, 971, 170, 265, 580, 857]),
    (
        (10**8, 42, 3, 1),
        [0, 1, 2, 33333333, 50000000, 99999997, 99999998, 99999999],
        [80089537, 44612435, 12865357, 56834460, 74578163, 26198152, 36140520, 84947653],
    ),
    (
        (2**40 + 3, 123456789, 0, 0),
        [0, 1, 2, 366503875926, 549755813889, 1099511627776, 1099511627777, 1099511627778],
        [
            365843605761,
            847846244104,
            467394000617,
            561245472741,
            848056266768,
            521296875105,
            1077666453545,
            835350959257,
        ],
    ),
    (
        (2**62, 2**70, 5, 9),
        [0, 1, 2, 2**62 // 3, 2**61, 2**62 - 3, 2**62 - 2, 2**62 - 1],
        [
            3336071496012357822,
            3771063653571898987,
            3554954364188064867,
            2983509922534999126,
            3762745501757332932,
            1513219961293926239,
            539516737171615448,
            657502094435734531,
        ],
    ),
]


@pytest.mark.parametrize(("args", "positions", "expected"), GOLDEN)
def test_golden_values(
    args: tuple[int, int, int, int], positions: list[int], expected: list[int]
) -> None:
    n, seed, epoch, pass_ = args
    perm = Permutation(n, seed=seed, epoch=epoch, pass_=pass_)
    assert [perm[i] for i in positions] == expected
    assert vectorised(perm, positions) == expected


def test_golden_round_keys() -> None:
    keys = round_keys(10**8, 42, 3, 1)
    assert len(keys) == 8
    assert keys[0] == Permutation(10**8, seed=42, epoch=3, pass_=1)._keys[0]
    assert len(round_keys(100, 0, 0, 0)) == 24
    assert len(round_keys(1000, 0, 0, 0)) == 12


@settings(max_examples=50, deadline=None)
@given(n=any_n, seed=seeds, epoch=counters, pass_=counters)
def test_same_arguments_give_the_same_order(n: int, seed: int, epoch: int, pass_: int) -> None:
    a = Permutation(n, seed=seed, epoch=epoch, pass_=pass_)
    b = Permutation(n, seed=seed, epoch=epoch, pass_=pass_)
    assert a == b
    positions = np.arange(min(n, 1000))
    np.testing.assert_array_equal(a.take(positions), b.take(positions))


def test_iter_and_len_match_take() -> None:
    for n in [1, 2, 17, 1000, 70_000]:
        perm = Permutation(n, seed=3)
        assert len(perm) == n
        listed = list(perm)
        assert all(type(v) is int for v in listed[:50])
        assert listed == perm.take(np.arange(n)).tolist()


def test_take_keeps_shape_and_accepts_any_integer_dtype() -> None:
    perm = Permutation(1000, seed=1)
    grid = np.arange(600, dtype=np.uint16).reshape(20, 30)
    out = perm.take(grid)
    assert out.shape == (20, 30)
    assert out.dtype == np.int64
    np.testing.assert_array_equal(out.ravel(), perm.take(np.arange(600)))
    assert perm.take(np.array([], dtype=np.int64)).shape == (0,)
    assert perm.take([3, 4]).tolist() == [perm[3], perm[4]]
    assert perm.take(np.int32(7)).shape == ()
    assert int(perm.take(np.int32(7))) == perm[7]


def test_negative_positions_count_from_the_end_in_getitem() -> None:
    perm = Permutation(50, seed=9)
    assert perm[-1] == perm[49]
    assert perm[-50] == perm[0]
    assert perm[np.int64(3)] == perm[3]


def test_single_element_permutation() -> None:
    perm = Permutation(1, seed=123)
    assert perm[0] == 0
    assert perm[-1] == 0
    assert list(perm) == [0]
    assert perm.take(np.zeros(40, dtype=np.int64)).tolist() == [0] * 40


@pytest.mark.parametrize("factory", [lambda: Permutation(10, seed=1), lambda: Identity(10)])
def test_out_of_range_positions_raise_index_error(factory: object) -> None:
    perm = factory()  # type: ignore[operator]
    for bad in (10, -11, 10**30):
        with pytest.raises(IndexError, match="position"):
            perm[bad]
    for bad_array in ([10], [-1], [0, 1, 2, 11] * 10):
        with pytest.raises(IndexError, match="positions must be in"):
            perm.take(np.array(bad_array))
    with pytest.raises(TypeError, match="positions must be an integer array"):
        perm.take(np.array([1.0, 2.0]))
    with pytest.raises(TypeError, match="position must be an int"):
        perm[1.5]
    with pytest.raises(ValueError, match="position must be an int"):
        perm[True]


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"n": 0}, "n"),
        ({"n": -5}, "n"),
        ({"n": MAX_N + 1}, "n"),
        ({"n": 2.0}, "n"),
        ({"n": True}, "n"),
        ({"n": "10"}, "n"),
        ({"n": 10, "seed": -1}, "seed"),
        ({"n": 10, "seed": 1.5}, "seed"),
        ({"n": 10, "epoch": -1}, "epoch"),
        ({"n": 10, "epoch": None}, "epoch"),
        ({"n": 10, "pass_": -1}, "pass_"),
        ({"n": 10, "pass_": False}, "pass_"),
    ],
)
def test_bad_arguments_raise_value_error_naming_them(kwargs: dict[str, object], name: str) -> None:
    with pytest.raises(ValueError, match=rf"^{name} must be"):
        Permutation(**kwargs)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=rf"^{name} must be"):
        make_permutation(**{"seed": 0, "epoch": 0, "pass_": 0, **kwargs}, shuffle=False)  # type: ignore[arg-type]


def test_numpy_integers_are_accepted_and_normalised() -> None:
    perm = Permutation(np.int64(100), seed=np.uint32(4), epoch=np.int8(1), pass_=np.int16(2))
    assert perm == Permutation(100, seed=4, epoch=1, pass_=2)
    assert type(perm.n) is int


def test_make_permutation() -> None:
    shuffled = make_permutation(100, seed=1, epoch=2, pass_=3, shuffle=True)
    assert shuffled == Permutation(100, seed=1, epoch=2, pass_=3)
    plain = make_permutation(100, seed=1, epoch=2, pass_=3, shuffle=False)
    assert plain == Identity(100)
    with pytest.raises(ValueError, match="shuffle must be a bool"):
        make_permutation(100, seed=0, epoch=0, pass_=0, shuffle=1)  # type: ignore[arg-type]


def test_identity_interface() -> None:
    ident = Identity(20)
    assert len(ident) == 20
    assert list(ident) == list(range(20))
    assert ident[5] == 5
    assert ident[-1] == 19
    out = ident.take(np.array([[3, 1], [0, 19]], dtype=np.uint8))
    assert out.dtype == np.int64
    assert out.tolist() == [[3, 1], [0, 19]]
    with pytest.raises(ValueError, match=r"^n must be"):
        Identity(0)


# --- shuffle quality -------------------------------------------------------------
# Each check uses fixed seeds, so it is deterministic: a p-value that passes today
# passes forever, and the thresholds catch a broken network, not bad luck.


def counts_over_seeds(n: int, positions: list[int], seeds: range) -> np.ndarray:
    """Values at ``positions`` for each seed, as an array (seeds, positions)."""
    return np.array([Permutation(n, seed=s).take(np.array(positions)) for s in seeds])


@pytest.mark.parametrize("n", [2, 3, 4, 12, 50, 1000, 70_000])
def test_each_position_is_uniform_over_seeds(n: int) -> None:
    buckets = min(n, 50)
    trials = 100 * buckets
    values = counts_over_seeds(n, [0, n // 2, n - 1], range(trials))
    # Unequal buckets when `buckets` does not divide n: expect in proportion to size.
    sizes = np.bincount(np.arange(n) * buckets // n, minlength=buckets)
    for column in values.T:
        observed = np.bincount(column * buckets // n, minlength=buckets)
        p = scipy.stats.chisquare(observed, sizes * trials / n).pvalue
        assert p > 1e-3, (n, p)


@pytest.mark.parametrize("n", [3, 4, 12])
def test_pairs_of_positions_are_uniform_over_seeds_for_tiny_n(n: int) -> None:
    # The weak spot of a Feistel network is a tiny domain; with too few rounds the
    # joint law of two outputs is visibly off long before a single one is.
    trials = 150 * n * (n - 1)
    values = counts_over_seeds(n, [0, 1], range(trials))
    observed = np.bincount(values[:, 0] * n + values[:, 1], minlength=n * n)
    observed = observed[observed > 0]
    assert observed.size == n * (n - 1)
    assert scipy.stats.chisquare(observed).pvalue > 1e-3


def test_neighbouring_outputs_are_uncorrelated() -> None:
    n = 10**6
    bound = 5 / np.sqrt(n)  # five standard errors of a correlation of n pairs
    for seed in range(3):
        values = Permutation(n, seed=seed).take(np.arange(n)).astype(np.float64)
        assert abs(scipy.stats.pearsonr(values[:-1], values[1:])[0]) < bound
        assert abs(scipy.stats.pearsonr(values, np.arange(n))[0]) < bound
        # Low bits too: a weak mixer leaks parity between neighbours.
        assert abs(scipy.stats.pearsonr(values[:-1] % 2, values[1:] % 2)[0]) < bound
        # Steps between neighbours: uniform in sign.
        ups = int(np.count_nonzero(np.diff(values) > 0))
        assert abs(ups - (n - 1) / 2) < 5 * np.sqrt(n) / 2


@pytest.mark.parametrize(
    "other",
    [
        {"seed": 1},
        {"seed": 2**40},
        {"epoch": 1},
        {"pass_": 1},
        {"epoch": 1, "pass_": 1},
    ],
)
def test_different_seeds_epochs_and_passes_give_unrelated_orders(other: dict[str, int]) -> None:
    n = 10**5
    base = Permutation(n, seed=0).take(np.arange(n))
    changed = Permutation(n, **{"seed": 0, **other}).take(np.arange(n))
    assert abs(scipy.stats.pearsonr(base, changed)[0]) < 5 / np.sqrt(n)
    # Agreements of two independent permutations are ~Poisson(1).
    assert np.count_nonzero(base == changed) < 10
    head = 10_000
    tau = scipy.stats.kendalltau(base[:head], changed[:head]).statistic
    assert abs(tau) < 5 * np.sqrt(2 * (2 * head + 5) / (9 * head * (head - 1)))


def test_neighbouring_seeds_give_different_round_keys_for_every_field() -> None:
    base = round_keys(100, 0, 0, 0)
    for other in (round_keys(101, 0, 0, 0), round_keys(100, 1, 0, 0)):
        assert set(base).isdisjoint(other)
    assert set(round_keys(100, 0, 1, 0)).isdisjoint(round_keys(100, 0, 0, 1))
    # The encoding keeps fields apart: (seed=1, epoch=23) is not (seed=12, epoch=3).
    assert round_keys(100, 1, 23, 0) != round_keys(100, 12, 3, 0)
