"""What a running job tells the scheduler, read from (and, for emulated jobs,
written to) its share directory (``ADAPTDL_SHARE_PATH``).

The file names, the progress record and when a real job writes them are core's
(`adaptdl.core.jobreport`, which `adaptdl.core.job.Job` drives at step
boundaries); this module opens the directory as a `localfs.LocalShare`. The
scheduler measures a resize's cost up to the first step the job reports at its new
size, and shows the batch size in ``adaptdl ls``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from typing import Any

from adaptdl.core import jobreport
from adaptdl.core.jobreport import HINTS_FILE, PROGRESS_FILE
from adaptdl.core.persist.localfs import LocalShare

__all__ = [
    "HINTS_FILE",
    "PROGRESS_FILE",
    "read_job_hints",
    "read_progress",
    "write_job_hints",
    "write_progress",
]


def write_progress(
    share_path: str | os.PathLike[str],
    *,
    replicas: int,
    step: int,
    batch_size: int,
    when: float | None = None,
) -> None:
    """Record that the job (rank 0) stepped: ``step`` steps so far on ``replicas``
    replicas at total ``batch_size``, at ``when`` (Unix seconds; now by default)."""
    record = jobreport.progress_record(
        replicas=replicas,
        step=step,
        batch_size=batch_size,
        time=time.time() if when is None else when,
    )
    jobreport.publish_progress(LocalShare(share_path), record)


def write_job_hints(share_path: str | os.PathLike[str], hints: Mapping[str, Any]) -> None:
    """Publish the job's scheduling hints (core's document, checked) for the scheduler."""
    jobreport.publish_hints(LocalShare(share_path), hints)


def read_progress(share_path: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The last progress the job wrote, or None (none yet, or unreadable)."""
    return jobreport.read_progress(LocalShare(share_path))


def read_job_hints(share_path: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The job's last hints, or None (none yet, or not a valid document)."""
    return jobreport.read_hints(LocalShare(share_path))
