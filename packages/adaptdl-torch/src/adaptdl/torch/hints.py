"""Scheduling hints on disk: core builds and checks the document, this stores it.

The document itself (schema ``adaptdl.hints/1``) is plain data from
:func:`adaptdl.core.decide.hints.hints`; :func:`write_hints` stores it atomically at any
path (in core's encoding, `adaptdl.core.jobreport.encode`), :func:`read_hints`
loads and checks it. A job under a scheduler publishes its hints by itself
(`adaptdl.core.jobreport`).
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from adaptdl.core.decide.hints import validate_hints
from adaptdl.core.jobreport import encode
from adaptdl.core.persist.localfs import fsync_directory, replace_durably

__all__ = ["read_hints", "write_hints"]


def write_hints(path: str | os.PathLike[str], data: Mapping[str, Any]) -> None:
    """Validate ``data`` and write it to ``path`` atomically and durably.

    A reader sees the old document or the new one, never a part
    (`localfs.replace_durably`); the rename itself is flushed where the platform
    can open a directory.
    """
    target = Path(os.path.abspath(os.fspath(path)))
    replace_durably(target, encode(validate_hints(data)))
    with contextlib.suppress(OSError):  # not every platform can open a directory
        fsync_directory(target.parent)


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
