"""End to end: the signals a cluster sends, at any point of a real torchrun job.

Each test launches the training script of `test_elastic_restarts` under torchrun
and signals it as a scheduler or an operator would: SIGTERM twice, SIGTERM to every
process (Slurm's ``scancel``: the agent, every replica and every DataLoader worker),
SIGTERM outside a training loop, SIGINT (Ctrl-C), and a relaunch of a finished job.
Every stop must checkpoint what a relaunch needs and exit 143 (130 for SIGINT),
with no traceback, and the relaunch must consume every sample exactly once.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from tests.e2e.test_elastic_restarts import Launch, N, _consumed, _reached, _records

pytestmark = pytest.mark.e2e

EPOCHS = 2


def descendants(pid: int) -> list[int]:
    """Every living process below ``pid`` (from /proc), parents before children."""
    children: dict[int, list[int]] = collections.defaultdict(list)
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue  # it ended meanwhile
        # The command name may hold spaces and parentheses: the fields follow the last ')'.
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children[ppid].append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(0), []):
            found.append(child)
            todo.append(child)
    return found


def launch(tmp: Path, run: int, nproc: int, **env: str) -> Launch:
    (tmp / "records").mkdir(exist_ok=True)
    return Launch(tmp, run, nproc, E2E_EPOCHS=str(EPOCHS), **env)


def exits(tmp: Path, run: int) -> dict[int, Any]:
    return {r["rank"]: r["exit"] for r in _records(tmp / "records", run) if "exit" in r}


def assert_clean(run: Launch) -> None:
    """No replica or DataLoader worker died with a traceback (torchrun's own may show one)."""
    text = run.log.read_text(errors="replace")
    for sign in ('train_elastic.py", line', "DataLoader worker", "killed by signal", "Interrupt"):
        assert sign not in text, run.output()


def newest_metadata(tmp: Path) -> dict[str, Any]:
    newest = max((tmp / "checkpoints").glob("ckpt-*"), key=lambda p: (len(p.name), p.name))
    return dict(json.loads((newest / "manifest.json").read_text())["metadata"])


def finish_and_check_exactly_once(tmp: Path, run: int) -> None:
    """Relaunch on one replica to the end; every sample of every epoch once over all runs."""
    last = launch(tmp, run, 1)
    try:
        assert last.wait() == 0, last.output()
    finally:
        last.kill()
    records = _records(tmp / "records")
    for epoch in range(EPOCHS):
        assert _consumed(records, epoch) == collections.Counter(range(N)), epoch


def stop(
    tmp: Path,
    send: Callable[[Launch], None],
    code: int = 143,
    until: Callable[[list[dict[str, Any]]], bool] | None = None,
    **env: str,
) -> None:
    """Two replicas, signalled by ``send`` once ``until`` holds: all exit ``code`` promptly.

    Promptly: within a minute (an evaluation or post-processing lasts two); with a
    checkpoint written and no replica or DataLoader worker dead of a traceback.
    """
    first = launch(tmp, 0, 2, **env)
    try:
        first.wait_until(until or _reached(0, N // 3))  # default: a third into epoch 0
        send(first)
        try:
            rc = first.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the job did not end within 60 s of the signal:\n{first.output()}")
        assert rc != 0, first.output()
        # A second SIGTERM interrupts torchrun's wait for its replicas and it exits at
        # once; they run on in their own sessions and finish their checkpoint: give them
        # the rest of the minute (seen on a loaded machine: torchrun ended first).
        deadline = time.monotonic() + 60
        while len(exits(tmp, 0)) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert exits(tmp, 0) == {0: code, 1: code}, first.output()
        assert_clean(first)
        assert list((tmp / "checkpoints").glob("ckpt-*")), "no checkpoint was written"
    finally:
        first.kill()


def signal_agent(*signums: signal.Signals, gap: float = 0.0) -> Callable[[Launch], None]:
    """Send ``signums`` to the torchrun agent, ``gap`` seconds apart."""

    def send(run: Launch) -> None:
        for i, signum in enumerate(signums):
            if i:
                time.sleep(gap)
            run.proc.send_signal(signum)

    return send


def signal_everyone(run: Launch) -> None:
    """scancel: SIGTERM to every process of the job, twice."""
    everyone = [run.proc.pid, *descendants(run.proc.pid)]
    assert len(everyone) >= 1 + 2 + 2 * 2, everyone  # agent, replicas, their workers
    for _ in range(2):
        for pid in everyone:
            with contextlib.suppress(ProcessLookupError):  # ended meanwhile
                os.kill(pid, signal.SIGTERM)
        time.sleep(0.2)


@pytest.mark.parametrize("gap", [0.0, 0.3])
def test_two_sigterms_to_torchrun_with_dataloader_workers_checkpoint_and_exit_143(
    tmp_path: Path, gap: float
) -> None:
    """torchrun forwards each SIGTERM to every process group of its replicas."""
    # Slow steps: the replicas still run when torchrun forwards the second SIGTERM.
    send = signal_agent(signal.SIGTERM, signal.SIGTERM, gap=gap)
    stop(tmp_path, send, E2E_WORKERS="2", E2E_STEP_SLEEP="0.5")
    finish_and_check_exactly_once(tmp_path, 1)


def test_slurm_style_sigterm_to_every_process_twice_checkpoints_and_exits_143(
    tmp_path: Path,
) -> None:
    """scancel signals every process of the job: agent, replicas and DataLoader workers."""
    stop(tmp_path, signal_everyone, E2E_WORKERS="2")
    finish_and_check_exactly_once(tmp_path, 1)


def test_sigint_checkpoints_and_exits_130(tmp_path: Path) -> None:
    """Ctrl-C: torchrun forwards SIGINT; every replica checkpoints and exits 130."""
    stop(tmp_path, signal_agent(signal.SIGINT), 130, E2E_WORKERS="1")
    finish_and_check_exactly_once(tmp_path, 1)


@pytest.mark.parametrize("second", [False, True])
def test_sigterm_during_a_long_evaluation_ends_within_the_stop_wait_with_143(
    tmp_path: Path, second: bool
) -> None:
    """Outside any training loop (an evaluation between epochs of two minutes) SIGTERM is
    not swallowed: the replicas wait ``ADAPTDL_STOP_WAIT`` seconds for each other, or
    until a second SIGTERM, then rank 0 writes the checkpoint alone and all exit 143."""

    def evaluating(records: list[dict[str, Any]]) -> bool:
        return any("evaluating" in r for r in records)

    if second:  # a scheduler insisting: the second signal ends the wait
        send, wait = signal_agent(signal.SIGTERM, signal.SIGTERM, gap=2.0), "300"
    else:
        send, wait = signal_agent(signal.SIGTERM), "2"
    stop(tmp_path, send, until=evaluating, E2E_EVAL_SLEEP="120", ADAPTDL_STOP_WAIT=wait)
    text = (tmp_path / "torchrun-0.log").read_text(errors="replace")
    assert ("second stop signal" if second else "did not meet within 2 s") in text, text
    finish_and_check_exactly_once(tmp_path, 1)


def test_a_finished_training_writes_a_final_checkpoint_and_a_relaunch_trains_nothing(
    tmp_path: Path,
) -> None:
    """SIGTERM in the post-processing after the last epoch, then a relaunch."""

    def post(records: list[dict[str, Any]]) -> bool:
        return any(r.get("post") for r in records)

    stop(tmp_path, signal_agent(signal.SIGTERM), until=post, E2E_POST_SLEEP="120")
    assert newest_metadata(tmp_path)["finished_epochs"] == EPOCHS
    again = launch(tmp_path, 1, 2)
    try:
        assert again.wait() == 0, again.output()
    finally:
        again.kill()
    records = _records(tmp_path / "records", 1)
    assert not [r for r in records if "indices" in r], "a finished job trained again"
    assert [r["finished_epochs"] for r in records if r.get("post")] == [EPOCHS, EPOCHS]


@pytest.mark.parametrize("data", ["map", "sharded"])
def test_a_batch_larger_than_a_replicas_share_with_drop_last_is_an_error_not_a_hang(
    tmp_path: Path, data: str
) -> None:
    extra = {"E2E_SHARDS": str(tmp_path / "shards")} if data == "sharded" else {}
    run = launch(tmp_path, 0, 2, E2E_DROP_LAST="1", E2E_BATCH_SIZE=str(2 * N), **extra)
    try:
        assert run.proc.wait(timeout=90) != 0, run.output()
    except subprocess.TimeoutExpired:
        pytest.fail(f"the loop never ended:\n{run.output()}")
    finally:
        run.kill()
    text = run.log.read_text(errors="replace")
    assert "ValueError" in text and "drop_last" in text, run.output()
    assert f"{N} samples" in text, run.output()


def checkpoint_labels(tmp: Path) -> list[str]:
    return sorted(
        (p.name for p in (tmp / "checkpoints").glob("ckpt-*")), key=lambda n: (len(n), n)
    )


@pytest.mark.parametrize(("nproc", "held"), [(2, True), (3, False)])
def test_sigterm_during_an_evaluation_between_epochs_stops_every_replica_together(
    tmp_path: Path, nproc: int, held: bool
) -> None:
    """Issue 39: SIGTERM while the program evaluates between epochs with an Accumulator.

    ``held``: only rank 0 evaluates (as a busy machine holds one replica after it
    printed an epoch's row), the others already wait at the next epoch. Every replica
    must meet where the epoch loop moves on, checkpoint there and exit 143; the next
    run resumes at the next epoch's first sample, and every sample is consumed once.
    """
    env = {"E2E_ACCUMULATOR": "1", "E2E_EVAL_SLEEP": "4", "ADAPTDL_CHECKPOINT_STEPS": "3"}
    if held:
        env["E2E_EVAL_RANK0"] = "1"
    first = launch(tmp_path, 0, nproc, **env)
    try:
        first.wait_until(lambda records: any(r.get("evaluating") == 0 for r in records))
        before = checkpoint_labels(tmp_path)
        assert before, "no periodic checkpoint before the evaluation"
        first.proc.send_signal(signal.SIGTERM)
        try:
            first.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the job did not end within 60 s of the signal:\n{first.output()}")
        deadline = time.monotonic() + 60
        while len(exits(tmp_path, 0)) < nproc and time.monotonic() < deadline:
            time.sleep(0.2)
        assert exits(tmp_path, 0) == dict.fromkeys(range(nproc), 143), first.output()
        assert_clean(first)
        text = first.log.read_text(errors="replace")
        assert "CollectiveError" not in text and "without a checkpoint" not in text, text
        after = checkpoint_labels(tmp_path)
        assert (len(after[-1]), after[-1]) > (len(before[-1]), before[-1]), (before, after)
        assert newest_metadata(tmp_path)["finished_epochs"] == 1
        assert "checkpointing in epoch 1" in text, first.output()
    finally:
        first.kill()
    trained = [r for r in _records(tmp_path / "records", 0) if "indices" in r]
    assert {r["epoch"] for r in trained} == {0}  # stopped before epoch 1 trained
    second = launch(tmp_path, 1, 1, E2E_ACCUMULATOR="1")  # one replica: quicker
    try:
        assert second.wait() == 0, second.output()
    finally:
        second.kill()
    resumed = [r for r in _records(tmp_path / "records", 1) if "indices" in r]
    assert min((r["epoch"], r["index"]) for r in resumed) == (1, 0)
    records = _records(tmp_path / "records")
    for epoch in range(EPOCHS):
        assert _consumed(records, epoch) == collections.Counter(range(N)), epoch
