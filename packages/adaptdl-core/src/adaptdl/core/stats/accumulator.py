"""Replay-safe sums of metrics across replicas and restarts: the core of ``Accumulator``.

An :class:`Accumulator` is a dict-like object with two modes.

*Accumulation mode* (the default, outside ``with acc.synchronized():``): each
replica adds its own contributions, ``acc["loss"] += loss``,
``acc.update(loss=loss, n=1)`` (``update`` adds, unlike ``dict.update``) or
``acc += {"loss": loss, "n": 1}`` (``-=`` and ``subtract`` subtract). They stay
local and pending. In this mode the accumulator reads as an empty mapping:
``len`` is 0, ``in`` is False, iteration yields nothing, ``get`` returns its
default, ``pop(k)`` and ``popitem()`` raise KeyError. ``acc["loss"]`` returns an
opaque handle that only supports ``+=`` and ``-=``; any other use of it raises
:class:`RuntimeError` pointing to ``synchronized()``. ``acc[k] = v`` replaces
this replica's pending contribution to ``k``; ``del acc[k]`` and ``acc.clear()``
drop pending contributions; ``setdefault`` raises RuntimeError.

*Synchronized mode* (inside ``with acc.synchronized():``): on entry, every
replica's pending contributions are summed (:func:`adaptdl.core.collective.add`,
folded in rank order) and added to the synchronized totals, which every replica
then sees identically; inside, the accumulator is an ordinary dict of those totals
(reads, writes, ``clear()``: the program must make the same writes on every
replica). Entering is a collective: every replica must enter at the same points.
Nesting is an error.

Replay. After a restart the program runs again from the top; finished epochs and
finished loops are skipped, so the code that re-runs is the code of the
interrupted epoch that lies outside dataloader loops (and any code outside epoch
loops). Each ``synchronized()`` entered outside a loop records the totals it
showed, keyed by epoch, in the state saved with checkpoints. After a restart, the
first ``len(history[epoch])`` entries outside loops in that epoch replay the
recorded totals in order without communicating: the program sees exactly what it
saw before, whatever the new number of replicas. Entries inside a loop are always
live (the iterations before the checkpoint never re-run). Writes inside a
replayed block go to a copy and are discarded, because the restored totals
already hold their effect; likewise pending contributions are dropped at a
replayed entry and, while the position says the program is ``replaying``, as
they are made (they are re-executions of contributions the restored totals
already hold; the job says ``replaying`` from the restore until the loop that
was interrupted resumes).

The history is bounded: entries of epochs before the current one are dropped
(finished epochs never re-run), and entries inside loops are never recorded. Only
code outside epoch loops keeps adding to the ``None`` epoch, once per call.

Where the position (epoch, in a loop, replaying) comes from is the job's business:
pass ``position``; without it the accumulator is always at ``ReplayPosition()``
(one epoch ``None``, outside loops, not replaying): every entry is recorded and
the first entries after a restart replay, as for a program without epochs; the
history then grows by one entry per ``synchronized()``, and contributions made
after the last replayed entry are counted again (no ``replaying`` signal).

Checkpoints: pending contributions live on each replica, so before a checkpoint
every replica must call :meth:`Accumulator.sync` (a collective that folds them
into the totals without recording history); :meth:`Accumulator.to_bytes` refuses
to drop pending contributions silently.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator, Mapping, MutableMapping
from typing import Any, NoReturn

import attrs

from adaptdl.core.collective import Collective, add, decode, encode
from adaptdl.core.persist.checkpoint import CheckpointError

__all__ = ["Accumulator", "ReplayPosition"]

_FORMAT = 1


@attrs.frozen
class ReplayPosition:
    """Where the program is, as far as replay is concerned.

    ``epoch``: the epoch running now (None outside epoch loops); ``in_loop``: a
    dataloader loop is being iterated; ``replaying``: the program is re-running
    code that ran before the restart (a checkpoint was restored and the loop it was
    taken in has not resumed yet).
    """

    epoch: int | None = attrs.field(default=None)
    in_loop: bool = attrs.field(default=False, validator=attrs.validators.instance_of(bool))
    replaying: bool = attrs.field(default=False, validator=attrs.validators.instance_of(bool))

    @epoch.validator
    def _check_epoch(self, attribute: attrs.Attribute[int | None], value: Any) -> None:
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise TypeError(f"epoch must be an int or None, got {value!r}")
        if value is not None and value < 0:
            raise ValueError(f"epoch must be >= 0, got {value!r}")


_OUTSIDE = (
    "outside `with accumulator.synchronized():` an accumulator can only be updated "
    "(acc[key] += value, acc[key] -= value, acc.update(...)); read it inside the "
    "synchronized block, where every replica sees the summed totals"
)


def _copy(value: Any, what: str) -> Any:
    """A private copy of a value that must travel between replicas (TypeError if it cannot)."""
    if value is None or (type(value) in (int, float)):
        return value
    try:
        return decode(encode(value))
    except TypeError as exc:
        raise TypeError(f"{what}: {exc}") from None


def _negate(value: Any) -> Any:
    if value is None:
        return None
    if isinstance(value, (int, float)):
        return -value
    if isinstance(value, (list, tuple)):
        return [_negate(v) for v in value]
    if isinstance(value, dict):
        return {k: _negate(v) for k, v in value.items()}
    raise TypeError(f"cannot subtract {value!r} ({type(value).__name__})")


def _check_key(key: Any) -> str:
    if not isinstance(key, str):
        raise TypeError(f"accumulator keys must be str, got {key!r} ({type(key).__name__})")
    return key


class _Update:
    """What ``acc[key]`` is outside synchronized(): a handle that only supports += and -=."""

    __slots__ = ("_acc", "_delta", "_key")

    def __init__(self, acc: Accumulator, key: str, delta: Any = None) -> None:
        self._acc = acc
        self._key = key
        self._delta = delta

    def __iadd__(self, value: Any) -> _Update:  # type: ignore[misc]
        value = _copy(value, f"accumulator[{self._key!r}] += {value!r}")
        return _Update(self._acc, self._key, add(self._delta, value))

    def __isub__(self, value: Any) -> _Update:  # type: ignore[misc]
        value = _copy(value, f"accumulator[{self._key!r}] -= {value!r}")
        return _Update(self._acc, self._key, add(self._delta, _negate(value)))

    def _refuse(self, *args: Any) -> NoReturn:
        raise RuntimeError(f"accumulator[{self._key!r}] cannot be read here: {_OUTSIDE}")

    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = _refuse
    __truediv__ = __rtruediv__ = __floordiv__ = __rfloordiv__ = __mod__ = __pow__ = _refuse
    __neg__ = __pos__ = __abs__ = __round__ = __imul__ = __itruediv__ = _refuse
    __float__ = __int__ = __index__ = __bool__ = __len__ = __iter__ = _refuse
    __lt__ = __le__ = __gt__ = __ge__ = __getitem__ = __contains__ = _refuse
    __eq__ = __ne__ = _refuse
    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"<pending update of accumulator[{self._key!r}]: read it inside synchronized()>"


class Accumulator(MutableMapping[str, Any]):
    """Metric sums across replicas and restarts; see the module docstring for the semantics.

    ``initial`` gives the synchronized totals of a fresh accumulator. ``name`` is
    the checkpoint entry name (unique within a job). ``position`` says where the
    program is for replay (see :class:`ReplayPosition`).
    """

    def __init__(
        self,
        collective: Collective,
        name: str = "adaptdl-accumulator",
        initial: Mapping[str, Any] | None = None,
        *,
        position: Callable[[], ReplayPosition] | None = None,
    ) -> None:
        if not isinstance(name, str) or not name:
            raise TypeError(f"name must be a non-empty str, got {name!r}")
        self._name = name
        self._collective = collective
        self._position = position or ReplayPosition
        self._results: dict[str, Any] = self._check_totals("initial", initial or {})
        self._pending: dict[str, Any] = {}
        # epoch -> totals seen at each recorded synchronized() entry of that epoch.
        self._history: dict[int | None, list[dict[str, Any]]] = {}
        # epoch -> synchronized() entries in this process so far; not saved, because a
        # restarted process begins again from the first entry.
        self._calls: dict[int | None, int] = {}
        self._view: dict[str, Any] | None = None

    @staticmethod
    def _check_totals(what: str, totals: Mapping[str, Any]) -> dict[str, Any]:
        if not isinstance(totals, Mapping):
            raise TypeError(f"{what} must be a mapping, got {type(totals).__name__}")
        for key in totals:
            _check_key(key)
        copied: dict[str, Any] = _copy(dict(totals), what)
        return copied

    # ---- State

    @property
    def name(self) -> str:
        """The checkpoint entry name."""
        return self._name

    def to_bytes(self) -> bytes:
        """The synchronized totals and the replay history as canonical JSON.

        Raises RuntimeError if this replica has pending contributions: call
        :meth:`sync` on every replica first, or they would be lost.
        """
        if self._pending:
            raise RuntimeError(
                f"accumulator {self._name!r} has pending updates {sorted(self._pending)}: "
                f"call sync() on every replica before saving it"
            )
        return encode(
            {
                "format": _FORMAT,
                "results": self._results,
                "history": [[epoch, entries] for epoch, entries in self._history.items()],
            }
        )

    def from_bytes(self, data: bytes) -> None:
        """Restore totals and history; the next synchronized() entries replay from the start."""
        try:
            state = decode(data)
            if not isinstance(state, dict) or state.get("format") != _FORMAT:
                raise ValueError(f"unknown accumulator state format {state!r:.60}")
            results = state["results"]
            history: dict[int | None, list[dict[str, Any]]] = {}
            for epoch, entries in state["history"]:
                if epoch is not None and (isinstance(epoch, bool) or not isinstance(epoch, int)):
                    raise ValueError(f"bad epoch {epoch!r}")
                if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
                    raise ValueError(f"bad history of epoch {epoch!r}")
                history[epoch] = entries
            if not isinstance(results, dict):
                raise ValueError("results is not an object")
        except (ValueError, KeyError, TypeError) as exc:
            raise CheckpointError(f"state {self._name!r}: bad accumulator state ({exc})") from exc
        self._results = results
        self._history = history
        self._pending = {}
        self._calls = {}
        self._view = None

    def sync(self) -> None:
        """Collective: fold every replica's pending contributions into the totals.

        Records no history and does not count as a synchronized() entry. The job
        calls it on every replica before a checkpoint.
        """
        if self._view is not None:
            raise RuntimeError(f"accumulator {self._name!r}: sync() inside synchronized()")
        self._fold(self._collective.allreduce(self._pending, add))

    def _fold(self, reduced: Mapping[str, Any]) -> None:
        for key, value in reduced.items():
            self._results[key] = add(self._results.get(key), value)
        self._pending = {}

    # ---- synchronized mode

    @contextlib.contextmanager
    def synchronized(self) -> Iterator[Accumulator]:
        """Enter synchronized mode (a collective, unless replayed); see the module docstring."""
        if self._view is not None:
            raise RuntimeError(
                f"accumulator {self._name!r}: synchronized() blocks cannot be nested"
            )
        position = self._position()
        epoch = position.epoch
        if epoch is not None:
            for old in [e for e in self._history if e is not None and e < epoch]:
                del self._history[old]
            for old in [e for e in self._calls if e is not None and e < epoch]:
                del self._calls[old]
        if position.in_loop:
            # Loop iterations that ran before a restart never run again: nothing to
            # record or replay, and in-loop entries do not count among the replayable.
            self._fold(self._collective.allreduce(self._pending, add))
            self._view = self._results
        else:
            count = self._calls.get(epoch, 0)
            self._calls[epoch] = count + 1
            recorded = self._history.get(epoch, [])
            if count < len(recorded):
                # Replayed: the restored totals already hold everything done up to the
                # checkpoint, so this block sees (and may scribble on) a copy of the past.
                self._pending = {}
                self._view = copy.deepcopy(recorded[count])
            else:
                self._fold(self._collective.allreduce(self._pending, add))
                self._history.setdefault(epoch, []).append(copy.deepcopy(self._results))
                self._view = self._results
        try:
            yield self
        finally:
            self._view = None

    @property
    def is_synchronized(self) -> bool:
        """Whether the accumulator is inside a synchronized() block."""
        return self._view is not None

    def _synced(self, what: str) -> dict[str, Any]:
        if self._view is None:
            raise RuntimeError(f"accumulator {self._name!r}: {what} is not allowed {_OUTSIDE}")
        return self._view

    # ---- mapping interface

    def __getitem__(self, key: str) -> Any:
        """Inside synchronized(): the total. Outside: a handle for ``+=``/``-=`` only."""
        _check_key(key)
        if self._view is not None:
            return self._view[key]
        return _Update(self, key)

    def __setitem__(self, key: str, value: Any) -> None:
        """Inside synchronized(): set the total. Outside: set this replica's contribution."""
        _check_key(key)
        if isinstance(value, _Update):
            if value._acc is not self or value._key != key:
                raise ValueError(
                    f"accumulator[{key!r}] cannot be assigned an update of "
                    f"{'another accumulator' if value._acc is not self else repr(value._key)}"
                )
            if self._view is not None:
                raise RuntimeError(
                    f"accumulator[{key!r}]: an update made outside "
                    f"synchronized() cannot be applied inside it"
                )
            self._contribute(key, value._delta, replace=False)
            return
        value = _copy(value, f"accumulator[{key!r}] = {value!r}")
        if self._view is not None:
            self._view[key] = value
        else:
            self._contribute(key, value, replace=True)

    def _contribute(self, key: str, value: Any, *, replace: bool) -> None:
        if self._position().replaying:
            return  # a re-execution: the restored totals already hold it
        if replace:
            self._pending[key] = value
        elif value is not None:
            self._pending[key] = add(self._pending.get(key), value)

    def __delitem__(self, key: str) -> None:
        """Inside synchronized(): delete the total. Outside: drop this replica's contribution."""
        _check_key(key)
        if self._view is not None:
            del self._view[key]
        else:
            self._pending.pop(key, None)

    def clear(self) -> None:
        """Inside synchronized(): delete every total. Outside: drop pending contributions."""
        if self._view is not None:
            self._view.clear()
        else:
            self._pending.clear()

    def update(self, other: Any = None, /, **kwargs: Any) -> None:
        """Add (not set) each value to its key's total or contribution, like ``acc[k] += v``.

        ``other`` is a mapping or an iterable of (key, value) pairs, as for ``dict``.
        """
        self._add(dict(other or {}, **kwargs), "update", negate=False)

    def subtract(self, other: Any = None, /, **kwargs: Any) -> None:
        """Subtract each value from its key's total or contribution, like ``acc[k] -= v``."""
        self._add(dict(other or {}, **kwargs), "subtract", negate=True)

    def __iadd__(self, other: Any) -> Accumulator:
        """``acc += {"a": 1, "b": 2}``: the same as ``acc.update(...)``."""
        self._add(self._operand(other, "+="), "+=", negate=False)
        return self

    def __isub__(self, other: Any) -> Accumulator:
        """``acc -= {"a": 1, "b": 2}``: the same as ``acc.subtract(...)``."""
        self._add(self._operand(other, "-="), "-=", negate=True)
        return self

    @staticmethod
    def _operand(other: Any, op: str) -> dict[str, Any]:
        if isinstance(other, Mapping):
            return dict(other)
        try:
            return dict(other)
        except (TypeError, ValueError):
            raise TypeError(
                f"accumulator {op} takes a mapping or (key, value) pairs, "
                f"got {other!r} ({type(other).__name__})"
            ) from None

    def _add(self, items: dict[str, Any], what: str, *, negate: bool) -> None:
        for key, value in items.items():
            _check_key(key)
            value = _copy(value, f"accumulator.{what}({key}={value!r})")
            if negate:
                value = _negate(value)
            if self._view is not None:
                self._view[key] = add(self._view.get(key), value)
            else:
                self._contribute(key, value, replace=False)

    def _read(self) -> dict[str, Any]:
        """What reads see: the totals inside synchronized(), an empty mapping outside."""
        return self._view if self._view is not None else {}

    def pop(self, key: str, *default: Any) -> Any:
        """Inside synchronized(): remove and return the total (``dict.pop``); outside,
        as on an empty dict."""
        return self._read().pop(_check_key(key), *default)

    def popitem(self) -> tuple[str, Any]:
        """Inside synchronized(): remove and return a (key, total) pair; outside, KeyError."""
        return self._read().popitem()

    def setdefault(self, key: str, default: Any = None) -> Any:
        """Inside synchronized(): ``dict.setdefault`` on the totals."""
        view = self._synced("setdefault()")
        if _check_key(key) not in view:
            view[key] = _copy(default, f"accumulator.setdefault({key!r}, {default!r})")
        return view[key]

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._read()))

    def __len__(self) -> int:
        return len(self._read())

    def __contains__(self, key: object) -> bool:
        return key in self._read()

    def get(self, key: str, default: Any = None) -> Any:
        """Inside synchronized(): the total or ``default``; outside, ``default``."""
        return self._read().get(_check_key(key), default)

    def __eq__(self, other: object) -> bool:
        return dict(self._read()) == other

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        if self._view is not None:
            return f"Accumulator({self._name!r}, synchronized={self._view!r})"
        return f"Accumulator({self._name!r}, pending={self._pending!r})"
