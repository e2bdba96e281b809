"""The loader benchmark keeps working: its smoke run completes and reports every case.

Only what the benchmark prints is checked, never a figure of time.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

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
