"""Seeds: the same on every replica, platform and Python version, and spread apart."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from adaptdl.core.order.seed import SHUFFLE_SEED, derive_seed


def test_derive_seed_is_pinned_across_platforms_and_versions() -> None:
    # blake2b of the decimal text: never Python's salted hash(). Values pinned so
    # that a change of the derivation (which would reshuffle resumed jobs) fails here.
    assert derive_seed(0, 1, 2) == 217875049918638303
    assert derive_seed(5) == 5786218386757528133
    assert SHUFFLE_SEED == 0


def test_derive_seed_spreads() -> None:
    assert len({derive_seed(0, e, r) for e in range(10) for r in range(10)}) == 100
    assert derive_seed(1, 23) != derive_seed(12, 3)  # parts are separated


@given(st.lists(st.integers(-(2**70), 2**70), max_size=5))
def test_derive_seed_is_a_63_bit_function_of_its_parts(parts: list[int]) -> None:
    seed = derive_seed(*parts)
    assert seed == derive_seed(*parts)
    assert 0 <= seed < 2**63
