"""End to end: one job on two torchrun agents of this machine, a node joining, then lost.

Two agents run as two nodes of one elastic job (``--nnodes=1:2``, c10d rendezvous
on one free port, one replica each), started and lost through `faults.nodes`, the
launcher ``python -m faults`` uses too. Node a trains alone; node b joins, and
the job resumes at 2 replicas from the checkpoint a's replica wrote when torchrun
stopped it; node b is then lost (its agent and its replica SIGKILLed) and a
trains alone to the end. The script is the fault harness's (``faults/train.py``):
every replica records the indices its loop received. With a checkpoint at every
step, and the replicas standing before a step when the node is lost, nothing
after the newest checkpoint was recorded, so every sample of every epoch should
appear exactly once (padding aside); a repeat is allowed only as a replay the job
counted (the survivor may be inside a step when the loss reaches it).
"""

from __future__ import annotations

import collections
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from faults.nodes import ElasticNodes, alive
from faults.run import SCRIPT, read_records

pytestmark = pytest.mark.e2e

N = 48
EPOCHS = 2
BATCH_SIZE = 4
HOLD_FROM = 3  # each replica process stands before its 4th step while the hold file exists
TIMEOUT = 180.0  # seconds for each phase (a torch import takes 20 s on a loaded machine)


class Job:
    """The two-node job's directory, its launcher and what the test measured."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.records = tmp / "records"
        self.records.mkdir()
        self.hold = tmp / "hold"
        self.hold.touch()
        env = {
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1",
            "FAULTS_RECORD_DIR": str(self.records),
            "FAULTS_N": str(N),
            "FAULTS_EPOCHS": str(EPOCHS),
            "FAULTS_BATCH_SIZE": str(BATCH_SIZE),
            "FAULTS_STEP_SLEEP": "0.02",
            "FAULTS_HOLD_FILE": str(self.hold),
            "FAULTS_HOLD_FROM": str(HOLD_FROM),
            "ADAPTDL_CHECKPOINT_PATH": str(tmp / "checkpoints"),
            "ADAPTDL_CHECKPOINT_STEPS": "1",
            "ADAPTDL_CHECKPOINT_INTERVAL": "0",
            "ADAPTDL_JOB_ID": "two-nodes",
        }
        self.nodes = ElasticNodes(SCRIPT, tmp, env, max_restarts=3)
        self.lost_pids: set[int] = set()
        self.seconds: dict[str, float] = {}

    def steps(self, replicas: int | None = None, after: float = 0.0) -> list[dict[str, Any]]:
        return sorted(
            (
                r
                for r in read_records(self.records)
                if "indices" in r and replicas in (None, r["replicas"]) and r["t"] > after
            ),
            key=lambda r: r["t"],
        )

    def wait_for(self, what: str, predicate: Callable[[], Any]) -> Any:
        deadline = time.monotonic() + TIMEOUT
        while time.monotonic() < deadline:
            found = predicate()
            if found:
                return found
            if self.nodes.nodes["a"].proc.poll() is not None:
                break
            time.sleep(0.05)
        logs = "\n".join(f"--- node {n}:\n{node.output()}" for n, node in self.nodes.nodes.items())
        pytest.fail(f"the job did not reach {what}:\n{logs}")

    def run(self) -> None:
        nodes = self.nodes
        nodes.start("a")
        self.wait_for("a step of node a", lambda: self.steps(1))
        joined = time.time()
        nodes.start("b")
        first = self.wait_for("a step at 2 replicas", lambda: self.steps(2))[0]
        self.seconds["join"] = first["t"] - joined
        # Both replicas stand before their 4th step at 2 replicas, past a checkpoint.
        self.wait_for("both replicas standing", lambda: len(self.steps(2)) >= 2 * HOLD_FROM)
        lost = time.time()
        self.lost_pids = nodes.lose("b")
        self.hold.unlink()
        first = self.wait_for("a step at 1 replica after the loss", lambda: self.steps(1, lost))[0]
        self.seconds["loss"] = first["t"] - lost
        rc = nodes.wait("a", TIMEOUT)
        assert rc == 0, nodes.nodes["a"].output()


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Job]:
    job = Job(tmp_path_factory.mktemp("two-nodes"))
    try:
        job.run()
        yield job
    finally:
        job.nodes.kill()


def test_the_job_trains_at_1_then_2_then_1_replicas(
    two_nodes: Job, capsys: pytest.CaptureFixture[str]
) -> None:
    sizes = [r["replicas"] for r in two_nodes.steps()]
    changes = [s for i, s in enumerate(sizes) if i == 0 or sizes[i - 1] != s]
    assert changes == [1, 2, 1]
    nodes_at_2 = {r["node"] for r in two_nodes.steps(2)}
    assert nodes_at_2 == {"a", "b"}
    with capsys.disabled():
        print(
            f"\ntwo nodes: node b started -> first step at 2 replicas "
            f"{two_nodes.seconds['join']:.1f} s; node b lost -> first step at 1 replica "
            f"{two_nodes.seconds['loss']:.1f} s"
        )


def test_every_sample_of_every_epoch_consumed_once_or_replayed_and_counted(two_nodes: Job) -> None:
    consumed: dict[int, collections.Counter[int]] = collections.defaultdict(collections.Counter)
    for r in two_nodes.steps():
        for index, pad in zip(r["indices"], r["padding"], strict=True):
            if not pad:
                consumed[r["epoch"]][index] += 1
    repeated = 0
    for epoch in range(EPOCHS):
        assert set(consumed[epoch]) == set(range(N)), f"epoch {epoch}: samples lost"
        repeated += sum(count - 1 for count in consumed[epoch].values())
    # Standing before a step, past a checkpoint, the node's loss repeats nothing; on a
    # loaded machine the survivor may be inside a step when its peer dies: those samples
    # are trained again after the restart, and the job must have counted them.
    (final,) = [r for r in read_records(two_nodes.records) if r.get("exit") == 0]
    assert repeated <= final["replayed"], (repeated, final["replayed"])


def test_each_membership_change_resumes_from_the_newest_checkpoint(two_nodes: Job) -> None:
    records = sorted(read_records(two_nodes.records), key=lambda r: r["t"])
    newest = None
    starts = []
    for r in records:
        if "saved" in r:
            newest = r["saved"]
        elif r.get("start"):
            starts.append(r)
            assert r["restored"] == newest, r
    # a alone; a and b at 2; a alone again, after torchrun restarted its replica.
    assert (starts[0]["node"], starts[0]["replicas"], starts[0]["restart"]) == ("a", 1, 0)
    assert sorted((s["node"], s["replicas"]) for s in starts) == [
        ("a", 1),
        ("a", 1),
        ("a", 2),
        ("b", 2),
    ]
    # Joining stopped a's replica at a step boundary with a checkpoint (exit 143).
    exits = [(r["node"], r["replicas"], r["exit"]) for r in records if "exit" in r]
    assert exits == [("a", 1, 143), ("a", 1, 0)]
    final = [r for r in records if r.get("exit") == 0]
    assert final[0]["finished_epochs"] == EPOCHS


def test_the_lost_node_left_no_process_behind(two_nodes: Job) -> None:
    records = read_records(two_nodes.records)
    (b_replica,) = [r["pid"] for r in records if r.get("start") and r["node"] == "b"]
    assert b_replica in two_nodes.lost_pids, "the lost node's replica was not among its processes"
    assert not [pid for pid in two_nodes.lost_pids if alive(pid)]
