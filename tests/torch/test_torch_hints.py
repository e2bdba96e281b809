"""Scheduling hints on disk: atomic write, checked read (adaptdl.torch.hints)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from adaptdl.core.decide.hints import hints
from adaptdl.core.goodput import GradParams
from adaptdl.core.stats.profiler import FIT_AFTER, Profiler
from adaptdl.torch.hints import read_hints, write_hints


def fitted_profiler() -> Profiler:
    """A profiler with two configurations' optimiser steps, so hints carry a fit."""
    prof = Profiler()
    for key, (compute, optim) in [((1, 1, 32), (0.15, 0.15)), ((2, 4, 32), (0.15, 0.5))]:
        for _ in range(FIT_AFTER):
            prof.record(*key, accum_step=False, step_time=optim, sync_time=optim - compute)
    return prof


def test_write_and_read_hints_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "hints.json"
    doc = hints(fitted_profiler(), GradParams(0.5, 7.0), 32, 512, (None, 64), True)
    assert doc["perf_params"] is not None  # the round trip carries a fit
    write_hints(path, doc)
    assert read_hints(path) == doc
    assert read_hints(str(path)) == doc
    # Overwrite in place; no temporary file is left behind.
    newer = {**doc, "max_profiled_replicas": 8}
    write_hints(path, newer)
    assert read_hints(path) == newer
    assert os.listdir(tmp_path) == ["hints.json"]


def test_write_hints_refuses_an_invalid_document_and_keeps_the_old_one(tmp_path: Path) -> None:
    path = tmp_path / "hints.json"
    doc = hints(Profiler(), None, 32)
    write_hints(path, doc)
    with pytest.raises(ValueError, match="init_batch_size"):
        write_hints(path, {**doc, "init_batch_size": -1})
    assert read_hints(path) == doc
    assert os.listdir(tmp_path) == ["hints.json"]


def test_write_hints_cleans_up_when_the_rename_fails(tmp_path: Path) -> None:
    target = tmp_path / "a-directory"
    target.mkdir()
    (target / "occupant").write_text("x")
    with pytest.raises(OSError):
        write_hints(target, hints(Profiler(), None, 32))
    assert sorted(os.listdir(tmp_path)) == ["a-directory"]


def test_read_hints_rejects_damaged_files(tmp_path: Path) -> None:
    path = tmp_path / "hints.json"
    path.write_text('{"schema": "adaptdl.hints/1", ')
    with pytest.raises(ValueError, match="not valid JSON"):
        read_hints(path)
    path.write_text(json.dumps({"schema": "something/1"}))
    with pytest.raises(ValueError, match="hints schema"):
        read_hints(path)
    with pytest.raises(FileNotFoundError):
        read_hints(tmp_path / "missing.json")
