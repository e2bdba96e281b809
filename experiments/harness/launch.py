"""What the outcome experiments share: launching torchrun workers, fixed batch sizes, data."""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

# Re-exported: the experiments import the fixed decision from here.
from adaptdl.core.decide.batchsize import FixedSplit as FixedSplit
from adaptdl.core.stats.statsbudget import MeasureBudget
from adaptdl.core.stats.step import StepMeasurement

REPO = Path(__file__).resolve().parents[2]


class WorkerError(RuntimeError):
    """A torchrun job of an experiment failed; the message holds its output's tail."""


def launch(
    module: str, nproc: int, config: dict[str, Any], *, timeout: float = 600.0
) -> dict[str, Any]:
    """Run ``python -m module`` under torchrun on ``nproc`` CPU replicas; return its result.

    The worker reads ``config`` (JSON) from ``$OUTCOME_CONFIG`` and rank 0 writes
    its result (JSON) to ``$OUTCOME_RESULT``.
    """
    with tempfile.TemporaryDirectory(prefix="adaptdl-outcome-") as tmp:
        cfg = Path(tmp) / "config.json"
        res = Path(tmp) / "result.json"
        cfg.write_text(json.dumps(config))
        env = {
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "OUTCOME_CONFIG": str(cfg),
            "OUTCOME_RESULT": str(res),
            "PYTHONPATH": os.pathsep.join(
                p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p
            ),
        }
        env.pop("ADAPTDL_CHECKPOINT_PATH", None)  # every run starts fresh
        # Imported here: adaptdl.torch loads torch, which the numpy paths never need.
        from adaptdl.torch.launch import torchrun_command

        command = torchrun_command(module, nproc, module=True, monitor_interval=0.2)
        start = time.perf_counter()
        proc = subprocess.run(
            command,
            env=env,
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            timeout=timeout,
            check=False,
        )
        if proc.returncode != 0 or not res.exists():
            tail = proc.stdout.decode(errors="replace")[-4000:]
            raise WorkerError(f"{module} on {nproc} replicas exited {proc.returncode}:\n{tail}")
        result: dict[str, Any] = json.loads(res.read_text())
        result["launch_seconds"] = time.perf_counter() - start
        return result


def worker_config() -> dict[str, Any]:
    """The config a worker was launched with."""
    data: dict[str, Any] = json.loads(Path(os.environ["OUTCOME_CONFIG"]).read_text())
    return data


def fix_measure_share(wrapper: Any, share: float | None) -> None:
    """Have ``wrapper`` (an adaptive wrapper) measure the gradient statistics on a fixed
    ``share`` of its steps (None: leave core's budget, which follows their measured
    cost, so which steps measure varies with the machine's load from run to run)."""
    if share is not None:
        wrapper._steps.budget = MeasureBudget(fixed=share)


def write_result(result: dict[str, Any]) -> None:
    """Write the worker's result (call on rank 0 only)."""
    path = Path(os.environ["OUTCOME_RESULT"])
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result))
    os.replace(tmp, path)


def gaussian_mixture(
    num_samples: int, *, num_classes: int = 10, dim: int = 20, spread: float = 1.0, seed: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """Features and labels of a Gaussian-mixture classification problem.

    Each class has a random centre (unit-variance entries, scaled by ``spread``)
    and a random linear transformation of its noise, so the classes overlap
    unevenly and no classifier reaches 100%. The centres and transforms depend on
    ``seed`` only; the samples are drawn with ``seed + 1``.
    """
    gen = np.random.default_rng(seed)
    centres = spread * gen.standard_normal((num_classes, dim))
    transforms = gen.standard_normal((num_classes, dim, dim)) / np.sqrt(dim)
    draw = np.random.default_rng(seed + 1)
    labels = draw.integers(0, num_classes, size=num_samples)
    noise = draw.standard_normal((num_samples, dim))
    features = centres[labels] + np.einsum("nij,nj->ni", transforms[labels], noise)
    return features.astype(np.float32), labels.astype(np.int64)


def rel_error(
    estimate: Sequence[float] | np.ndarray, truth: Sequence[float] | np.ndarray
) -> np.ndarray:
    """|estimate - truth| / truth, elementwise."""
    e = np.asarray(estimate, dtype=np.float64)
    t = np.asarray(truth, dtype=np.float64)
    return np.abs(e - t) / t


def accumulated_step(grads: np.ndarray, batch_size: int) -> tuple[StepMeasurement, np.ndarray]:
    """One replica's step over micro-batch gradients ``grads`` (micro-batches x dim).

    Returns what the torch adapter would measure, for one parameter group and
    micro-batches of ``batch_size`` samples accumulated on one replica, and the
    mean gradient the optimiser steps with.
    """
    mean = grads.mean(axis=0)
    local, total = float(np.sum(grads**2)), float(mean @ mean)
    return StepMeasurement((local,), (total,), len(grads), 1, batch_size), mean
