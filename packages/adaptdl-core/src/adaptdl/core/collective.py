"""Collective operations on small JSON-able Python values.

A :class:`Collective` is how core state machines talk to their peer replicas:
broadcast a decision, sum a few metrics, gather a value from everyone. The values
are small JSON-able Python values (``None``, ``bool``, ``int``, ``float``, ``str``,
lists and tuples of them, dicts with ``str`` keys); on the wire they are
:func:`encode`'d JSON text in every implementation, so a value that cannot travel
fails the same way whichever implementation runs (with a :class:`TypeError` naming
the value), and tuples arrive as lists.

Ordering contract: every replica must call the collectives of a group in the same
order (the n-th collective call of one replica meets the n-th call of every other
replica). The tests' thread group (``tests/threadcollective.py``) detects a different
operation at the same position and raises :class:`CollectiveMismatch`; other
differences (the order of two allreduces with different values) cannot be detected
and give wrong results.

Reductions are deterministic: :meth:`Collective.allreduce` folds the replicas'
values in rank order, ``op(op(v0, v1), v2) ...``, on every replica, so a float sum
is bitwise identical everywhere. ``op`` must be the same function on every replica.

Implemented here: :class:`LocalCollective` (one replica). The torch adapter
provides one over ``torch.distributed`` that sends :func:`encode`'d bytes; the tests
run several replicas as threads of one process (``tests/threadcollective.py``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

import attrs

from adaptdl.core.validate import check_int

T = TypeVar("T")
R = TypeVar("R")
T_co = TypeVar("T_co", covariant=True)

__all__ = [
    "Collective",
    "CollectiveAborted",
    "CollectiveError",
    "CollectiveMismatch",
    "CollectiveTimeout",
    "Deferred",
    "Future",
    "GroupMember",
    "LocalCollective",
    "Ready",
    "add",
    "check_root",
    "decode",
    "encode",
    "fold",
    "logical_or",
    "maximum",
    "wire_copy",
]


# --------------------------------------------------------------------------- errors


class CollectiveError(RuntimeError):
    """A collective operation could not complete."""


class CollectiveTimeout(CollectiveError, TimeoutError):
    """A peer replica did not join a collective operation in time."""


class CollectiveMismatch(CollectiveError):
    """Replicas called different collective operations at the same position."""


class CollectiveAborted(CollectiveError):
    """The group was aborted (a replica failed); no further operation can complete."""


# --------------------------------------------------------------------------- wire format

_JSON_TYPES = "None, bool, int, float, str, list, tuple or dict with str keys"


def _check_jsonable(value: Any, path: str, stack: set[int]) -> None:
    if value is None or isinstance(value, (bool, int, float, str)):
        return
    if isinstance(value, (list, tuple, dict)):
        if id(value) in stack:
            raise ValueError(f"{path} is a circular reference and cannot travel between replicas")
        stack.add(id(value))
        if isinstance(value, dict):
            for key, item in value.items():
                if not isinstance(key, str):
                    raise TypeError(
                        f"{path} has key {key!r} ({type(key).__name__}) and cannot travel "
                        f"between replicas: dict keys of collective values must be str"
                    )
                _check_jsonable(item, f"{path}[{key!r}]", stack)
        else:
            for i, item in enumerate(value):
                _check_jsonable(item, f"{path}[{i}]", stack)
        stack.discard(id(value))
        return
    hint = "; convert it with .item() or .tolist()" if hasattr(value, "item") else ""
    raise TypeError(
        f"{path} = {value!r} ({type(value).__name__}) cannot travel between replicas: "
        f"collective values must be {_JSON_TYPES}{hint}"
    )


def encode(value: Any) -> bytes:
    """The wire form of ``value``: canonical JSON (sorted keys, compact, ASCII) as bytes.

    ``nan`` and ``±inf`` are allowed (as JSON's common ``NaN``/``Infinity``
    extension) because metrics legitimately take them; the text is therefore read
    back by :func:`decode`, not by strict JSON parsers. Raises :class:`TypeError`
    naming the offending part of ``value`` if it is not JSON-able (dict keys must be
    ``str``: JSON would silently turn ``1`` into ``"1"``).
    """
    _check_jsonable(value, "value", set())
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return text.encode("ascii")


def decode(data: bytes) -> Any:
    """The value whose :func:`encode` is ``data``; raises ValueError for bad data."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TypeError(f"data must be bytes, got {type(data).__name__}")
    try:
        return json.loads(bytes(data).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"collective data is not valid encoded JSON: {exc}") from exc
    except RecursionError:
        # Deeply nested arrays (crafted, or damage) exhaust the parser's stack.
        raise ValueError("collective data is not valid encoded JSON: nested too deeply") from None


_SCALARS = (bool, int, float, type(None))


def wire_copy(value: T) -> T:
    """``value`` as it arrives after travelling: ``decode(encode(value))``.

    Raises TypeError like :func:`encode` for a value that cannot travel. Scalars and
    flat lists of them (the flags reduced at every step) skip the JSON round trip,
    which would give back an equal value; tuples still arrive as lists.
    """
    if type(value) in _SCALARS:
        return value
    if isinstance(value, (list, tuple)) and all(type(v) in _SCALARS for v in value):
        flat: T = list(value)  # type: ignore[assignment]
        return flat
    result: T = decode(encode(value))
    return result


def fold(values: list[T], op: Callable[[T, T], T]) -> T:
    """``op(op(values[0], values[1]), values[2]) ...``: a reduction in rank order."""
    result = values[0]
    for value in values[1:]:
        result = op(result, value)
    return result


