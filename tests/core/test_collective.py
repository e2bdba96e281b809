"""Tests for adaptdl.core.collective: wire format, reductions, local and thread groups."""

from __future__ import annotations

import functools
import math
import threading
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tests.threadcollective import ThreadCollective, run_replicas

from adaptdl.core.collective import (
    Collective,
    CollectiveAborted,
    CollectiveMismatch,
    CollectiveTimeout,
    Deferred,
    GroupMember,
    LocalCollective,
    Ready,
    add,
    check_root,
    decode,
    encode,
    fold,
    logical_or,
    maximum,
    wire_copy,
)

SETTINGS = settings(max_examples=60, deadline=None)

scalars = (
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8)
)
json_values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner),
    max_leaves=12,
)


def _normalise(value: Any) -> Any:
    """What a value looks like after crossing the wire: tuples become lists."""
    if isinstance(value, (list, tuple)):
        return [_normalise(v) for v in value]
    if isinstance(value, dict):
        return {k: _normalise(v) for k, v in value.items()}
    return value


# --------------------------------------------------------------------------- wire format


@SETTINGS
@given(json_values)
def test_decode_inverts_encode(value: Any) -> None:
    assert decode(encode(value)) == _normalise(value)


@SETTINGS
@given(st.dictionaries(st.text(max_size=4), st.integers(), max_size=6), st.randoms())
def test_encode_is_canonical_whatever_the_key_order(d: dict[str, int], rnd: Any) -> None:
    items = list(d.items())
    rnd.shuffle(items)
    assert encode(dict(items)) == encode(d)


def test_encode_is_compact_sorted_ascii() -> None:
    assert encode({"b": 1, "a": [1, 2.5], "é": None}) == b'{"a":[1,2.5],"b":1,"\\u00e9":null}'


def test_non_finite_floats_travel() -> None:
    out = decode(encode([math.inf, -math.inf, math.nan]))
    assert out[0] == math.inf and out[1] == -math.inf and math.isnan(out[2])


def test_tuples_arrive_as_lists() -> None:
    assert decode(encode((1, (2, 3)))) == [1, [2, 3]]


@pytest.mark.parametrize(
    ("value", "fragment"),
    [
        (object(), "value = <object"),
        ({"a": [1, {2, 3}]}, "value['a'][1] = {2, 3} (set)"),
        (b"bytes", "(bytes)"),
        ({1: "x"}, "has key 1 (int)"),
        (np.int64(3), ".item()"),
    ],
)
def test_encode_rejects_values_that_cannot_travel_naming_them(value: Any, fragment: str) -> None:
    with pytest.raises(TypeError, match="cannot travel") as info:
        encode(value)
    assert fragment in str(info.value)


def test_encode_rejects_circular_values() -> None:
    loop: list[Any] = [1]
    loop.append(loop)
    with pytest.raises(ValueError, match=r"value\[1\] is a circular reference"):
        encode(loop)


def test_shared_but_acyclic_values_are_accepted() -> None:
    shared = [1, 2]
    assert decode(encode([shared, shared])) == [[1, 2], [1, 2]]


def test_decode_rejects_bad_data() -> None:
    with pytest.raises(ValueError, match="not valid encoded JSON"):
        decode(b"{not json")
    with pytest.raises(ValueError, match="not valid encoded JSON"):
        decode(b"\xff\xfe")
    with pytest.raises(TypeError, match="data must be bytes"):
        decode("text")  # type: ignore[arg-type]


# --------------------------------------------------------------------------- reductions


def test_add_numbers_lists_dicts_and_none() -> None:
    assert add(1, 2.5) == 3.5
    assert add([1, 2], (3, 4)) == [4, 6]
    assert add({"a": 1, "b": [1]}, {"b": [2], "c": 3}) == {"a": 1, "b": [3], "c": 3}
    assert add(None, {"a": 1}) == {"a": 1}
    assert add(7, None) == 7
    assert add(True, True) == 2


def test_add_does_not_mutate_its_inputs() -> None:
    a = {"x": [1, 2]}
    b = {"x": [3, 4], "y": 1}
    add(a, b)
    assert a == {"x": [1, 2]} and b == {"x": [3, 4], "y": 1}


def test_add_rejects_lists_of_different_lengths() -> None:
    with pytest.raises(ValueError, match="lengths 2 and 3"):
        add([1, 2], [1, 2, 3])


@pytest.mark.parametrize(("a", "b"), [("x", "y"), (1, [1]), ({"a": 1}, 2), ("x", 1)])
def test_add_rejects_incompatible_values(a: Any, b: Any) -> None:
    with pytest.raises(TypeError, match="add: cannot combine"):
        add(a, b)


