"""Letting torch's communication threads release tensors before the interpreter ends.

A gloo process group runs each collective on a worker thread of its own, which
holds the operation (and its tensors) a moment after ``wait()`` has returned. Since
torch 2.9 a C++ reference to a tensor that has a Python object keeps that object
alive, so the worker's release of the tensor takes the GIL. Should the program end
inside that moment, the worker asks for the GIL during the interpreter's
finalization, CPython ends the thread with ``pthread_exit``, the unwinding meets a
``noexcept`` destructor and the replica aborts ("terminate called without an active
exception", SIGABRT) after finishing its work: torchrun then reports the job failed.

Two measures close that window:

* `wait_released` after each of adaptdl's own collectives: while C++ holds a tensor
  its Python reference count is one higher, so waiting (GIL released) until the
  count is back where it was before the operation is exact.
* `settle_at_exit`, registered with `atexit` once a process group with several
  replicas exists: atexit functions run before finalization begins, and a short
  sleep there (GIL released) lets the threads finish releasing what other code's
  collectives (DDP, FSDP2, DCP, the user's own) handed them.
"""

from __future__ import annotations

import atexit
import logging
import sys
import time
from collections.abc import Sequence

import torch

__all__ = ["SETTLE_SECONDS", "holders", "register_settle_at_exit", "wait_released"]

LOG = logging.getLogger("adaptdl.torch")

# Long enough for a descheduled worker thread on a loaded machine to run again and
# take the GIL (its release itself takes microseconds); short beside a process start.
SETTLE_SECONDS = 0.1
_RELEASE_TIMEOUT = 5.0


def holders(tensors: Sequence[torch.Tensor]) -> list[int]:
    """Each tensor's Python reference count (one higher while C++ also holds it)."""
    return [sys.getrefcount(t) for t in tensors]


def wait_released(tensors: Sequence[torch.Tensor], before: Sequence[int]) -> None:
    """Wait, GIL released, until C++ no longer holds ``tensors`` beyond ``before``.

    ``before`` is `holders` of the same sequence taken before the operation started,
    with the caller holding the tensors the same way then as now. Gives up after a
    few seconds (a holder that keeps them on purpose), logging it at debug level.
    """
    deadline = time.monotonic() + _RELEASE_TIMEOUT
    delay = 0.0
    while any(now > then for now, then in zip(holders(tensors), before, strict=True)):
        if time.monotonic() > deadline:
            LOG.debug("a collective's tensors are still held after %.0f s", _RELEASE_TIMEOUT)
            return
        time.sleep(delay)  # releases the GIL, which the releasing thread needs
        delay = min(2 * delay + 1e-5, 1e-3)


def _settle() -> None:
    time.sleep(SETTLE_SECONDS)


def register_settle_at_exit() -> None:
    """Make the interpreter's exit wait `SETTLE_SECONDS` first (idempotent)."""
    atexit.unregister(_settle)
    atexit.register(_settle)
