"""TorchCollective: JSON bytes over torch.distributed, in one process and under torchrun."""

from __future__ import annotations

import json
import os
import subprocess
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from adaptdl.core.collective import maximum
from adaptdl.core.config import JobConfig
from adaptdl.torch import _context
from adaptdl.torch.collective import TorchCollective, collective_timeout
from adaptdl.torch.launch import torchrun_command


def test_needs_a_process_group() -> None:
    with pytest.raises(RuntimeError, match="init_process_group"):
        TorchCollective()


def test_one_replica_round_trips_values() -> None:
    _context.init_process_group("gloo")
    c = _context.current_job().collective
    assert isinstance(c, TorchCollective) and (c.rank, c.num_replicas) == (0, 1)
    value = {"a": [1, 2.5, None, True], "b": "x" * 1000}
    assert c.broadcast(value) == value
    assert c.allgather((1, 2)) == [[1, 2]]
    assert c.allreduce(3.5, maximum) == 3.5
    assert c.allreduce_async({"k": 1}).result() == {"k": 1}
    c.barrier()
    with pytest.raises(ValueError, match="root"):
        c.broadcast(1, root=1)
    with pytest.raises(TypeError, match="cannot travel"):
        c.allreduce(object())


@pytest.mark.parametrize(("raw", "seconds"), [("", 300.0), ("2.5", 2.5)])
def test_timeout_is_the_configs(raw: str, seconds: float) -> None:
    config = JobConfig.from_env({"ADAPTDL_COLLECTIVE_TIMEOUT": raw})
    assert collective_timeout(config) == timedelta(seconds=seconds)


def test_timeout_needs_a_config() -> None:
    # It once read the environment at each call; a mapping is refused, naming the type.
    with pytest.raises(TypeError, match="config must be a JobConfig"):
        collective_timeout({"ADAPTDL_COLLECTIVE_TIMEOUT": "2.5"})  # type: ignore[arg-type]


@pytest.mark.e2e
def test_three_replicas_agree_and_time_out_on_a_missing_peer(tmp_path: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "ADAPTDL_COLLECTIVE_TIMEOUT": "3"}
    script = Path(__file__).with_name("collective_replicas.py")
    command = torchrun_command(script, 3, args=[str(tmp_path)])
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=180)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(3)]
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for r, res in enumerate(results):
        assert res["broadcast"] == {"from": 0}
        assert res["broadcast_big_from_last"] == 2
        assert res["allgather"] == [[q, "y" * (400 * q)] for q in range(3)]
        assert res["sum"] == 6 and res["max"] == 2.0
        assert res["tuple_arrives_as_list"] == [3, 3]
        assert res["async_or"] == [True, True]
        assert res["int_max"] == [[2, 5, -(2**62) + 2, 0]] * 2
        assert res["mixed_max"] == [2, 1.5]
        assert res["async_large"] == 5000
        assert res["held_after_return"] == 0
        assert res.get("timeout") == (None if r == 0 else "CollectiveTimeout")
        assert res.get("failed_hook", "").startswith("" if r == 0 else "stopping after Collective")
    assert not dist.is_initialized()