# --------------------------------------------------------------------------- reductions


def _combine(name: str, scalar: Callable[[Any, Any], Any], a: Any, b: Any) -> Any:
    if a is None:
        return b
    if b is None:
        return a
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            raise ValueError(
                f"{name}: lists of different lengths {len(a)} and {len(b)} cannot be combined"
            )
        return [_combine(name, scalar, x, y) for x, y in zip(a, b, strict=True)]
    if isinstance(a, dict) and isinstance(b, dict):
        merged = dict(a)
        for key, value in b.items():
            merged[key] = _combine(name, scalar, merged[key], value) if key in a else value
        return merged
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return scalar(a, b)
    raise TypeError(
        f"{name}: cannot combine {a!r} ({type(a).__name__}) with {b!r} ({type(b).__name__})"
    )


def add(a: Any, b: Any) -> Any:
    """Sum of two values: numbers add, lists elementwise, dicts key-wise; ``None`` is zero.

    Lists (and tuples) must have the same length, else ValueError; dicts combine as
    the union of their keys, adding values under common keys. Booleans count as
    integers. Any other combination raises TypeError.
    """
    return _combine("add", lambda x, y: x + y, a, b)


def logical_or(a: Any, b: Any) -> Any:
    """``bool(a) or bool(b)`` for scalars, elementwise/key-wise like :func:`add`."""
    return _combine("logical_or", lambda x, y: bool(x) or bool(y), a, b)


def _max(x: Any, y: Any) -> Any:
    # nan wins, whatever its position, so the result does not depend on rank order.
    if isinstance(x, float) and math.isnan(x):
        return x
    if isinstance(y, float) and math.isnan(y):
        return y
    return y if y > x else x


def maximum(a: Any, b: Any) -> Any:
    """The larger of two numbers (``nan`` if either is), elementwise/key-wise like :func:`add`."""
    return _combine("maximum", _max, a, b)


# --------------------------------------------------------------------------- protocols


class Future(Protocol[T_co]):
    """The pending result of an asynchronous collective."""

    def result(self) -> T_co:
        """Wait for and return the result (the same object on every call)."""
        ...


class Collective(Protocol):
    """Collective operations over the replicas of one job; see the module docstring."""

    @property
    def rank(self) -> int:
        """This replica's rank, in ``[0, num_replicas)``."""
        ...

    @property
    def num_replicas(self) -> int:
        """The number of replicas in the group."""
        ...

    def broadcast(self, value: T, root: int = 0) -> T:
        """Replica ``root``'s ``value`` on every replica (other replicas' values are ignored)."""
        ...

    def allreduce(self, value: T, op: Callable[[T, T], T] = add) -> T:
        """The rank-order fold of every replica's ``value`` with ``op``."""
        ...

    def allreduce_async(self, value: T, op: Callable[[T, T], T] = add) -> Future[T]:
        """Like :meth:`allreduce`, but returns at once; ``.result()`` waits for peers."""
        ...

    def allgather(self, value: T) -> list[T]:
        """Every replica's ``value``, in rank order."""
        ...

    def barrier(self) -> None:
        """Return once every replica has called barrier."""
        ...


@attrs.frozen
class Ready:
    """A future whose value is already known."""

    value: Any

    def result(self) -> Any:
        return self.value


class Deferred:
    """A future computed by ``compute`` when first asked, then the same object every time."""

    def __init__(self, compute: Callable[[], Any]) -> None:
        self._compute: Callable[[], Any] | None = compute
        self._value: Any = None

    def result(self) -> Any:
        if self._compute is not None:
            self._value = self._compute()
            self._compute = None
        return self._value


class GroupMember:
    """One replica's place in a collective group; implementations of `Collective` extend it."""

    def __init__(self, rank: int, num_replicas: int) -> None:
        self._num_replicas = check_int("num_replicas", num_replicas, min=1)
        self._rank = check_int("rank", rank, min=0, max=self._num_replicas - 1)

    @property
    def rank(self) -> int:
        """This replica's rank, in ``[0, num_replicas)``."""
        return self._rank

    @property
    def num_replicas(self) -> int:
        """The size of the group."""
        return self._num_replicas


def check_root(root: int, num_replicas: int) -> int:
    """``root`` if it is a rank of a group of ``num_replicas``; else ValueError/TypeError."""
    return check_int("root", root, min=0, max=num_replicas - 1)


# --------------------------------------------------------------------------- local


class LocalCollective(GroupMember):
    """The collective of a job with one replica: every operation returns a copy of its input.

    Values still go through :func:`encode`/:func:`decode`, so callers cannot alias
    them and a value that could not travel fails here as it would on many replicas.
    """

    #: Every operation completes in this process, at once (no peer, nothing in flight):
    #: the job then skips the futures of its per-step reduction.
    in_process = True

    def __init__(self) -> None:
        super().__init__(0, 1)

    def broadcast(self, value: T, root: int = 0) -> T:
        """A copy of ``value``; ``root`` must be 0."""
        check_root(root, 1)
        return wire_copy(value)

    def allreduce(self, value: T, op: Callable[[T, T], T] = add) -> T:
        """A copy of ``value`` (a fold of one value never calls ``op``)."""
        return wire_copy(value)

    def allreduce_async(self, value: T, op: Callable[[T, T], T] = add) -> Future[T]:
        """A resolved future holding a copy of ``value``."""
        return Ready(wire_copy(value))

    def allgather(self, value: T) -> list[T]:
        """``[copy of value]``."""
        return [wire_copy(value)]

    def barrier(self) -> None:
        """Returns at once."""
