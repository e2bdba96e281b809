"""What a DataLoader worker forked from the training process does with its garbage.

A forked worker inherits the training process's heap, garbage included: a
destroyed process group in a reference cycle, say, which the training process
would free at its next collection. Freed in a worker, such an object's destructor
runs where only the forking thread exists: a gloo group's waits for its threads,
forever, holding the GIL (or aborts the worker), and the training process waits
forever for the batch (found as a CI hang). So an `AdaptiveDataLoader` forks its
workers with the collector off (`GcWindow.forking`), and each worker, first thing,
freezes what it inherited and turns the collector back on (`GcWindow.in_worker`):
a worker collects only objects of its own. The training process's collector is
left as it was: nothing frozen, unfrozen or moved between generations.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator

__all__ = ["WINDOW", "GcWindow"]


class GcWindow:
    """The collector off while workers fork; the state a worker reads to restore it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._depth = 0  # loaders forking now, in any thread
        self.enabled = False  # whether the collector ran before the outermost window

    @contextlib.contextmanager
    def forking(self) -> Iterator[None]:
        """The collector off inside (on again after, if it was before), so that no
        collection runs between a fork and the worker's `in_worker`."""
        with self._lock:
            if self._depth == 0:
                self.enabled = gc.isenabled()
                gc.disable()
            self._depth += 1
        try:
            yield
        finally:
            with self._lock:
                self._depth -= 1
                if self._depth == 0 and self.enabled:
                    gc.enable()

    def in_worker(self) -> None:
        """In a worker, before anything else: never collect what it inherited, and
        collect its own objects as the training process did (a spawned worker
        inherits nothing and its collector was never turned off)."""
        gc.freeze()
        if self.enabled:
            gc.enable()


WINDOW = GcWindow()
"""The process's window: one collector per process, whichever loader forks."""
