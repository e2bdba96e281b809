"""Refusal to run beside the original AdaptDL distribution, whose files collide with ours.

The original project ships one distribution named ``adaptdl`` with an
``adaptdl/__init__.py`` (a regular package) and its own ``adaptdl/torch``,
``adaptdl/env.py``, ... Installed in the same environment as ``adaptdl-core``,
``adaptdl-torch`` or ``adaptdl-sim``, each overwrites the other's files and the
import system picks one ``adaptdl`` package: a program would run a silent mix.
"""

from __future__ import annotations

import importlib.metadata
import sys

__all__ = ["ORIGINAL_DISTRIBUTION", "check_no_original"]

ORIGINAL_DISTRIBUTION = "adaptdl"
"""The original project's distribution name (ours are adaptdl-core, -torch and -sim)."""


def _installed_original() -> str | None:
    """Where the original distribution is installed, or None when it is not."""
    try:
        dist = importlib.metadata.distribution(ORIGINAL_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return None
    return f"version {dist.version} at {dist.locate_file('')}"


def _regular_package() -> str | None:
    """The ``adaptdl/__init__.py`` that makes ``adaptdl`` a regular package, or None."""
    package = sys.modules.get("adaptdl")
    return getattr(package, "__file__", None) if package is not None else None


def check_no_original() -> None:
    """Raise ImportError if the original ``adaptdl`` distribution shares this environment.

    Ours never ship ``adaptdl/__init__.py`` (``adaptdl`` is a namespace package), so
    finding one, or the original's metadata, means both are installed.
    """
    found = []
    installed = _installed_original()
    if installed is not None:
        found.append(f"its distribution '{ORIGINAL_DISTRIBUTION}' is installed ({installed})")
    init = _regular_package()
    if init is not None:
        found.append(f"its file {init} makes 'adaptdl' a regular package")
    if not found:
        return
    raise ImportError(
        "the original AdaptDL (distribution 'adaptdl', petuum/adaptdl) is installed in this "
        "environment beside this AdaptDL (distributions 'adaptdl-core', 'adaptdl-torch', "
        f"'adaptdl-sim'): {'; '.join(found)}. Both install files under the 'adaptdl' package "
        "and overwrite each other's, so neither works reliably. Remove the original with "
        "'pip uninstall adaptdl', then reinstall this one (its uninstall may have removed "
        "files both share): 'pip install --force-reinstall adaptdl-torch' (or adaptdl-core, "
        "adaptdl-sim, whichever you use). Programs written for the original run on this one; "
        "see docs/MIGRATING.md."
    )