def test_logical_or_and_maximum() -> None:
    assert logical_or(False, 0) is False
    assert logical_or([True, False], [False, False]) == [True, False]
    assert logical_or({"stop": False}, {"stop": 1}) == {"stop": True}
    assert maximum(3, 7.5) == 7.5
    assert maximum([1, 9], [4, 2]) == [4, 9]
    assert math.isnan(maximum(math.nan, 1.0)) and math.isnan(maximum(1.0, math.nan))


# --------------------------------------------------------------------------- local


def test_local_collective_is_one_replica_returning_copies() -> None:
    c: Collective = LocalCollective()
    assert (c.rank, c.num_replicas) == (0, 1)
    value = {"a": [1, 2]}
    for out in (c.broadcast(value), c.allreduce(value), c.allreduce_async(value).result()):
        assert out == value and out is not value and out["a"] is not value["a"]
    gathered = c.allgather(value)
    assert gathered == [value] and gathered[0] is not value
    c.barrier()


def test_local_collective_rejects_bad_values_like_many_replicas() -> None:
    with pytest.raises(TypeError, match="cannot travel"):
        LocalCollective().allreduce({"x": object()})
    with pytest.raises(ValueError, match=r"root must be in \[0, 0\], got 1"):
        LocalCollective().broadcast(1, root=1)


# --------------------------------------------------------------------------- threads


@SETTINGS
@given(
    st.integers(1, 5).flatmap(
        lambda n: st.lists(
            st.lists(st.floats(-1e6, 1e6, allow_nan=False), min_size=3, max_size=3),
            min_size=n,
            max_size=n,
        )
    )
)
def test_allreduce_is_the_rank_order_fold_bitwise_equal_everywhere(
    values: list[list[float]],
) -> None:
    results = run_replicas(len(values), lambda c: c.allreduce(values[c.rank]))
    expected = functools.reduce(add, values)
    assert all(encode(r) == encode(expected) for r in results)


@SETTINGS
@given(st.integers(1, 5).flatmap(lambda n: st.tuples(st.just(n), st.integers(0, n - 1))))
def test_broadcast_gives_roots_value_and_allgather_rank_order(n_root: tuple[int, int]) -> None:
    n, root = n_root

    def fn(c: ThreadCollective) -> tuple[Any, Any]:
        return c.broadcast({"from": c.rank}, root=root), c.allgather(c.rank * 10)

    for bcast, gathered in run_replicas(n, fn):
        assert bcast == {"from": root}
        assert gathered == [r * 10 for r in range(n)]


def test_broadcast_ignores_non_root_values_even_unsendable_ones() -> None:
    out = run_replicas(2, lambda c: c.broadcast(5 if c.rank == 0 else object()))
    assert out == [5, 5]


def test_broadcast_rejects_a_root_outside_the_group() -> None:
    (c,) = ThreadCollective.group(1)
    with pytest.raises(ValueError, match=r"root must be in \[0, 0\], got 3"):
        c.broadcast(1, root=3)


def test_custom_op_is_folded_in_rank_order() -> None:
    out = run_replicas(3, lambda c: c.allreduce([c.rank], op=lambda a, b: a + b))
    assert out == [[0, 1, 2]] * 3


def test_barrier_waits_for_every_replica() -> None:
    arrived: list[int] = []
    lock = threading.Lock()

    def fn(c: ThreadCollective) -> int:
        with lock:
            arrived.append(c.rank)
        c.barrier()
        with lock:
            return len(arrived)

    assert run_replicas(4, fn) == [4, 4, 4, 4]


def test_allreduce_async_does_not_wait_for_peers() -> None:
    # Replica 1 joins only after replica 0's allreduce_async returned: if it blocked
    # until every replica joined, neither could proceed.
    issued = threading.Event()

    def fn(c: ThreadCollective) -> Any:
        if c.rank == 0:
            future = c.allreduce_async(1)
            issued.set()
            return future.result()
        assert issued.wait(timeout=30)
        return c.allreduce_async(2).result()

    assert run_replicas(2, fn) == [3, 3]


def test_several_async_allreduces_in_flight_resolve_in_any_order() -> None:
    def fn(c: ThreadCollective) -> list[Any]:
        futures = [c.allreduce_async({"k": i + c.rank}) for i in range(3)]
        c.barrier()
        first = futures[2].result()
        assert futures[2].result() is first
        return [f.result() for f in futures]

    out = run_replicas(2, fn)
    assert out == [[{"k": 1}, {"k": 3}, {"k": 5}]] * 2


def test_values_cross_as_json_so_replicas_never_alias() -> None:
    shared = {"x": [1]}
    out = run_replicas(2, lambda c: c.allgather(shared))
    assert out[0] == out[1] == [shared, shared]
    assert out[0][0] is not shared and out[0][0] is not out[1][0]


