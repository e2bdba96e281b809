"""What a running job tells the scheduler, as two files in its share directory
(``ADAPTDL_SHARE_PATH``): its scheduling hints (``hints.json``, core's document) and
its progress (``progress.json``: replicas, step, batch size, time of the last step).

The scheduler measures a resize's cost up to the first step the job reports at its
new size, and shows the batch size in ``adaptdl ls``. Both files are written
atomically (a reader sees the old document or the new one).
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from adaptdl.core._validate import check_float, check_int
from adaptdl.core.hints import validate_hints

HINTS_FILE = "hints.json"
PROGRESS_FILE = "progress.json"


def _write_json(path: Path, data: Mapping[str, Any]) -> None:
    text = json.dumps(dict(data), allow_nan=False) + "\n"
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}-", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


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
    check_int("replicas", replicas, min=1)
    check_int("step", step, min=0)
    check_int("batch_size", batch_size, min=1)
    stamp = time.time() if when is None else check_float("when", when, min=0.0)
    data = {"replicas": replicas, "step": step, "batch_size": batch_size, "time": stamp}
    _write_json(Path(share_path) / PROGRESS_FILE, data)


def write_job_hints(share_path: str | os.PathLike[str], hints: Mapping[str, Any]) -> None:
    """Publish the job's scheduling hints (core's document, checked) for the scheduler."""
    _write_json(Path(share_path) / HINTS_FILE, validate_hints(hints))


def read_progress(share_path: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The last progress the job wrote, or None (none yet, or unreadable)."""
    try:
        data = json.loads((Path(share_path) / PROGRESS_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict):
        return None
    counts = all(isinstance(data.get(k), int) for k in ("replicas", "step", "batch_size"))
    if not counts or not isinstance(data.get("time"), (int, float)):
        return None
    return data


def read_job_hints(share_path: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The job's last hints, or None (none yet, or not a valid document)."""
    try:
        data = json.loads((Path(share_path) / HINTS_FILE).read_text(encoding="utf-8"))
        return validate_hints(data)
    except (OSError, ValueError, TypeError):
        return None
