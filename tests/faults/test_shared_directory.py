"""Two jobs on one checkpoint directory, with real processes, and a model whose shapes changed.

A job holds a lock on its checkpoint directory for its whole life: a second job
started on the same directory is refused at once, naming the directory and the
job that holds it, and touches none of its files.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from torch.utils.data import TensorDataset

import adaptdl.torch as adl
import torch
from adaptdl.core.loop.boundary import Preempted
from adaptdl.core.persist.checkpoint import CheckpointError
from adaptdl.torch import _context

HOLD = textwrap.dedent(
    """
    import sys
    import adaptdl.torch as adl
    from adaptdl.torch import _context
    adl.init_process_group("gloo")
    job = _context.current_job()
    job.checkpoint()
    print("ready", flush=True)
    sys.stdin.read()  # hold the directory until the test closes stdin
    """
)


def start(code: str, root: Path, job_id: str, **extra: str) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ADAPTDL_", "RANK", "WORLD"))}
    env.update(ADAPTDL_CHECKPOINT_PATH=str(root), ADAPTDL_JOB_ID=job_id, **extra)
    return subprocess.Popen(
        [sys.executable, "-c", code],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def snapshot(root: Path) -> dict[str, tuple[int, int]]:
    return {
        str(p.relative_to(root)): (p.stat().st_mtime_ns, p.stat().st_size)
        for p in sorted(root.rglob("*"))
    }


def test_a_second_job_on_the_same_directory_is_refused_and_touches_nothing(
    tmp_path: Path,
) -> None:
    root = tmp_path / "ckpt"
    first = start(HOLD, root, "job-a")
    try:
        assert first.stdout is not None and first.stdout.readline().strip() == "ready"
        before = snapshot(root)
        second = start(HOLD, root, "job-b")
        _, err = second.communicate(input="", timeout=120)
        assert second.returncode != 0
        assert f"'{root}'" in err and "'job-a'" in err and "in use" in err, err
        assert snapshot(root) == before
    finally:
        first.communicate(input="", timeout=120)
    assert first.returncode == 0


def test_a_relaunch_of_the_same_job_waits_for_the_previous_run(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    first = start(HOLD, root, "job-a")
    assert first.stdout is not None and first.stdout.readline().strip() == "ready"
    relaunch = start(HOLD, root, "job-a", ADAPTDL_COLLECTIVE_TIMEOUT="60")
    first.communicate(input="", timeout=120)  # the previous run ends while the relaunch waits
    out, err = relaunch.communicate(input="", timeout=120)
    assert relaunch.returncode == 0, err
    assert "ready" in out


def train(model: torch.nn.Module, stop_after: int | None) -> None:
    adl.init_process_group("gloo")
    job = _context.current_job()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    adp = adl.AdaptiveDataParallel(model, optimizer)
    data = TensorDataset(torch.arange(8), torch.randn(8, 2))
    loader = adl.AdaptiveDataLoader(data, batch_size=4)
    try:
        for _ in adl.remaining_epochs_until(1):
            for step, (_, x) in enumerate(loader):
                optimizer.zero_grad()
                adp(x).sum().backward()
                optimizer.step()
                if step + 1 == stop_after:
                    job.request_stop()
    finally:
        _context._reset()


def test_a_model_whose_shapes_changed_names_the_checkpoint_and_the_entry(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ADAPTDL_CHECKPOINT_PATH", str(tmp_path / "ckpt"))
    with pytest.raises(Preempted):
        train(torch.nn.Linear(2, 1), stop_after=1)
    with pytest.raises(CheckpointError) as info:
        train(torch.nn.Linear(2, 3), stop_after=None)
    message = str(info.value)
    assert "ckpt-000001" in message and "adaptdl-dataparallel" in message, message
    assert "size mismatch" in message, message


START = textwrap.dedent(
    """
    import adaptdl.torch as adl
    adl.init_process_group("gloo")
    print("restored", adl._context.current_job().restored_from, flush=True)
    """
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_replicas_that_see_different_checkpoints_fail_naming_both_never_hang(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two real replicas; rank 1's directory lacks the newest checkpoint (a stale view)."""
    root = tmp_path / "ckpt"
    monkeypatch.setenv("ADAPTDL_CHECKPOINT_PATH", str(root))
    monkeypatch.setenv("ADAPTDL_JOB_ID", "job-a")
    adl.init_process_group("gloo")
    job = _context.current_job()
    job.checkpoint()
    job.checkpoint()
    _context._reset()
    stale = tmp_path / "stale"
    shutil.copytree(root / "ckpt-000001", stale / "ckpt-000001")
    port = str(free_port())
    replicas = [
        start(
            START,
            root if rank == 0 else stale,
            "job-a",
            RANK=str(rank),
            WORLD_SIZE="2",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=port,
            ADAPTDL_COLLECTIVE_TIMEOUT="600",  # a hang would outlast the test's timeout
        )
        for rank in (0, 1)
    ]
    for replica in replicas:
        _, err = replica.communicate(input="", timeout=240)
        assert replica.returncode != 0, err
        assert "CheckpointError" in err and "replica 1 does not see checkpoint" in err, err
        assert "ckpt-000002" in err and "ckpt-000001" in err, err
