"""Make the job's lifecycle lines visible without the program configuring logging.

Python shows nothing below WARNING unless the program configures logging, and
`adaptdl.core.loop.lifecycle` logs at INFO. `configure` therefore sets the ``adaptdl``
logger's level (``ADAPTDL_LOG_LEVEL``, default INFO) and, when the program
configured no handler at all, attaches one of its own that writes to stderr. That
handler stands aside once the program configures logging itself (a handler on the
root logger or on ``adaptdl``), so that no line is printed twice.
"""

from __future__ import annotations

import logging
import sys

from adaptdl.core.config import DEFAULT_LOG_LEVEL

__all__ = ["LOGGER_NAME", "configure"]

LOGGER_NAME = "adaptdl"
FORMAT = "%(asctime)s adaptdl %(levelname)s: %(message)s"


class _FallbackHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes to stderr while neither the root logger nor ``adaptdl`` has another handler."""

    def emit(self, record: logging.LogRecord) -> None:
        logger = logging.getLogger(LOGGER_NAME)
        if logging.getLogger().handlers or any(h is not self for h in logger.handlers):
            return  # the program configured logging since: its handlers print the line
        # Resolved at each line: pytest's capture and a replaced sys.stderr are honoured.
        self.setStream(sys.stderr)
        super().emit(record)


def configure(level: str | None) -> None:
    """Set the ``adaptdl`` logger's level and give it a handler if the program has none.

    ``level`` (one of `adaptdl.core.config.LOG_LEVELS`) is ``ADAPTDL_LOG_LEVEL``; None
    keeps a level the program set on the ``adaptdl`` logger, and is INFO otherwise.
    Calling it again does not add a second handler.
    """
    logger = logging.getLogger(LOGGER_NAME)
    if level is not None:
        logger.setLevel(level)
    elif logger.level == logging.NOTSET:
        logger.setLevel(DEFAULT_LOG_LEVEL)
    if any(isinstance(h, _FallbackHandler) for h in logger.handlers):
        return
    if logging.getLogger().handlers or logger.handlers:
        return  # the program configured logging: its handlers show the lines
    handler = _FallbackHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(FORMAT))
    logger.addHandler(handler)
