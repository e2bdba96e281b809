"""What a DataLoader worker forked from the training process does with its garbage.

A forked worker inherits the training process's heap, garbage included: a
destroyed process group in a reference cycle, say, which the training process
would free at its next collection. Freed in a worker, such an object's destructor
runs where only the forking thread exists: a gloo group's waits for its threads,
forever, holding the GIL (or aborts the worker), and the training process waits
forever for the batch (found as a CI hang). So an `AdaptiveDataLoader` forks its
workers inside `GcWindow.forking`: the collector is off in the window, and a
process forked in it freezes what it inherited before any of its own code runs
(an ``os.register_at_fork`` hook), then turns the collector back on if it was on
before the window. A worker collects only objects of its own, whatever its
``worker_init_fn``. The training process's collector is off only inside the
window (whatever another thread forks then gets the same treatment) and is left
as it was: nothing frozen, unfrozen or moved between generations.

With the spawn or forkserver start method a worker inherits nothing; the window
only keeps the collector off while the workers start.
"""

from __future__ import annotations

import contextlib
import gc
import os
import threading
from collections.abc import Iterator

__all__ = ["WINDOW", "GcWindow"]


class GcWindow:
    """The collector off while workers fork; what a process forked then restores."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._depth = 0  # loaders forking now, in any thread
        self.enabled = False  # whether the collector ran before the outermost window

    @contextlib.contextmanager
    def forking(self) -> Iterator[None]:
        """The collector off inside (on again after, if it was before): no
        collection runs in a process forked inside before `after_fork_in_child`."""
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

    def after_fork_in_child(self) -> None:
        """In a process forked inside the window, before its own code: never collect
        what it inherited; collect its own objects as the training process did."""
        # Another thread may have held the lock at the fork: the child's own.
        self._lock = threading.Lock()
        if self._depth == 0:
            return
        self._depth = 0  # the child is in no window: its forker's frames never return
        gc.freeze()
        if self.enabled:
            gc.enable()


WINDOW = GcWindow()
"""The process's window: one collector per process, whichever loader forks."""

if hasattr(os, "register_at_fork"):  # not on Windows, which cannot fork
    os.register_at_fork(after_in_child=WINDOW.after_fork_in_child)
