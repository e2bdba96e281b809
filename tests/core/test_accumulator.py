"""Tests for adaptdl.core.stats.accumulator: sums across replicas, replays, misuse."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, TypeVar

import attrs
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tests.threadcollective import ThreadCollective, run_replicas

from adaptdl.core.collective import Collective, Future, LocalCollective, add, encode
from adaptdl.core.persist.checkpoint import CheckpointError, CollectiveState, State
from adaptdl.core.stats.accumulator import Accumulator, ReplayPosition

SETTINGS = settings(max_examples=60, deadline=None)
T = TypeVar("T")
KEYS = ["loss", "correct", "total"]


class _Counting:
    """A collective that counts the operations that communicate."""

    def __init__(self, inner: Collective) -> None:
        self.inner = inner
        self.calls = 0

    @property
    def rank(self) -> int:
        return self.inner.rank

    @property
    def num_replicas(self) -> int:
        return self.inner.num_replicas

    def broadcast(self, value: T, root: int = 0) -> T:
        self.calls += 1
        return self.inner.broadcast(value, root)

    def allreduce(self, value: T, op: Callable[[T, T], T] = add) -> T:
        self.calls += 1
        return self.inner.allreduce(value, op)

    def allreduce_async(self, value: T, op: Callable[[T, T], T] = add) -> Future[T]:
        self.calls += 1
        return self.inner.allreduce_async(value, op)

    def allgather(self, value: T) -> list[T]:
        self.calls += 1
        return self.inner.allgather(value)

    def barrier(self) -> None:
        self.calls += 1
        self.inner.barrier()


# --------------------------------------------------------------------------- sums


rounds_strategy = st.integers(1, 4).flatmap(
    lambda n: st.lists(
        st.lists(  # one round: per replica, a list of (key, value) updates
            st.lists(st.tuples(st.sampled_from(KEYS), st.integers(-1000, 1000)), max_size=4),
            min_size=n,
            max_size=n,
        ),
        min_size=1,
        max_size=5,
    )
)


@SETTINGS
@given(rounds_strategy)
def test_synchronized_totals_are_the_sum_over_replicas_and_rounds(
    rounds: list[list[list[tuple[str, int]]]],
) -> None:
    n = len(rounds[0])

    def fn(c: ThreadCollective) -> list[dict[str, Any]]:
        acc = Accumulator(c)
        seen = []
        for updates in rounds:
            for key, value in updates[c.rank]:
                acc[key] += value
            with acc.synchronized():
                seen.append(dict(acc))
        return seen

    results = run_replicas(n, fn)
    expected: dict[str, int] = {}
    for i, updates in enumerate(rounds):
        for replica in updates:
            for key, value in replica:
                expected[key] = expected.get(key, 0) + value
        assert all(r[i] == expected for r in results)


@SETTINGS
@given(
    st.integers(1, 4).flatmap(
        lambda n: st.lists(st.floats(-1e9, 1e9, allow_nan=False), min_size=n, max_size=n)
    )
)
def test_float_totals_are_bitwise_identical_on_every_replica(values: list[float]) -> None:
    def fn(c: ThreadCollective) -> bytes:
        acc = Accumulator(c, initial={"x": 0.1})
        acc["x"] += values[c.rank]
        acc["x"] += values[c.rank] / 3
        with acc.synchronized():
            return encode(acc["x"])

    out = run_replicas(len(values), fn)
    assert len(set(out)) == 1


def test_structured_values_add_elementwise_and_keywise() -> None:
    def fn(c: ThreadCollective) -> Any:
        acc = Accumulator(c)
        acc["hist"] += [c.rank, 1]
        acc["hist"] -= [0, 2]
        acc.update(by_class={str(c.rank): 1}, n=1)
        with acc.synchronized():
            return dict(acc)

    out = run_replicas(3, fn)
    assert out == [{"hist": [3, -3], "by_class": {"0": 1, "1": 1, "2": 1}, "n": 3}] * 3


def test_assignment_outside_sets_this_replicas_contribution() -> None:
    def fn(c: ThreadCollective) -> Any:
        acc = Accumulator(c, initial={"a": 100})
        acc["a"] += 5
        acc["a"] = c.rank  # replaces the pending 5
        acc["b"] += 1
        del acc["b"]
        acc["c"] += 1
        acc.clear() if c.rank == 0 else None
        with acc.synchronized():
            return dict(acc)

    assert run_replicas(2, fn) == [{"a": 101, "c": 1}] * 2


def test_inside_synchronized_it_is_an_ordinary_dict_of_totals() -> None:
    acc = Accumulator(LocalCollective(), initial={"a": 1, "b": 2})
    with acc.synchronized() as same:
        assert same is acc and acc.is_synchronized
        assert len(acc) == 2 and "a" in acc and sorted(acc) == ["a", "b"]
        assert acc.get("zz", 7) == 7 and acc == {"a": 1, "b": 2}
        acc["a"] += 10
        acc.update(b=1, c=[1])
        assert acc.pop("c") == [1] and acc.setdefault("d", 4) == 4
        del acc["d"]
    assert not acc.is_synchronized
    with acc.synchronized():
        assert dict(acc) == {"a": 11, "b": 3}
        assert acc.popitem() == ("b", 3)
        acc.clear()
    with acc.synchronized():
        assert dict(acc) == {}


def test_to_bytes_after_sync_is_identical_on_every_replica() -> None:
    def fn(c: ThreadCollective) -> bytes:
        acc = Accumulator(c)
        acc["x"] += c.rank + 1
        with acc.synchronized():
            pass
        acc["x"] += 10
        acc.sync()
        return acc.to_bytes()

    out = run_replicas(3, fn)
    assert len(set(out)) == 1
    assert json.loads(out[0])["results"] == {"x": 36}


def test_accumulator_is_a_collective_state() -> None:
    acc = Accumulator(LocalCollective(), name="metrics")
    state: State = acc
    assert state.name == "metrics" and isinstance(acc, CollectiveState)


# --------------------------------------------------------------------------- replay


@attrs.define
class _Position:
    epoch: int | None = None
    in_loop: bool = False
    replaying: bool = False

    def __call__(self) -> ReplayPosition:
        return ReplayPosition(self.epoch, self.in_loop, self.replaying)


@attrs.frozen
class _Spec:
    epochs: int
    batches: int
    every: int  # synchronized() inside the loop after every `every` batches
    samples: list[list[list[int]]]  # epoch -> batch -> sample values


def _program(
    c: Collective,
    acc: Accumulator,
    pos: _Position,
    spec: _Spec,
    *,
    start: tuple[int, int] | None = None,
    stop: tuple[int, int] | None = None,
    marks: dict[tuple[int, int], int] | None = None,
) -> tuple[list[Any], bytes | None]:
    """A training program as AdaptDL replays it.

    ``start``: resumed from a checkpoint taken after that (epoch, batch): earlier
    epochs and batches are skipped, the rest of the program re-runs. ``stop``:
    checkpoint after that (epoch, batch) and return its bytes. ``marks``: record
    how many values were seen after each (epoch, batch).
    """
    seen: list[Any] = []
    pos.replaying = start is not None
    with acc.synchronized():
        seen.append(("init", dict(acc)))
    for epoch in range(start[0] if start else 0, spec.epochs):
        pos.epoch = epoch
        if c.rank == 0:
            acc["pre"] += epoch + 1
        with acc.synchronized():
            seen.append(("start", epoch, dict(acc)))
            acc["starts"] = acc.get("starts", 0) + 1  # a write inside: must not double
        if c.rank == 0:
            acc["post"] += 1  # after the last replayed entry: must not double either
        pos.in_loop, pos.replaying = True, False
        for batch in range(start[1] + 1 if start and epoch == start[0] else 0, spec.batches):
            for i, x in enumerate(spec.samples[epoch][batch]):
                if i % c.num_replicas == c.rank:
                    acc["sum"] += x
                    acc["n"] += 1
            if batch % spec.every == spec.every - 1:
                with acc.synchronized():
                    seen.append(("mid", epoch, batch, dict(acc)))
            if marks is not None:
                marks[(epoch, batch)] = len(seen)
            if stop == (epoch, batch):
                acc.sync()
                return seen, acc.to_bytes()
        pos.in_loop = False
        with acc.synchronized():
            seen.append(("end", epoch, dict(acc)))
            acc["sum"] = 0
    pos.epoch = None
    with acc.synchronized():
        seen.append(("final", dict(acc)))
    return seen, None


def _run(
    n: int,
    spec: _Spec,
    *,
    state: bytes | None = None,
    start: tuple[int, int] | None = None,
    stop: tuple[int, int] | None = None,
    marks: dict[tuple[int, int], int] | None = None,
) -> tuple[list[Any], bytes | None]:
    def fn(c: ThreadCollective) -> tuple[list[Any], bytes | None]:
        pos = _Position()
        acc = Accumulator(c, position=pos)
        if state is not None:
            acc.from_bytes(state)
        return _program(
            c, acc, pos, spec, start=start, stop=stop, marks=marks if c.rank == 0 else None
        )

    results = run_replicas(n, fn)
    assert all(r == results[0] for r in results)  # same values and bytes everywhere
    return results[0]


@st.composite
def _replay_cases(draw: st.DrawFn) -> tuple[_Spec, list[int], list[tuple[int, int]]]:
    epochs = draw(st.integers(1, 3))
    batches = draw(st.integers(1, 4))
    every = draw(st.integers(1, 3))
    samples = draw(
        st.lists(
            st.lists(
                st.lists(st.integers(-50, 50), max_size=5), min_size=batches, max_size=batches
            ),
            min_size=epochs,
            max_size=epochs,
        )
    )
    points = [(e, b) for e in range(epochs) for b in range(batches)]
    stops = sorted(draw(st.sets(st.sampled_from(points), min_size=1, max_size=2)))
    replicas = draw(st.lists(st.integers(1, 4), min_size=len(stops) + 1, max_size=len(stops) + 1))
    return _Spec(epochs, batches, every, samples), replicas, stops


@settings(max_examples=50, deadline=None)
@given(_replay_cases())
def test_restarts_replay_the_values_seen_before_and_continue_as_if_uninterrupted(
    case: tuple[_Spec, list[int], list[tuple[int, int]]],
) -> None:
    spec, replicas, stops = case
    marks: dict[tuple[int, int], int] = {}
    reference, _ = _run(replicas[0], spec, marks=marks)

    state: bytes | None = None
    start: tuple[int, int] | None = None
    for k, n in enumerate(replicas):
        stop = stops[k] if k < len(stops) else None
        seen, state_out = _run(n, spec, state=state, start=start, stop=stop)
        begin = 0 if start is None else marks[start]
        end = len(reference) if stop is None else marks[stop]
        if start is None:
            expected = reference[:end]
        else:
            # Re-run: the entry before the epoch loop and the interrupted epoch's start
            # replay; then the program goes on exactly where it stopped.
            (init,) = [v for v in reference if v[0] == "init"]
            (epoch_start,) = [v for v in reference if v[:2] == ("start", start[0])]
            expected = [init, epoch_start, *reference[begin:end]]
        assert seen == expected
        assert (state_out is None) == (stop is None)
        state, start = state_out, stop


def test_replayed_entries_do_not_communicate_and_work_with_another_replica_count() -> None:
    def before(c: ThreadCollective) -> tuple[list[Any], bytes]:
        acc = Accumulator(c)
        seen = []
        for i in range(3):
            acc["x"] += (i + 1) * (c.rank + 1)
            with acc.synchronized():
                seen.append(acc["x"])
        acc.sync()
        return seen, acc.to_bytes()

    (seen, state), _ = run_replicas(2, before)
    assert seen == [3, 9, 18]

    def after(c: ThreadCollective) -> tuple[list[Any], int]:
        counting = _Counting(c)
        acc = Accumulator(counting)
        acc.from_bytes(state)
        replayed = []
        for _ in range(3):
            acc["x"] += 1000  # re-executed updates: dropped at the replayed entry
            with acc.synchronized():
                replayed.append(acc["x"])
        calls = counting.calls
        acc["x"] += 1
        with acc.synchronized():
            replayed.append(acc["x"])
        return replayed, calls

    assert run_replicas(3, after) == [([3, 9, 18, 21], 0)] * 3


def test_writes_inside_a_replayed_block_are_discarded() -> None:
    acc = Accumulator(LocalCollective())
    acc["x"] += 1
    with acc.synchronized():
        acc["x"] *= 10
    acc.sync()
    restored = Accumulator(LocalCollective())
    restored.from_bytes(acc.to_bytes())
    with restored.synchronized():
        assert restored["x"] == 1  # what the block saw on entry
        restored["x"] = -5
    with restored.synchronized():
        assert restored["x"] == 10  # the live totals, as they were at the checkpoint


def test_contributions_while_replaying_are_dropped() -> None:
    pos = _Position(replaying=True)
    acc = Accumulator(LocalCollective(), position=pos, initial={"x": 1})
    acc["x"] += 5
    acc.update(x=5)
    acc["x"] = 5
    pos.replaying = False
    acc["x"] += 2
    with acc.synchronized():
        assert acc["x"] == 3


def test_history_keeps_only_the_current_epoch_and_skips_loops() -> None:
    pos = _Position()
    acc = Accumulator(LocalCollective(), position=pos)
    with acc.synchronized():
        pass
    for epoch in range(5):
        pos.epoch = epoch
        for _ in range(2):
            with acc.synchronized():
                pass
        pos.in_loop = True
        for _ in range(3):
            with acc.synchronized():
                pass
        pos.in_loop = False
    history = json.loads(acc.to_bytes())["history"]
    assert history == [[None, [{}]], [4, [{}, {}]]]


def test_state_round_trips_and_restarts_counting() -> None:
    acc = Accumulator(LocalCollective(), initial={"a": [1, 2]})
    with acc.synchronized():
        pass
    data = acc.to_bytes()
    other = Accumulator(LocalCollective())
    other.from_bytes(data)
    assert other.to_bytes() == data
    other.from_bytes(data)  # a second restore restarts the replay
    with other.synchronized():
        assert other["a"] == [1, 2]
    assert other.to_bytes() == data  # a replayed entry records nothing new


# --------------------------------------------------------------------------- misuse


def test_reading_outside_synchronized_raises_with_help() -> None:
    acc = Accumulator(LocalCollective(), initial={"x": 1})
    handle = acc["x"]
    for use in (
        lambda: float(handle),
        lambda: handle + 1,
        lambda: 1 + handle,
        lambda: handle < 1,
        lambda: handle == 1,
        lambda: bool(handle),
        lambda: print(f"{handle:.2f}"),
    ):
        with pytest.raises((RuntimeError, TypeError)) as info:
            use()
        if info.type is RuntimeError:
            assert "synchronized()" in str(info.value)
    with pytest.raises(RuntimeError, match="not allowed outside"):
        acc.setdefault("x")
    assert "pending update" in repr(handle) and "pending" in repr(acc)


def test_outside_synchronized_reads_see_an_empty_mapping() -> None:
    # As the seed's accumulator: a program may print len(acc) or test `in` anywhere.
    acc = Accumulator(LocalCollective(), initial={"x": 1})
    acc["x"] += 2
    assert len(acc) == 0 and "x" not in acc and list(acc) == [] and not acc
    assert acc.get("x") is None and acc.get("x", 7) == 7
    assert dict(acc.items()) == {} and list(acc.keys()) == [] and acc == {}
    assert acc.pop("x", "default") == "default"
    with pytest.raises(KeyError):
        acc.pop("x")
    with pytest.raises(KeyError):
        acc.popitem()
    with acc.synchronized():  # the reads changed nothing
        assert dict(acc) == {"x": 3} and len(acc) == 1 and "x" in acc


@given(
    st.dictionaries(st.sampled_from("abc"), st.integers(-1000, 1000), max_size=3),
    st.dictionaries(st.sampled_from("abc"), st.integers(-1000, 1000), max_size=3),
)
def test_in_place_add_and_subtract_of_a_mapping_match_update_and_subtract(
    plus: dict[str, int], minus: dict[str, int]
) -> None:
    ops = Accumulator(LocalCollective(), name="ops")
    calls = Accumulator(LocalCollective(), name="calls")
    ops += plus
    ops -= minus
    calls.update(plus)
    calls.subtract(minus)
    expected: dict[str, int] = {}
    for key, value in plus.items():
        expected[key] = expected.get(key, 0) + value
    for key, value in minus.items():
        expected[key] = expected.get(key, 0) - value
    with ops.synchronized(), calls.synchronized():
        assert dict(ops) == dict(calls) == expected
        ops += [("a", 1)]  # pairs, as dict() takes them, inside too
        assert ops["a"] == expected.get("a", 0) + 1


def test_in_place_add_of_a_non_mapping_is_a_type_error() -> None:
    acc = Accumulator(LocalCollective())
    with pytest.raises(TypeError, match=r"accumulator \+= takes a mapping"):
        acc += 3
    with pytest.raises(TypeError, match=r"accumulator -= takes a mapping"):
        acc -= "ab"


def test_nested_synchronized_is_an_error() -> None:
    acc = Accumulator(LocalCollective())
    with acc.synchronized(), pytest.raises(RuntimeError, match="cannot be nested"):  # noqa: SIM117
        with acc.synchronized():
            pass
    with acc.synchronized(), pytest.raises(RuntimeError, match="sync\\(\\) inside"):
        acc.sync()


def test_an_exception_inside_synchronized_leaves_accumulation_mode() -> None:
    acc = Accumulator(LocalCollective())
    with pytest.raises(KeyError), acc.synchronized():
        acc["missing"]
    assert not acc.is_synchronized


def test_bad_keys_and_values_are_refused_naming_them() -> None:
    acc = Accumulator(LocalCollective())
    with pytest.raises(TypeError, match=r"keys must be str, got 3 \(int\)"):
        acc[3] += 1  # type: ignore[index]
    with pytest.raises(TypeError, match=r"accumulator\['x'\] \+= .*\.item\(\)"):
        acc["x"] += np.array([1.0, 2.0])
    with pytest.raises(TypeError, match="cannot travel"):
        acc["x"] = object()
    with pytest.raises(TypeError, match="cannot subtract 'a'"):
        acc["x"] -= "a"
    with pytest.raises(TypeError, match="add: cannot combine"):
        acc["y"] += "a"
        acc["y"] += "b"


def test_handles_cannot_cross_keys_or_accumulators() -> None:
    acc = Accumulator(LocalCollective())
    other = Accumulator(LocalCollective())
    with pytest.raises(ValueError, match="an update of 'b'"):
        acc["a"] = acc["b"]
    with pytest.raises(ValueError, match="another accumulator"):
        acc["a"] = other["a"]
    handle = acc["a"]
    handle += 1
    with acc.synchronized(), pytest.raises(RuntimeError, match="cannot be applied inside"):
        acc["a"] = handle


def test_to_bytes_refuses_to_lose_pending_updates() -> None:
    acc = Accumulator(LocalCollective())
    acc["x"] += 1
    with pytest.raises(RuntimeError, match=r"pending updates \['x'\]: call sync\(\)"):
        acc.to_bytes()


@pytest.mark.parametrize(
    "data",
    [b"not json", b"[]", b'{"format": 2}', b'{"format": 1, "results": {}}',
     b'{"format": 1, "results": [], "history": []}',
     b'{"format": 1, "results": {}, "history": [["x", []]]}',
     b'{"format": 1, "results": {}, "history": [[1, [3]]]}'],
)  # fmt: skip
def test_from_bytes_rejects_bad_state(data: bytes) -> None:
    with pytest.raises(CheckpointError, match="state 'adaptdl-accumulator': bad accumulator"):
        Accumulator(LocalCollective()).from_bytes(data)


def test_constructor_and_position_validate_arguments() -> None:
    with pytest.raises(TypeError, match="name must be a non-empty str, got ''"):
        Accumulator(LocalCollective(), name="")
    with pytest.raises(TypeError, match="initial must be a mapping"):
        Accumulator(LocalCollective(), initial=[1])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="keys must be str"):
        Accumulator(LocalCollective(), initial={1: 2})  # type: ignore[dict-item]
    with pytest.raises(ValueError, match="epoch must be >= 0, got -1"):
        ReplayPosition(epoch=-1)
    with pytest.raises(TypeError, match="epoch must be an int or None, got True"):
        ReplayPosition(epoch=True)
    with pytest.raises(TypeError, match="in_loop"):
        ReplayPosition(in_loop=1)  # type: ignore[arg-type]
