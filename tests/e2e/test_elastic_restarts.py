"""End to end: real torchrun jobs stopped by SIGTERM and restarted at other sizes.

One job trains through three runs (on a map-style dataset, again on JSON-lines
shards read as a ShardedDataset, and again with the model sharded by FSDP2): 2
replicas until SIGTERM in epoch 0, 3 replicas (with a DataLoader worker) until
SIGTERM in epoch 1, then 1 replica to the end. From the indices the training
loops actually received we check that every sample of every epoch was consumed
exactly once (padding aside), and from the losses that training went on where it
stopped.
"""

from __future__ import annotations

import collections
import itertools
import json
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from adaptdl.torch.launch import torchrun_command

pytestmark = pytest.mark.e2e

SCRIPT = Path(__file__).with_name("train_elastic.py")
N = 120
EPOCHS = 3
RUN_TIMEOUT = 150.0


def _records(record_dir: Path, run: int | None = None) -> list[dict[str, Any]]:
    out = []
    for path in sorted(record_dir.glob("run*-rank*.jsonl")):
        for line in path.read_text().splitlines():
            if line.strip():
                entry = json.loads(line)
                if run is None or entry["run"] == run:
                    out.append(entry)
    return out


class Launch:
    """One torchrun invocation of the training script, in its own process group."""

    def __init__(
        self, tmp: Path, run: int, nproc: int, *, script: Path = SCRIPT, **env: str
    ) -> None:
        self.tmp = tmp
        self.run = run
        self.log = tmp / f"torchrun-{run}.log"
        full_env = {
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "E2E_RECORD_DIR": str(tmp / "records"),
            "ADAPTDL_CHECKPOINT_PATH": str(tmp / "checkpoints"),
            "E2E_RUN": str(run),
            "E2E_N": str(N),
            "E2E_EPOCHS": str(EPOCHS),
            "E2E_STEP_SLEEP": "0.05",
            **env,
        }
        command = torchrun_command(
            script,
            nproc,
            max_restarts=int(full_env.get("E2E_MAX_RESTARTS", "0")),
            monitor_interval=0.5,
        )
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                command, env=full_env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )

    def output(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]

    def wait_until(self, predicate: Callable[[list[dict[str, Any]]], bool]) -> None:
        deadline = time.monotonic() + RUN_TIMEOUT
        while time.monotonic() < deadline:
            if predicate(_records(self.tmp / "records", self.run)):
                return
            if self.proc.poll() is not None:
                pytest.fail(f"run {self.run} ended before it was stopped:\n{self.output()}")
            time.sleep(0.1)
        pytest.fail(f"run {self.run} did not get there in {RUN_TIMEOUT}s:\n{self.output()}")

    def wait(self) -> int:
        try:
            return self.proc.wait(timeout=RUN_TIMEOUT)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"run {self.run} did not exit:\n{self.output()}")

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def _consumed(records: list[dict[str, Any]], epoch: int) -> collections.Counter[int]:
    """How often each sample of ``epoch`` reached a training loop, padding aside."""
    return collections.Counter(
        i
        for r in records
        if "indices" in r and r["epoch"] == epoch
        for i, pad in zip(r["indices"], r["padding"], strict=True)
        if not pad
    )


def _reached(epoch: int, index: int) -> Callable[[list[dict[str, Any]]], bool]:
    def predicate(records: list[dict[str, Any]]) -> bool:
        return any(
            "indices" in r
            and (r["epoch"] > epoch or (r["epoch"] == epoch and r["index"] >= index))
            for r in records
        )

    return predicate


