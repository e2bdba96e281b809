"""What a job tells its scheduler: two files in its share directory, and when.

A job run by a cluster scheduler (``ADAPTDL_SHARE_PATH`` set) publishes, from rank 0:

* :data:`HINTS_FILE`, its scheduling hints (core's ``adaptdl.hints/1`` document,
  :func:`adaptdl.core.decide.hints.hints`), from which the scheduler predicts its goodput
  at every size;
* :data:`PROGRESS_FILE`, its progress record (:func:`progress_record`): replicas,
  optimiser steps so far, total batch size, and the wall-clock time of the step,
  from which the scheduler measures a resize's cost (stop requested -> first step
  at the new size) and shows the batch size.

`Reporter` decides when: at the first training step of each process (a start or a
restart, which the resize-cost measurement needs), at the first step after the
batch size changed, and otherwise every :data:`REPORT_INTERVAL` seconds (as the
original AdaptDL's jobs did; ``ADAPTDL_REPORT_INTERVAL`` sets it). Both files go
through a `Share` (``localfs.LocalShare`` for a directory): a reader sees the old
document or the new one. The scheduler reads them back with :func:`read_hints` and
:func:`read_progress`.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Protocol

from adaptdl.core.config import DEFAULT_REPORT_INTERVAL
from adaptdl.core.decide.hints import hints, validate_hints
from adaptdl.core.validate import ArgumentTypeError, check_float, check_int, check_keys

if TYPE_CHECKING:
    from adaptdl.core.loop.loader import LoaderHelper
    from adaptdl.core.stats.metrics import MetricsState
    from adaptdl.core.topology import Topology

__all__ = [
    "HINTS_FILE",
    "PROGRESS_FILE",
    "PROGRESS_KEYS",
    "REPORT_INTERVAL",
    "Reporter",
    "Share",
    "encode",
    "progress_record",
    "publish_hints",
    "publish_progress",
    "read_hints",
    "read_progress",
    "validate_progress",
]

LOG = logging.getLogger("adaptdl.core.jobreport")

#: The job's scheduling hints in its share directory.
HINTS_FILE = "hints.json"
#: The job's progress record in its share directory.
PROGRESS_FILE = "progress.json"
#: The keys of a progress record, in order.
PROGRESS_KEYS = ("replicas", "step", "batch_size", "time")
#: Seconds between a job's reports when nothing else makes one due
#: (``ADAPTDL_REPORT_INTERVAL`` sets it for a job).
REPORT_INTERVAL = DEFAULT_REPORT_INTERVAL
# A share file larger than this is not a document of ours: never read whole.
_READ_LIMIT = 1 << 20


class Share(Protocol):
    """Where a job publishes its reports: single files, each replaced atomically."""

    def publish(self, name: str, data: bytes) -> None:
        """Replace file ``name`` by ``data``: a reader sees the old bytes or the new."""
        ...

    def read(self, name: str, limit: int | None = None) -> bytes:
        """The bytes of file ``name`` (at most ``limit``); OSError if it is missing."""
        ...


def progress_record(*, replicas: int, step: int, batch_size: int, time: float) -> dict[str, Any]:
    """The progress record: ``step`` optimiser steps so far, the last on ``replicas``
    replicas at total ``batch_size``, at wall-clock ``time`` (Unix seconds)."""
    return validate_progress(
        {"replicas": replicas, "step": step, "batch_size": batch_size, "time": time}
    )


def validate_progress(data: Any) -> dict[str, Any]:
    """Check a progress record (keys :data:`PROGRESS_KEYS`); return a normalised copy.

    Raises ValueError (or ArgumentTypeError) naming the offending key.
    """
    if not isinstance(data, Mapping):
        raise ArgumentTypeError(f"progress must be a mapping, got {type(data).__name__}")
    data = check_keys("progress", data, PROGRESS_KEYS)
    stamp = data["time"]
    if isinstance(stamp, int) and not isinstance(stamp, bool):
        stamp = float(stamp)
    return {
        "replicas": check_int("replicas", data["replicas"], min=1),
        "step": check_int("step", data["step"], min=0),
        "batch_size": check_int("batch_size", data["batch_size"], min=1),
        "time": check_float("time", stamp, min=0.0),
    }


def encode(document: Mapping[str, Any]) -> bytes:
    """A report's bytes on disk: one line of JSON (no NaN)."""
    return (json.dumps(dict(document), allow_nan=False) + "\n").encode()


def publish_hints(share: Share, document: Mapping[str, Any]) -> None:
    """Check and publish the job's hints document."""
    share.publish(HINTS_FILE, encode(validate_hints(document)))


def publish_progress(share: Share, record: Mapping[str, Any]) -> None:
    """Check and publish the job's progress record."""
    share.publish(PROGRESS_FILE, encode(validate_progress(record)))


def _read(
    share: Share, name: str, check: Callable[[Any], dict[str, Any]]
) -> dict[str, Any] | None:
    try:
        return check(json.loads(share.read(name, _READ_LIMIT)))
    except (OSError, ValueError, TypeError):
        return None


def read_hints(share: Share) -> dict[str, Any] | None:
    """The job's last hints, or None (none yet, or not a valid document)."""
    return _read(share, HINTS_FILE, validate_hints)


def read_progress(share: Share) -> dict[str, Any] | None:
    """The job's last progress record, or None (none yet, or not a valid record)."""
    return _read(share, PROGRESS_FILE, validate_progress)


class Reporter:
    """Rank 0's reports to the scheduler, made at step boundaries when due.

    The job asks `due` (a time on its own clock) at each training step boundary
    and calls `report` once it has passed: the only cost per step is that
    comparison. `report_soon` (a batch size changed) makes the next boundary
    report. A share that cannot be written is logged once and training goes on:
    the reports only inform the scheduler.
    """

    def __init__(
        self,
        share: Share,
        *,
        interval: float = REPORT_INTERVAL,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.share = share
        self.interval = check_float("interval", interval, min=0.0)
        self.wall = wall
        #: When the next report is due, on the job's clock (-inf: at the next boundary).
        self.due = -math.inf
        self.reports = 0
        self._failed = False

    def report_soon(self) -> None:
        """Report at the next training step boundary (the batch size changed)."""
        self.due = -math.inf

    def report(
        self,
        now: float,
        *,
        topology: Topology,
        step: int,
        loader: LoaderHelper | None,
        metrics: MetricsState,
    ) -> None:
        """Publish the hints (with a loader) and the progress record now (``now`` on
        the job's clock); the next report is due `interval` seconds later."""
        self.due = now + self.interval
        replicas = topology.num_replicas
        batch_size = loader.current_batch_size if loader is not None else replicas
        try:
            if loader is not None:
                document = hints(
                    metrics.profiler,
                    # The estimator's own statistics, as the adapters' hints: the cluster
                    # scheduler does not see the loss floor's credit (ARCHITECTURE).
                    metrics.grad_params(),
                    loader.batch_size,
                    loader.max_batch_size,
                    loader.local_bsz_bounds,
                    loader.gradient_accumulation,
                )
                publish_hints(self.share, document)
            record = progress_record(
                replicas=replicas, step=step, batch_size=max(batch_size, 1), time=self.wall()
            )
            publish_progress(self.share, record)
        except (OSError, ValueError) as exc:
            # A report that cannot be made (a share not writable, a document that does not
            # validate) never ends training: the scheduler then sees the last one.
            if not self._failed:
                LOG.warning("cannot publish the job's report for its scheduler: %s", exc)
            self._failed = True
            return
        self.reports += 1
