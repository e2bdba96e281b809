"""What SIGTERM and SIGINT do to a training process and to its DataLoader workers.

A scheduler stops a job with SIGTERM, possibly several times and to every process
at once (torchrun forwards each one it gets to its replicas' process groups;
Slurm's ``scancel`` signals every process of the step); an operator presses
Ctrl-C (SIGINT). In the training process the signal asks the job to stop: inside
a loop at the next step boundary, after a checkpoint; outside any loop core decides
(`adaptdl.core.job.Job.stop_outside_loop`): one replica checkpoints at once, several
wait for the next point they all reach, for ``ADAPTDL_STOP_WAIT`` seconds at most,
after which a timer here wakes the main thread (`Job.stop_overdue`); never in the
middle of a checkpoint. The exit status is 128 + the signal: 143 for SIGTERM, 130
for SIGINT.

A DataLoader worker ignores both unless they come from its training process
(which ends its workers itself) or that process is gone: a worker killed by the
scheduler's signal would make the training process fail before it checkpoints.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

from adaptdl.core.job import Job

__all__ = ["STOP_SIGNALS", "install", "reinstall", "restore", "shield_worker"]

LOG = logging.getLogger("adaptdl.torch")

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
"""The signals that stop a job (checkpoint, then exit 128 + the signal)."""


class _Handler:
    """The training process's handler; the job is looked up when a signal arrives."""

    def __init__(self, job: Callable[[], Job | None]) -> None:
        self.job = job
        self.pid = os.getpid()
        self.previous: dict[int, Any] = {}
        # Set by the timer of a stop that waits: the next call is its wake-up, not a signal.
        self.overdue = threading.Event()
        self.timer: threading.Timer | None = None

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        if os.getpid() != self.pid:
            # A child forked before it set its own handlers (a DataLoader worker sets
            # them at once): the default, as it would have without AdaptDL.
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        job = self.job()
        if job is None:
            return
        if self.overdue.is_set():
            self.overdue.clear()
            self.timer = None
            self._arm(job.stop_overdue(), signum)
            return
        job.request_stop(128 + signum)
        if job.current_loader is None and not job.stop_deferred:
            # No loop runs to reach a step boundary: core decides (at once, or wait).
            self._arm(job.stop_outside_loop(), signum)

    def _arm(self, seconds: float | None, signum: int) -> None:
        """Wake the main thread in ``seconds`` (None: not at all) to ask core again."""
        if seconds is None or self.timer is not None:
            return
        self.timer = threading.Timer(seconds, self._wake, args=(signum,))
        self.timer.daemon = True
        self.timer.start()

    def _wake(self, signum: int) -> None:
        """On the timer's thread: have the main thread run `Job.stop_overdue`."""
        self.overdue.set()
        # A real signal, to the main thread alone: it also wakes a blocking call (a
        # sleep), which `_thread.interrupt_main` would leave to finish first.
        main = threading.main_thread().ident
        if main is not None:
            signal.pthread_kill(main, signum)

    def cancel(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None


_installed: _Handler | None = None


def install(job: Callable[[], Job | None]) -> None:
    """Make SIGTERM and SIGINT stop ``job()`` (main thread only; elsewhere a warning)."""
    global _installed
    if threading.current_thread() is not threading.main_thread():
        LOG.warning("not in the main thread: SIGTERM and SIGINT will not trigger a checkpoint")
        return
    handler = _Handler(job)
    for signum in STOP_SIGNALS:
        handler.previous[signum] = signal.signal(signum, handler)
    _installed = handler


def reinstall() -> None:
    """Make the handlers `install` set current again, after other code replaced them.

    A framework that installs its own SIGTERM handler (Lightning's ``Trainer``)
    would otherwise act on the signal before the job reaches a step boundary.
    Does nothing before `install` or outside the main thread.
    """
    if _installed is None or threading.current_thread() is not threading.main_thread():
        return
    for signum in STOP_SIGNALS:
        signal.signal(signum, _installed)


def restore() -> None:
    """Put back the handlers `install` replaced."""
    global _installed
    if _installed is not None:
        _installed.cancel()
        for signum, previous in _installed.previous.items():
            signal.signal(signum, previous)
        _installed = None


def shield_worker() -> None:
    """In a DataLoader worker: obey SIGTERM and SIGINT only from the training process.

    The signals are blocked and a thread waits for them, because only
    ``sigwaitinfo`` tells who sent one: the training process ends its workers
    with SIGTERM when it shuts a loader down, and then the worker exits at once
    (status 0, as torch's own handler does); one that outlived its training
    process exits too. Any other sender (a scheduler signalling every process)
    is ignored.
    """
    parent = os.getppid()
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    threading.Thread(
        target=_answer, args=(parent,), name="adaptdl-worker-signals", daemon=True
    ).start()


def _answer(parent: int) -> None:
    while True:
        info = signal.sigwaitinfo(STOP_SIGNALS)
        if info.si_pid == parent or os.getppid() != parent:
            os._exit(0)
