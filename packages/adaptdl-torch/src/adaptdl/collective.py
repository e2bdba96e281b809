"""Collectives on small Python values among a job's replicas, with the original AdaptDL's API.

Every replica must call these functions in the same order (the n-th call of one
replica meets the n-th call of every other). They run over the job's gloo group
(`adaptdl.torch.init_process_group`), the same channel the library uses, so they
may be mixed freely with the library's own collectives.

Values travel as JSON, never pickled: ``None``, bools, numbers, strings, and
lists, tuples and str-keyed dicts of them (a tuple arrives as a list). Anything
else raises TypeError naming the value. For tensors and other large data use
``torch.distributed`` directly.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import adaptdl.env
from adaptdl.core.collective import Collective, Future
from adaptdl.torch._context import current_job, init_process_group, is_initialized

__all__ = [
    "allreduce",
    "allreduce_async",
    "broadcast",
    "default_reduce_fn",
    "initialize",
    "teardown",
]


def default_reduce_fn(a: Any, b: Any) -> Any:
    """``a + b``: numbers add, strings and lists concatenate (as the original's default).

    For element-wise sums of lists and key-wise sums of dicts, pass
    `adaptdl.core.collective.add` as ``reduce_fn``.
    """
    return a + b


def initialize(
    master_addr: str | None = None,
    master_port: int | None = None,
    replica_rank: int | None = None,
    num_replicas: int | None = None,
) -> None:
    """Join the job's collectives: `adaptdl.torch.init_process_group` with the default backend.

    Blocks until every replica has called it. The replica's rank and the number of
    replicas come from the environment (`adaptdl.env`); ``replica_rank`` and
    ``num_replicas``, when given, must agree with it (ValueError otherwise).
    ``master_addr`` and ``master_port`` name a TCP rendezvous in place of torchrun's;
    give both or neither. Raises RuntimeError if the job is already initialised.
    """
    if is_initialized():
        raise RuntimeError(
            "adaptdl.collective is already initialized (adaptdl.torch.init_process_group or "
            "adaptdl.collective.initialize ran in this process)"
        )
    for what, given, actual in (
        ("replica_rank", replica_rank, adaptdl.env.replica_rank()),
        ("num_replicas", num_replicas, adaptdl.env.num_replicas()),
    ):
        if given is not None and given != actual:
            raise ValueError(
                f"{what}={given!r} differs from the environment's {actual} (torchrun's "
                "variables, or the ADAPTDL_* ones that override them): set the environment "
                "instead"
            )
    if (master_addr is None) != (master_port is None):
        raise ValueError(
            f"give master_addr and master_port together or neither, got master_addr="
            f"{master_addr!r} and master_port={master_port!r}"
        )
    init_method = f"tcp://{master_addr}:{master_port}" if master_addr is not None else None
    init_process_group(init_method=init_method)


def teardown() -> None:
    """Wait until every replica has called it and for the job's pending collectives.

    Call it at the end of a program, on every replica. The process group stays
    up until the process exits (the library's own state uses it); RuntimeError if
    the job was never initialised.
    """
    collective = _collective()
    current_job().drain()
    collective.barrier()


def _collective() -> Collective:
    if not is_initialized():
        raise RuntimeError(
            "adaptdl.collective has not been initialized: call "
            "adaptdl.torch.init_process_group() (or adaptdl.collective.initialize()) first"
        )
    return current_job().collective


def allreduce(value: Any, reduce_fn: Callable[[Any, Any], Any] = default_reduce_fn) -> Any:
    """Every replica's ``value`` combined with ``reduce_fn``, the same result on every replica.

    ``reduce_fn(a, b)`` folds the values in rank order, ``fn(fn(v0, v1), v2)...``,
    so a non-commutative function gives the same answer everywhere. It must be the
    same function on every replica. Blocks until every replica has called it.
    """
    return _collective().allreduce(value, reduce_fn)


def allreduce_async(
    value: Any, reduce_fn: Callable[[Any, Any], Any] = default_reduce_fn
) -> Future[Any]:
    """Start `allreduce` without waiting; the returned future's ``result()`` gives its value."""
    return _collective().allreduce_async(value, reduce_fn)


def broadcast(value: Any) -> Any:
    """Replica 0's ``value`` on every replica (the others' ``value`` is ignored)."""
    return _collective().broadcast(value, 0)
