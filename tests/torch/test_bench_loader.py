"""The loader benchmark keeps working: its smoke run completes and reports every case.

Only what the benchmark prints and how its CPU clock counts are checked, never a speed.
"""

from __future__ import annotations

import importlib.util
import multiprocessing
import os
import re
import subprocess
import sys
import time
from multiprocessing.connection import Connection
from pathlib import Path
from types import ModuleType

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_torch_loader.py"
CASES = (
    "workers=0",
    "workers=0 checkpoint",
    "workers=2",
    "workers=2 checkpoint",
    "workers=2 persistent",
    "50us/item workers=0",
    "50us/item workers=2",
)


def test_quick_benchmark_reports_every_case() -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("ADAPTDL_CHECKPOINT_PATH", None)
    run = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    rows = {}
    for line in run.stdout.splitlines():
        match = re.match(r"(\S+(?: \S+)*?)\s{2,}(0\.9[89])\s", line)
        if match:
            rows[match.group(1)] = line
    assert set(rows) == set(CASES), run.stdout
    for name, line in rows.items():
        # Ratios are printed for CPU and wall time, median and best-of.
        assert len(re.findall(r"\s\d+\.\d{3}\s", line)) >= 4, line
        # Worker starts per epoch of the plain DataLoader: fixed by torch's semantics,
        # so they check the counter (non-persistent workers start anew every epoch).
        plain_starts = float(line.rsplit("/", 1)[0].split()[-1])
        workers = 2 if "workers=2" in name and "persistent" not in name else 0
        assert plain_starts == workers, line


def _load_benchmark() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_torch_loader", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _burn(cpu_seconds: float, done: Connection, release: Connection) -> None:
    # Spend CPU (not wall) time, report, then stay alive until released.
    end = time.process_time() + cpu_seconds
    while time.process_time() < end:
        pass
    done.send(True)
    release.recv()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_cpu_clock_counts_a_live_child_once_and_a_reaped_one_once() -> None:
    """What persistent workers need: CPU of a live child counted, and not twice later."""
    bench = _load_benchmark()
    ctx = multiprocessing.get_context("fork")
    done_r, done_w = ctx.Pipe(duplex=False)
    release_r, release_w = ctx.Pipe(duplex=False)
    burn = 0.3
    start = bench.cpu_clock()
    child = ctx.Process(target=_burn, args=(burn, done_w, release_r))
    child.start()
    try:
        assert done_r.poll(120), "the child did not finish burning CPU"
        live = bench.cpu_clock() - start  # the child is alive: only /proc sees its CPU
    finally:
        release_w.send(True)
        child.join(60)
    reaped = bench.cpu_clock() - start  # now getrusage(RUSAGE_CHILDREN) has it
    assert live >= burn
    # Counted twice, the reaped figure would exceed the live one by `burn` or more.
    assert reaped - live < burn / 2
