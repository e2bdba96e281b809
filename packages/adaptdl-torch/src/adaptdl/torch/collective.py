"""Core's `Collective` over ``torch.distributed``: small values as JSON bytes in uint8 tensors.

Every value travels as core :func:`~adaptdl.core.collective.encode` bytes (never
pickled). One round moves a fixed-size slot per replica: an 8-byte length and the
first bytes of the payload. A value that does not fit in the slot is sent whole in a
second round whose size every replica knows from the first, so small values (flags,
batch sizes, metric sums) cost one round trip and large ones two.

One value travels another way: a flat list of ints reduced by core's `maximum` (the
job's flags at each agreement, `Job.step_boundary`) is one ``all_reduce(MAX)`` of an
int64 tensor, no JSON, the same result as the fold. Every replica of the call must
pass that kind of value (the ordering contract already asks for the same operation).

The group should be a gloo group (CPU tensors). Its timeout bounds every operation:
a peer that died or hangs makes the survivors raise `CollectiveTimeout` instead of
waiting forever. Each operation returns only once gloo's worker thread has let go of
its tensors (`adaptdl.torch._release`), so a program may end right after one.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar, cast

import torch
import torch.distributed as dist
from adaptdl.core.collective import (
    CollectiveError,
    CollectiveTimeout,
    Deferred,
    Future,
    GroupMember,
    LocalCollective,
    add,
    check_root,
    decode,
    encode,
    fold,
    maximum,
)
from adaptdl.core.config import COLLECTIVE_TIMEOUT_VAR, DEFAULT_COLLECTIVE_TIMEOUT, JobConfig
from adaptdl.torch._release import holders, wait_released

__all__ = ["DEFAULT_TIMEOUT", "TIMEOUT_VAR", "TorchCollective", "collective_timeout"]

LOG = logging.getLogger("adaptdl.torch.collective")
T = TypeVar("T")

TIMEOUT_VAR = COLLECTIVE_TIMEOUT_VAR
DEFAULT_TIMEOUT = DEFAULT_COLLECTIVE_TIMEOUT
_HEADER = 8
_SLOT = 256  # bytes per replica in the first round; holds every flag and metric sum


def collective_timeout(config: JobConfig) -> timedelta:
    """How long ``config``'s collectives wait for a peer, as torch takes it.

    A running job's is its `Job.config` (``ADAPTDL_COLLECTIVE_TIMEOUT`` seconds,
    default 300, read once at start, or the ``timeout`` given to
    `adaptdl.torch.init_process_group`); before there is a job,
    ``JobConfig.from_env()``'s.
    """
    if not isinstance(config, JobConfig):
        raise TypeError(f"config must be a JobConfig, got {config!r}")
    return timedelta(seconds=config.collective_timeout)


def _pack(payload: bytes) -> torch.Tensor:
    slot = bytearray(_SLOT)
    slot[:_HEADER] = len(payload).to_bytes(_HEADER, "little")
    head = payload[: _SLOT - _HEADER]
    slot[_HEADER : _HEADER + len(head)] = head
    return torch.frombuffer(slot, dtype=torch.uint8).clone()


def _length(slot: torch.Tensor) -> int:
    return int.from_bytes(slot[:_HEADER].numpy().tobytes(), "little")


def _fits(length: int) -> bool:
    return length <= _SLOT - _HEADER


def _translate(collective: TorchCollective, exc: Exception, what: str) -> BaseException:
    """The error to raise for ``exc``: a `CollectiveError`, unless ``collective.failed``
    makes it something else (a replica that is stopping exits instead)."""
    message = f"{what} over torch.distributed failed: {exc}"
    error: CollectiveError
    if "timeout" in str(exc).lower() or "timed out" in str(exc).lower():
        error = CollectiveTimeout(
            f"{message} (a peer replica did not join in time; raise {TIMEOUT_VAR} if "
            "replicas legitimately take longer between steps)"
        )
    else:
        error = CollectiveError(message)
    return collective.failed(error)


class _Gathered:
    """The pending first round of an allgather; `values` finishes it."""

    def __init__(self, collective: TorchCollective, payload: bytes, async_op: bool) -> None:
        self._collective = collective
        self._payload = payload
        n = collective.num_replicas
        self._slots = [torch.empty(_SLOT, dtype=torch.uint8) for _ in range(n)]
        self._tensors = [*self._slots, _pack(payload)]
        self._before = holders(self._tensors)
        try:
            self._work = dist.all_gather(
                self._slots, self._tensors[-1], group=collective.group, async_op=async_op
            )
        except RuntimeError as exc:
            raise _translate(self._collective, exc, "allgather") from exc

    def values(self) -> list[Any]:
        try:
            if self._work is not None:
                self._work.wait()
                self._work = None
            wait_released(self._tensors, self._before)
            lengths = [_length(slot) for slot in self._slots]
            if all(_fits(length) for length in lengths):
                return [
                    decode(slot[_HEADER : _HEADER + length].numpy().tobytes())
                    for slot, length in zip(self._slots, lengths, strict=True)
                ]
            # Some value is larger than a slot: everyone sends its whole payload.
            size = max(lengths)
            buffer = bytearray(size)
            buffer[: len(self._payload)] = self._payload
            full = [torch.empty(size, dtype=torch.uint8) for _ in lengths]
            tensors = [*full, torch.frombuffer(buffer, dtype=torch.uint8)]
            before = holders(tensors)
            dist.all_gather(full, tensors[-1], group=self._collective.group)
            wait_released(tensors, before)
        except RuntimeError as exc:
            raise _translate(self._collective, exc, "allgather") from exc
        return [
            decode(bytes(t[:length].numpy().tobytes()))
            for t, length in zip(full, lengths, strict=True)
        ]


_INT64 = (-(2**63), 2**63 - 1)


def _int_list(value: Any) -> bool:
    """Whether ``value`` is a flat list of ints that an int64 tensor holds exactly."""
    return isinstance(value, list) and all(
        type(v) is int and _INT64[0] <= v <= _INT64[1] for v in value
    )


class _IntMaximum:
    """A pending elementwise maximum of int lists as one int64 ``all_reduce``."""

    def __init__(self, collective: TorchCollective, values: list[int]) -> None:
        self._collective = collective
        self._tensor = torch.tensor(values, dtype=torch.int64)
        self._before = holders([self._tensor])
        try:
            self._work = dist.all_reduce(
                self._tensor, op=dist.ReduceOp.MAX, group=collective.group, async_op=True
            )
        except RuntimeError as exc:
            raise _translate(collective, exc, "allreduce") from exc

    def result(self) -> list[int]:
        try:
            if self._work is not None:
                self._work.wait()
                self._work = None
            wait_released([self._tensor], self._before)
        except RuntimeError as exc:
            raise _translate(self._collective, exc, "allreduce") from exc
        values: list[int] = self._tensor.tolist()
        return values


class TorchCollective(GroupMember):
    """A core `Collective` over a ``torch.distributed`` process group (gloo, CPU tensors).

    Every replica must call the operations in the same order (core's ordering
    contract); reductions fold in rank order, so results are identical everywhere.
    """

    def __init__(self, group: Any = None) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "TorchCollective needs an initialised torch.distributed process group: "
                "call adaptdl.torch.init_process_group() first"
            )
        super().__init__(dist.get_rank(group), dist.get_world_size(group))
        self.group = group
        # One replica has nothing to exchange: core's one-replica collective, same wire format.
        self._local = LocalCollective() if self._num_replicas == 1 else None
        # As `LocalCollective.in_process`: one replica reduces in this process, at once.
        self.in_process = self._local is not None
        #: What a failed operation raises instead of its `CollectiveError` (the job's
        #: `Job.collective_failed`, once there is a job).
        self.failed: Callable[[CollectiveError], BaseException] = lambda error: error

    def broadcast(self, value: T, root: int = 0) -> T:
        """Replica ``root``'s ``value`` on every replica."""
        check_root(root, self._num_replicas)
        if self._local is not None:
            return self._local.broadcast(value, root)
        payload = encode(value) if self._rank == root else b""
        # dist.broadcast takes a global rank.
        src = dist.get_global_rank(self.group, root) if self.group is not None else root
        try:
            slot = _pack(payload)
            before = holders([slot])
            dist.broadcast(slot, src=src, group=self.group)
            wait_released([slot], before)
            length = _length(slot)
            if _fits(length):
                data = slot[_HEADER : _HEADER + length].numpy().tobytes()
            else:
                full = (
                    torch.frombuffer(bytearray(payload), dtype=torch.uint8)
                    if self._rank == root
                    else torch.empty(length, dtype=torch.uint8)
                )
                before = holders([full])
                dist.broadcast(full, src=src, group=self.group)
                wait_released([full], before)
                data = full.numpy().tobytes()
        except RuntimeError as exc:
            raise _translate(self, exc, "broadcast") from exc
        result: T = decode(data)
        return result

    def allgather(self, value: T) -> list[T]:
        """Every replica's ``value``, in rank order."""
        if self._local is not None:
            return self._local.allgather(value)
        return _Gathered(self, encode(value), async_op=False).values()

    def allreduce(self, value: T, op: Callable[[T, T], T] = add) -> T:
        """The rank-order fold of every replica's ``value`` with ``op``."""
        return fold(self.allgather(value), op)

    def allreduce_async(self, value: T, op: Callable[[T, T], T] = add) -> Future[T]:
        """Start an allreduce; ``.result()`` waits for the peers and folds."""
        if self._local is not None:
            return self._local.allreduce_async(value, op)
        if op is maximum and _int_list(value):
            return cast("Future[T]", _IntMaximum(self, cast("list[int]", value)))
        gathered = _Gathered(self, encode(value), async_op=True)
        return Deferred(lambda: fold(gathered.values(), op))

    def barrier(self) -> None:
        """Return once every replica has called barrier."""
        self.allgather(None)