@pytest.fixture(scope="module", params=["map", "sharded", "fsdp"])
def elastic_job(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Path]:
    """Run the job 2 -> SIGTERM -> 3 -> SIGTERM -> 1 replicas; yield its directory.

    Once on the map-style dataset, once on JSON-lines shards read as a ShardedDataset,
    once with the model sharded by FSDP2 (its checkpoints DCP shards of every replica).
    """
    tmp = tmp_path_factory.mktemp(f"elastic-{request.param}")
    (tmp / "records").mkdir()
    data = {
        "map": {},
        "sharded": {"E2E_SHARDS": str(tmp / "shards")},
        "fsdp": {"E2E_FSDP": "1"},
    }[request.param]
    launches: list[Launch] = []
    try:
        for run, (nproc, stop_at, workers) in enumerate(
            [(2, 0, "0"), (3, 1, "1"), (1, None, "0")]
        ):
            launch = Launch(tmp, run, nproc, E2E_WORKERS=workers, **data)
            launches.append(launch)
            if stop_at is not None:
                launch.wait_until(_reached(stop_at, N // 3))
                # torchrun forwards SIGTERM to its workers, as on a membership change.
                launch.proc.send_signal(signal.SIGTERM)
                assert launch.wait() != 0, launch.output()
            else:
                assert launch.wait() == 0, launch.output()
        yield tmp
    finally:
        for launch in launches:
            launch.kill()


def test_every_sample_of_every_epoch_consumed_exactly_once(elastic_job: Path) -> None:
    batches = [r for r in _records(elastic_job / "records") if "indices" in r]
    assert {r["replicas"] for r in batches} == {1, 2, 3}
    consumed: dict[int, collections.Counter[int]] = collections.defaultdict(collections.Counter)
    padding: dict[int, list[int]] = collections.defaultdict(list)
    for r in batches:
        # The loop received exactly the indices core's sharding assigns to the replica.
        assert r["indices"] == r["expected"], r
        for index, pad in zip(r["indices"], r["padding"], strict=True):
            (padding[r["epoch"]].append(index) if pad else consumed[r["epoch"]].update([index]))
    assert sorted(consumed) == list(range(EPOCHS))
    for epoch in range(EPOCHS):
        assert consumed[epoch] == collections.Counter(range(N)), f"epoch {epoch}"
        # Padding keeps replicas in step: at most one sample per replica per pass end.
        assert len(padding[epoch]) <= 3


def test_preempted_replicas_checkpoint_and_exit_143(elastic_job: Path) -> None:
    exits = [r for r in _records(elastic_job / "records") if "exit" in r]
    by_run = collections.defaultdict(set)
    for r in exits:
        by_run[r["run"]].add((r["rank"], r["exit"]))
    assert by_run[0] == {(0, 143), (1, 143)}
    assert by_run[1] == {(0, 143), (1, 143), (2, 143)}
    assert by_run[2] == {(0, 0)}
    # Every replica stopped with the very same parameters (same steps, same LR factors).
    for run in (0, 1):
        assert len({r["digest"] for r in exits if r["run"] == run}) == 1
    assert len(list((elastic_job / "checkpoints").glob("ckpt-*"))) >= 1


def test_training_resumes_where_it_stopped(elastic_job: Path) -> None:
    records = _records(elastic_job / "records")
    starts = sorted(
        (r for r in records if r.get("start") and r["rank"] == 0), key=lambda r: r["run"]
    )
    assert [s["restored"] is None for s in starts] == [True, False, False]
    # The LR scheduler was restored: StepLR(gamma=0.9) stepped once per finished epoch.
    for s in starts:
        assert s["lr"] == pytest.approx(0.05 * 0.9 ** s["finished_epochs"])
    # The model was restored: each run starts better than the one before.
    losses = [s["full_loss"] for s in starts]
    assert losses[0] > losses[1] > losses[2]
    # And the loss over the whole dataset kept decreasing, epoch after epoch.
    ends = sorted(
        (r for r in records if "epoch_end" in r and r["rank"] == 0), key=lambda r: r["epoch_end"]
    )
    assert [e["epoch_end"] for e in ends] == list(range(EPOCHS))
    curve = [losses[0]] + [e["full_loss"] for e in ends]
    assert all(a > b for a, b in itertools.pairwise(curve)), curve


def test_sigterm_to_one_replica_restarts_the_group_inside_torchrun(tmp_path: Path) -> None:
    """A scheduler signals one worker; torchrun (--max-restarts=1) restarts the group."""
    (tmp_path / "records").mkdir()
    launch = Launch(tmp_path, 0, 2, E2E_EPOCHS="2", E2E_MAX_RESTARTS="1")
    try:
        launch.wait_until(_reached(0, N // 3))
        starts = [r for r in _records(tmp_path / "records") if r.get("start")]
        victim = next(r["pid"] for r in starts if r["rank"] == 1)
        os.kill(victim, signal.SIGTERM)
        assert launch.wait() == 0, launch.output()
    finally:
        launch.kill()
    records = _records(tmp_path / "records")
    exits = {(r["attempt"], r["rank"], r["exit"]) for r in records if "exit" in r}
    assert exits == {(0, 0, 143), (0, 1, 143), (1, 0, 0), (1, 1, 0)}
    restarted = [r for r in records if r.get("start") and r["attempt"] == 1]
    assert len(restarted) == 2 and all(r["restored"] is not None for r in restarted)
    for epoch in range(2):
        assert _consumed(records, epoch) == collections.Counter(range(N)), epoch
