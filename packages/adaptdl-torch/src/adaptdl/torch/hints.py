"""Scheduling hints on disk: core builds and checks the document, this stores it.

The document itself (schema ``adaptdl.hints/1``) is plain data from
:func:`adaptdl.core.hints.hints`; :func:`write_hints` stores it atomically for a
scheduler, :func:`read_hints` loads and checks it.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Mapping
from typing import Any

from adaptdl.core.hints import validate_hints

__all__ = ["read_hints", "write_hints"]


def write_hints(path: str | os.PathLike[str], data: Mapping[str, Any]) -> None:
    """Validate ``data`` and write it to ``path`` atomically.

    The document goes to a temporary file in the same directory, is flushed to
    disk, then renamed over ``path``: a reader sees the old document or the new
    one, never a part.
    """
    text = json.dumps(validate_hints(data), indent=2, allow_nan=False) + "\n"
    target = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(target))
    fd, tmp = tempfile.mkstemp(prefix=".hints-", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    # Persist the rename itself; not every platform can open a directory.
    with contextlib.suppress(OSError):
        dir_fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


def read_hints(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read and validate a hints document written by :func:`write_hints`.

    Raises ValueError when the file is not JSON or not schema ``adaptdl.hints/1``.
    """
    with open(path, encoding="utf-8") as f:
        text = f.read()
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"hints file {os.fspath(path)!r} is not valid JSON: {exc}") from None
    return validate_hints(data)
