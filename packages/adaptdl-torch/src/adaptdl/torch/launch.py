"""The torchrun command line that starts local replicas of a training script.

One builder for every place that launches real replicas on one machine (the
end-to-end tests, the fault-injection harness, the outcome experiments, the
benchmarks and the demo), so that they all run torchrun the same way.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

from adaptdl.core._validate import check_float, check_int

__all__ = ["torchrun_command"]


def torchrun_command(
    target: str | os.PathLike[str],
    nproc: int,
    *,
    args: Sequence[str] = (),
    module: bool = False,
    max_restarts: int = 0,
    monitor_interval: float | None = None,
    python: str = sys.executable,
) -> list[str]:
    """``python -m torch.distributed.run --standalone`` running ``nproc`` replicas of ``target``.

    ``target`` is a script path, or a module name when ``module`` (``-m``); ``args``
    follow it. torchrun restarts the whole group up to ``max_restarts`` times after
    a replica fails, checking the replicas every ``monitor_interval`` seconds
    (torchrun's default when None).
    """
    check_int("nproc", nproc, min=1)
    check_int("max_restarts", max_restarts, min=0)
    command = [
        python,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        f"--max-restarts={max_restarts}",
    ]
    if monitor_interval is not None:
        seconds = check_float("monitor_interval", monitor_interval, min=0.0, min_exclusive=True)
        command.append(f"--monitor-interval={seconds:g}")
    command += ["-m", str(target)] if module else [os.fspath(target)]
    return [*command, *args]
