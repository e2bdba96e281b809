"""End to end: programs in the seed project's style, stopped by SIGTERM and resumed.

Each program runs under torchrun (gloo, CPU) twice: once without a stop, and once
at 2 replicas until SIGTERM mid-training, then resumed. The metrics it prints
(validation and test totals from per-epoch accumulators, GAN losses) must match
the uninterrupted run's: resumed at 1 replica, up to floating-point summation
order; resumed at the same 2 replicas with dropout in the model, bit for bit
(random states restored with the checkpoint), under DDP and under FSDP2 at a
fixed batch size.
"""

from __future__ import annotations

import json
import re
import signal
from pathlib import Path
from typing import Any

import pytest
from tests.e2e.test_elastic_restarts import Launch, _reached

pytestmark = pytest.mark.e2e

HERE = Path(__file__).parent
TUTORIAL = HERE / "seed_tutorial.py"
GAN = HERE / "seed_gan.py"
N = 96
ENV = {"E2E_N": str(N), "E2E_EPOCHS": "3", "E2E_STEP_SLEEP": "0.3"}


def _printed(log: Path) -> tuple[list[dict[str, Any]], list[str]]:
    """The METRIC lines (as dicts) and PARAMS digests the replicas of one launch printed."""
    # The replicas share torchrun's output: one replica's line may run into another's.
    text = log.read_text(errors="replace")
    decoder = json.JSONDecoder()
    metrics = [decoder.raw_decode(text, m.end())[0] for m in re.finditer("METRIC ", text)]
    params = re.findall("PARAMS ([0-9a-f]{64})", text)
    return metrics, params


def _one_per_key(metrics: list[dict[str, Any]], key: tuple[str, ...]) -> dict[Any, dict[str, Any]]:
    """Metrics by key; every replica printed the very same values (synchronized totals)."""
    out: dict[Any, dict[str, Any]] = {}
    for metric in metrics:
        k = tuple(metric.get(name) for name in key)
        assert out.setdefault(k, metric) == metric, (out[k], metric)
    return out


def _run(
    tmp: Path, script: Path, nproc: int, resume_nproc: int | tuple[int, ...] | None, **env: str
) -> Path:
    """Launch ``script``; with ``resume_nproc``, SIGTERM it mid epoch 1 and resume at that size.

    A tuple of sizes resumes at each in turn: every run but the last is stopped by
    SIGTERM once it has taken two batches, the last runs to the end. Returns the
    directory with the logs (``torchrun-<run>.log``).
    """
    (tmp / "records").mkdir(parents=True)
    launches = []
    try:
        first = Launch(tmp, 0, nproc, script=script, **{**ENV, **env})
        launches.append(first)
        if resume_nproc is None:
            assert first.wait() == 0, first.output()
            return tmp
        first.wait_until(_reached(1, N // 3))
        first.proc.send_signal(signal.SIGTERM)  # torchrun forwards it to its workers
        assert first.wait() != 0, first.output()
        sizes = resume_nproc if isinstance(resume_nproc, tuple) else (resume_nproc,)
        for run, size in enumerate(sizes, start=1):
            launch = Launch(tmp, run, size, script=script, **{**ENV, **env})
            launches.append(launch)
            if run < len(sizes):
                launch.wait_until(lambda records: sum("indices" in r for r in records) >= 2)
                launch.proc.send_signal(signal.SIGTERM)
                assert launch.wait() != 0, launch.output()
        assert launches[-1].wait() == 0, launches[-1].output()
        return tmp
    finally:
        for launch in launches:
            launch.kill()


def _metrics(tmp: Path, key: tuple[str, ...]) -> dict[Any, dict[str, Any]]:
    """Every launch's metrics by key, a later launch's replacing an earlier one's."""
    merged: dict[Any, dict[str, Any]] = {}
    for log in sorted(tmp.glob("torchrun-*.log")):
        merged.update(_one_per_key(_printed(log)[0], key))
    return merged


def _assert_close(resumed: dict[str, Any], whole: dict[str, Any]) -> None:
    for name, value in whole.items():
        if isinstance(value, float):
            assert resumed[name] == pytest.approx(value, rel=1e-4, abs=1e-6), name
        else:
            assert resumed[name] == value, name


def test_a_tutorial_style_program_resumed_at_one_replica_prints_the_same_metrics(
    tmp_path: Path,
) -> None:
    whole = _metrics(_run(tmp_path / "whole", TUTORIAL, 2, None), ("what", "epoch"))
    resumed = _metrics(_run(tmp_path / "stopped", TUTORIAL, 2, 1), ("what", "epoch"))
    expected = [("valid", 0), ("valid", 1), ("valid", 2), ("test", None)]
    assert sorted(whole, key=str) == sorted(expected, key=str)
    assert sorted(resumed, key=str) == sorted(expected, key=str)
    for key, metric in whole.items():
        # Each validation and test total counts every sample once, also in the epoch
        # that resumed (a per-epoch accumulator does not inherit epoch 0's totals).
        assert metric["count"] == N // 2
        _assert_close(resumed[key], metric)


@pytest.mark.parametrize("fsdp", ["0", "1"], ids=["ddp", "fsdp"])
def test_a_stop_and_restart_at_the_same_size_is_bit_identical(tmp_path: Path, fsdp: str) -> None:
    # Under FSDP2 at a fixed batch size, the sharded model and optimiser come back from
    # each replica's DCP shards, and the full parameters gathered at the end match.
    env = {"E2E_DROPOUT": "0.3", "E2E_FSDP": fsdp}
    whole_dir = _run(tmp_path / "whole", TUTORIAL, 2, None, **env)
    stopped_dir = _run(tmp_path / "stopped", TUTORIAL, 2, 2, **env)
    whole_params = _printed(whole_dir / "torchrun-0.log")[1]
    resumed_params = _printed(stopped_dir / "torchrun-1.log")[1]
    assert len(whole_params) == len(resumed_params) == 2
    assert set(resumed_params) == set(whole_params) and len(set(whole_params)) == 1
    whole = _metrics(whole_dir, ("what", "epoch"))
    assert _metrics(stopped_dir, ("what", "epoch")) == whole


def test_a_gan_of_two_models_resumed_at_one_replica_consumes_every_sample(
    tmp_path: Path,
) -> None:
    whole = _metrics(_run(tmp_path / "whole", GAN, 2, None), ("epoch",))
    resumed = _metrics(_run(tmp_path / "stopped", GAN, 2, 1), ("epoch",))
    assert sorted(whole) == sorted(resumed) == [(0,), (1,), (2,)]
    for key, metric in whole.items():
        # One step of progress per batch between the two models: each adaptive epoch
        # walks the whole dataset once (not half of it).
        assert metric["samples"] == N
        assert metric["progress"] == pytest.approx((key[0] + 1) * N / 16)
        _assert_close(resumed[key], metric)
