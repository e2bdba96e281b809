"""Several replicas of one job as threads of one process: the tests' collective.

`ThreadCollective` is a `adaptdl.core.collective.Collective` whose replicas are
threads, every value crossing as encoded bytes like the torch implementation's;
`run_replicas` runs a function on each replica of a new group. Core's own tests
and the simulator-free multi-replica tests drive core's state machines with it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, TypeVar

import attrs

from adaptdl.core.collective import (
    CollectiveAborted,
    CollectiveError,
    CollectiveMismatch,
    CollectiveTimeout,
    Deferred,
    Future,
    GroupMember,
    add,
    check_root,
    decode,
    encode,
    fold,
)
from adaptdl.core.validate import check_float, check_int

T = TypeVar("T")
R = TypeVar("R")

__all__ = ["ThreadCollective", "run_replicas"]


@attrs.define
class _Round:
    """One collective call, shared by all replicas: who has arrived and with what."""

    kind: str
    payloads: list[bytes | None]
    arrived: list[bool]
    reads: int = 0


class _Exchange:
    """The meeting point of a thread group: rounds keyed by call sequence number."""

    def __init__(self, num_replicas: int, timeout: float) -> None:
        self.num_replicas = num_replicas
        self.timeout = timeout
        self.cond = threading.Condition()
        self.rounds: dict[int, _Round] = {}
        self.aborted: CollectiveError | None = None

    def _raise_aborted(self) -> None:
        # A fresh exception per replica: one object raised in several threads would
        # share (and garble) its traceback.
        assert self.aborted is not None
        raise type(self.aborted)(*self.aborted.args)

    def abort(self, error: CollectiveError) -> None:
        with self.cond:
            if self.aborted is None:
                self.aborted = error
            self.cond.notify_all()

    def deposit(self, seq: int, rank: int, kind: str, payload: bytes | None) -> None:
        """Record ``rank``'s arrival at call ``seq``; never waits."""
        with self.cond:
            if self.aborted is not None:
                self._raise_aborted()
            rnd = self.rounds.get(seq)
            if rnd is None:
                rnd = _Round(kind, [None] * self.num_replicas, [False] * self.num_replicas)
                self.rounds[seq] = rnd
            elif rnd.kind != kind:
                others = [r for r, a in enumerate(rnd.arrived) if a]
                error = CollectiveMismatch(
                    f"collective call #{seq}: replica {rank} called {kind} but replicas "
                    f"{others} called {rnd.kind}; every replica must call the same "
                    f"collectives in the same order"
                )
                self.aborted = error
                self.cond.notify_all()
                raise error
            rnd.payloads[rank] = payload
            rnd.arrived[rank] = True
            self.cond.notify_all()

    def collect(self, seq: int, rank: int) -> list[bytes | None]:
        """Wait until every replica has arrived at call ``seq``; return their payloads."""
        with self.cond:
            rnd = self.rounds[seq]
            done = self.cond.wait_for(
                lambda: self.aborted is not None or all(rnd.arrived), timeout=self.timeout
            )
            if self.aborted is not None:
                self._raise_aborted()
            if not done:
                missing = [r for r, a in enumerate(rnd.arrived) if not a]
                raise CollectiveTimeout(
                    f"collective call #{seq} ({rnd.kind}) on replica {rank}: replicas "
                    f"{missing} did not join within {self.timeout:g} s (a peer has gone "
                    f"or called the collectives in another order)"
                )
            rnd.reads += 1
            if rnd.reads == self.num_replicas:
                del self.rounds[seq]
            return list(rnd.payloads)


def _op_name(op: Callable[..., Any]) -> str:
    return str(getattr(op, "__qualname__", type(op).__name__))