def test_a_missing_peer_times_out_with_a_clear_error() -> None:
    c0, _ = ThreadCollective.group(2, timeout=0.05)
    with pytest.raises(CollectiveTimeout, match=r"replicas \[1\] did not join within 0.05 s"):
        c0.barrier()
    assert issubclass(CollectiveTimeout, TimeoutError)


def test_different_operations_at_one_position_are_detected() -> None:
    def fn(c: ThreadCollective) -> None:
        if c.rank == 0:
            c.barrier()
        else:
            c.allgather(1)

    with pytest.raises(CollectiveMismatch, match="same collectives in the same order"):
        run_replicas(2, fn)


def test_broadcasts_from_different_roots_are_detected() -> None:
    with pytest.raises(CollectiveMismatch, match=r"broadcast\(root="):
        run_replicas(2, lambda c: c.broadcast(0, root=c.rank))


def test_run_replicas_reraises_the_failure_and_aborts_waiting_peers() -> None:
    seen: list[BaseException] = []

    def fn(c: ThreadCollective) -> None:
        if c.rank == 1:
            raise KeyError("replica one failed")
        try:
            c.barrier()
        except CollectiveAborted as exc:
            seen.append(exc)
            raise

    with pytest.raises(KeyError, match="replica one failed"):
        run_replicas(2, fn, timeout=300)
    assert len(seen) == 1 and "replica 1 raised KeyError" in str(seen[0])


def test_an_aborted_group_refuses_further_operations() -> None:
    c0, c1 = ThreadCollective.group(2)
    c1.abort("test")
    with pytest.raises(CollectiveAborted, match="aborted: test"):
        c0.allreduce(1)


def test_unsendable_values_fail_with_type_error_in_threads_too() -> None:
    with pytest.raises(TypeError, match="cannot travel"):
        run_replicas(2, lambda c: c.allreduce({"v": {1, 2}} if c.rank == 0 else {"v": 1}))


def test_group_validates_its_arguments() -> None:
    with pytest.raises(ValueError, match="num_replicas must be >= 1, got 0"):
        ThreadCollective.group(0)
    with pytest.raises(ValueError, match=r"timeout must be > 0\.0"):
        ThreadCollective.group(2, timeout=0)
    with pytest.raises(TypeError, match="num_replicas must be an int"):
        ThreadCollective.group(2.0)  # type: ignore[arg-type]


def test_thread_collective_satisfies_the_protocol() -> None:
    c: Collective = ThreadCollective.group(1)[0]
    assert (c.rank, c.num_replicas) == (0, 1)
    assert c.allreduce(2) == 2


# --------------------------------------------------------------------------- shared helpers


@SETTINGS
@given(st.one_of(json_values, st.tuples(scalars, scalars)))
def test_wire_copy_is_what_arrives_and_never_aliases(value: Any) -> None:
    copied = wire_copy(value)
    assert copied == decode(encode(value)) == _normalise(value)
    assert type(copied) is type(decode(encode(value)))
    if isinstance(value, (list, dict)):
        assert copied is not value


@pytest.mark.parametrize("value", [np.int64(1), {1: 2}, [object()], (np.int64(3),)])
def test_wire_copy_refuses_what_cannot_travel(value: Any) -> None:
    with pytest.raises(TypeError, match="cannot travel"):
        wire_copy(value)


@SETTINGS
@given(st.lists(st.integers(-100, 100), min_size=1, max_size=6))
def test_fold_is_the_rank_order_left_fold(values: list[int]) -> None:
    assert fold(values, lambda a, b: a - b) == functools.reduce(lambda a, b: a - b, values)
    assert fold([[v] for v in values], lambda a, b: a + b) == values


def test_futures_give_one_value_computed_once() -> None:
    calls: list[int] = []
    deferred = Deferred(lambda: calls.append(1) or [len(calls)])
    assert calls == []
    first = deferred.result()
    assert deferred.result() is first and calls == [1]
    assert Ready("x").result() == "x"


def test_check_root_names_the_group() -> None:
    assert check_root(2, 3) == 2
    with pytest.raises(ValueError, match=r"root must be in \[0, 2\], got 3"):
        check_root(3, 3)


def test_group_members_know_their_place_and_refuse_a_rank_outside_the_group() -> None:
    assert (LocalCollective().rank, LocalCollective().num_replicas) == (0, 1)
    assert [(c.rank, c.num_replicas) for c in ThreadCollective.group(2)] == [(0, 2), (1, 2)]
    with pytest.raises(ValueError, match=r"rank must be in \[0, 1\], got 2"):
        GroupMember(2, 2)
    with pytest.raises(ValueError, match="num_replicas must be >= 1"):
        GroupMember(0, 0)