class ThreadCollective(GroupMember):
    """One replica of an in-process group whose replicas are threads.

    Create a group with :meth:`group`; use each member from its own thread only.
    Every value crosses as :func:`encode`'d bytes, like the torch implementation.
    An operation waits at most ``timeout`` seconds for the other replicas, then
    raises :class:`CollectiveTimeout`; replicas calling different operations at the
    same position raise :class:`CollectiveMismatch`; after :meth:`abort` every
    operation of the group raises :class:`CollectiveAborted`.
    """

    def __init__(self, exchange: _Exchange, rank: int) -> None:
        """Internal: use :meth:`group`."""
        super().__init__(rank, exchange.num_replicas)
        self._exchange = exchange
        self._seq = 0

    @classmethod
    def group(cls, num_replicas: int, timeout: float = 60.0) -> list[ThreadCollective]:
        """``num_replicas`` connected replicas, in rank order."""
        num_replicas = check_int("num_replicas", num_replicas, min=1)
        timeout = check_float("timeout", timeout, min=0.0, min_exclusive=True)
        exchange = _Exchange(num_replicas, timeout)
        return [cls(exchange, rank) for rank in range(num_replicas)]

    def abort(self, reason: str) -> None:
        """Make every pending and future operation of the whole group raise CollectiveAborted."""
        self._exchange.abort(CollectiveAborted(f"collective group aborted: {reason}"))

    def _next(self, kind: str, payload: bytes | None) -> int:
        seq = self._seq
        self._exchange.deposit(seq, self._rank, kind, payload)
        self._seq += 1
        return seq

    def broadcast(self, value: T, root: int = 0) -> T:
        """Replica ``root``'s ``value`` on every replica."""
        root = check_root(root, self.num_replicas)
        payload = encode(value) if self._rank == root else None
        seq = self._next(f"broadcast(root={root})", payload)
        data = self._exchange.collect(seq, self._rank)[root]
        assert data is not None
        result: T = decode(data)
        return result

    def allreduce(self, value: T, op: Callable[[T, T], T] = add) -> T:
        """The rank-order fold of every replica's ``value`` with ``op``."""
        result: T = self.allreduce_async(value, op).result()
        return result

    def allreduce_async(self, value: T, op: Callable[[T, T], T] = add) -> Future[T]:
        """Deposit ``value`` without waiting; ``.result()`` waits for the peers and folds."""
        payload = encode(value)
        seq = self._next(f"allreduce({_op_name(op)})", payload)

        def reduce() -> T:
            payloads = self._exchange.collect(seq, self._rank)
            values: list[T] = [decode(p) for p in payloads if p is not None]
            return fold(values, op)

        return Deferred(reduce)

    def allgather(self, value: T) -> list[T]:
        """Every replica's ``value``, in rank order."""
        seq = self._next("allgather", encode(value))
        return [decode(p) for p in self._exchange.collect(seq, self._rank) if p is not None]

    def barrier(self) -> None:
        """Return once every replica has called barrier."""
        seq = self._next("barrier", None)
        self._exchange.collect(seq, self._rank)


def run_replicas(
    num_replicas: int, fn: Callable[[ThreadCollective], R], timeout: float = 60.0
) -> list[R]:
    """Run ``fn`` on each replica of a new :class:`ThreadCollective` group, one thread each.

    Returns the results in rank order. If any replica raises, the group is aborted
    (so its peers stop waiting at once) and the first exception that was not caused
    by the abort is re-raised.
    """
    group = ThreadCollective.group(num_replicas, timeout)
    results: list[Any] = [None] * num_replicas
    errors: list[tuple[int, BaseException]] = []
    lock = threading.Lock()

    def main(replica: ThreadCollective) -> None:
        try:
            results[replica.rank] = fn(replica)
        except BaseException as exc:
            with lock:
                errors.append((replica.rank, exc))
            replica.abort(f"replica {replica.rank} raised {exc!r}")

    threads = [
        threading.Thread(target=main, args=(replica,), name=f"replica-{replica.rank}", daemon=True)
        for replica in group
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        primary = [exc for _, exc in errors if not isinstance(exc, CollectiveAborted)]
        raise (primary or [exc for _, exc in errors])[0]
    return results
