"""The fault-injection harness: randomised trials of real torchrun jobs on CPU with gloo.

Each trial trains the tiny job in ``faults/train.py`` to the end through one kind of
fault, chosen from :data:`KINDS`:

``kill``            SIGKILL of a random replica at a random step (once or twice);
                    torchrun (``--max-restarts``) restarts the group, which resumes
                    from the newest periodic checkpoint.
``kill_in_save``    SIGKILL while rank 0 is inside a checkpoint write (rank 0, or a
                    replica waiting for it); torchrun restarts the group.
``double_sigterm``  two SIGTERMs to torchrun, at a random step or while rank 0 is
                    inside a checkpoint write; every replica must checkpoint and
                    exit 143; the job is then relaunched at a random size.
``double_sigterm_workers``
                    the same, at a random step, with two DataLoader workers per
                    replica (torchrun forwards each SIGTERM to a replica's whole
                    process group, its workers included): the workers must live
                    through the second signal (issue 12, item 4).
``slurm_sigterm``   SIGTERM to every process of the job at once (torchrun, the
                    replicas and their DataLoader workers, 0 or 2 each), as Slurm's
                    ``scancel`` does; torchrun forwards it to the replicas again.
                    Every replica must checkpoint and exit 143; then a relaunch.
``sigterm_between_loops``
                    SIGTERM to torchrun while the program evaluates between epochs
                    (inside an ``Accumulator``'s ``synchronized()``, every replica,
                    or rank 0 alone while the others wait at the next epoch), at 2
                    or 3 replicas: every replica must meet the others where the
                    epoch loop moves on (or ends), checkpoint there with every
                    sample consumed, and exit 143; the relaunch repeats no sample
                    (issue 39).
``enospc``          the disk fills up during a checkpoint write (injected ENOSPC);
                    the job fails with a clear error, torchrun restarts it, and it
                    resumes from the previous complete checkpoint.
``sharded_write``   the model is sharded with FSDP2 and its checkpoints are DCP
                    shard files every replica writes through the checkpoint storage;
                    the storage damages those writes. Alternately: the disk fills up
                    in a random replica's shard (or DCP metadata) write (ENOSPC): the
                    save fails on every replica, torchrun restarts the job, and it
                    resumes from the previous complete checkpoint; or the storage
                    commits the second checkpoint and loses half of one shard file
                    (the rename reached the disk, the data did not), a replica is
                    then SIGKILLed, and the restart must find the damage and resume
                    from the checkpoint before it, counting the replay.
``resize``          SIGTERM and relaunch at another number of replicas, twice.
``hang``            SIGSTOP of a random replica: the others must stop within the
                    collective timeout (``ADAPTDL_COLLECTIVE_TIMEOUT``), not hang;
                    torchrun then restarts the group.
``second_job``      another job on the same checkpoint directory: a torchrun launch
                    of another job id is refused at start, naming the directory and
                    this job; files of another job (a checkpoint, a save in
                    progress, its journal) appear in the directory as on a file
                    system that ignores the lock; a replica is then SIGKILLed so the
                    restart must resume past them from this job's own checkpoint.
                    None of the other job's files may be touched.
``node``            a node joining and leaving through torchrun's c10d rendezvous
                    (`faults.nodes`): node a trains alone; node b starts, and the
                    job resumes at 2 replicas from the checkpoint a's replica wrote
                    when torchrun stopped it; then node b is lost (its agent and its
                    replica SIGKILLed, while standing at a step or while training),
                    and a continues alone to the end from the newest checkpoint.

After every torchrun launch the checkpoint directory must hold a loadable
checkpoint. After every trial: the job finished all its epochs; every sample of
every epoch was consumed at least once; samples were repeated only by the replay
after a crash, which the library counted (``job.replayed_samples``).

Run ``python -m faults --trials 50 --jobs 3 --seed S`` (or ``python faults/run.py``). It
prints the seed, one row per trial, a summary table, and the time of a step
boundary that wrote a checkpoint next to the time of the checkpoint and of the
store's write, and exits non-zero if any trial failed.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import contextlib
import itertools
import json
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs

from adaptdl.core.persist.checkpoint import CheckpointError, CheckpointStore
from adaptdl.core.persist.journal import Journal, Mark, journal_name
from adaptdl.core.persist.localfs import LocalStorage
from adaptdl.core.persist.manifest import MANIFEST
from adaptdl.core.persist.storage import TMP_PREFIX, owner_tag
from adaptdl.torch.launch import torchrun_command
from faults.nodes import ElasticNodes, alive, descendants

SCRIPT = Path(__file__).with_name("train.py")
KINDS = (
    "kill",
    "kill_in_save",
    "double_sigterm",
    "double_sigterm_workers",
    "slurm_sigterm",
    "sigterm_between_loops",
    "enospc",
    "sharded_write",
    "resize",
    "hang",
    "second_job",
    "node",
)
# Kinds that find a fault of the library not fixed on this branch: the trial stays
# honest (it fails, and the table says so); the report names the fault. Remove an
# entry once its fix is merged.
KNOWN_LIBRARY_FAULTS: dict[str, str] = {}
JOB_ID = "faults-job"
OTHER_JOB = "faults-other-job"  # the job a `second_job` trial puts beside this one
EPOCHS = 2
WAIT_TIMEOUT = 300.0  # seconds a launch may take to reach a point or to exit: a hang
# (a restart took 55 s at load average 29 with three trials at a time; 120 s timed out)
HANG_TIMEOUT = 5.0  # the collective timeout of a `hang` trial
HANG_SLACK = 25.0  # survivors must stop within HANG_TIMEOUT + this (process teardown)


class TrialFailure(AssertionError):
    """A trial broke one of the properties the harness checks."""


@attrs.define
class Result:
    """What one trial did and found."""

    index: int
    kind: str
    seed: int
    detail: str = ""
    launches: int = 0
    restarts: int = 0
    finished: bool = False
    lost: int = 0
    repeated: int = 0
    replayed: int = 0
    checkpoint_checks: int = 0
    foreign_touched: int | None = None  # files of another job changed (second_job trials)
    stop_seconds: float | None = None
    join_seconds: float | None = None  # node trials: node b started -> a step at 2 replicas
    loss_seconds: float | None = None  # node b lost -> a step at 1 replica
    seconds: float = 0.0
    error: str | None = None
    timings: list[dict[str, float]] = attrs.field(factory=list)


# --------------------------------------------------------------------------- records


def read_records(record_dir: Path, run: int | None = None) -> list[dict[str, Any]]:
    """Every JSON line the training script wrote (a line cut by SIGKILL is skipped)."""
    out = []
    for path in sorted(record_dir.glob("run*-restart*-rank*.jsonl")):
        for line in path.read_text().splitlines():
            try:
                entry = json.loads(line)
            except ValueError:
                continue
            if run is None or entry["run"] == run:
                out.append(entry)
    return out


class Launch:
    """One torchrun invocation of the training script, in its own process group."""

    def __init__(
        self, trial: Trial, nproc: int, max_restarts: int, env: dict[str, str] | None = None
    ) -> None:
        self.trial = trial
        self.run = len(trial.launches)
        self.nproc = nproc
        self.log = trial.dir / f"torchrun-{self.run}.log"
        full_env = {**trial.env, "FAULTS_RUN": str(self.run), **(env or {})}
        command = torchrun_command(SCRIPT, nproc, max_restarts=max_restarts, monitor_interval=0.2)
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                command, env=full_env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        trial.launches.append(self)

    def records(self) -> list[dict[str, Any]]:
        return read_records(self.trial.records, self.run)

    def output(self) -> str:
        return self.log.read_text(errors="replace")[-3000:]

    def fail(self, message: str) -> TrialFailure:
        return TrialFailure(f"run {self.run}: {message}\n--- torchrun log tail:\n{self.output()}")

    def wait_for(self, what: str, predicate: Callable[[list[dict[str, Any]]], Any]) -> Any:
        """Poll the records until ``predicate`` returns something true; return it."""
        deadline = time.monotonic() + WAIT_TIMEOUT
        while time.monotonic() < deadline:
            found = predicate(self.records())
            if found:
                return found
            if self.proc.poll() is not None:
                raise self.fail(f"ended (rc {self.proc.returncode}) before {what}")
            time.sleep(0.05)
        raise self.fail(f"did not reach {what} in {WAIT_TIMEOUT}s (hang?)")

    def attempt(self) -> int:
        """The newest torchrun attempt (restart count) that has started records."""
        return max((r["restart"] for r in self.records() if r.get("start")), default=0)

    def pids(self) -> dict[int, int]:
        """rank -> pid of the newest attempt, once all its replicas have started."""

        def started(records: list[dict[str, Any]]) -> dict[int, int] | None:
            if not records:
                return None
            newest = max((r["restart"] for r in records if r.get("start")), default=-1)
            pids = {
                r["rank"]: r["pid"] for r in records if r.get("start") and r["restart"] == newest
            }
            return pids if len(pids) == self.nproc else None

        return self.wait_for("all replicas started", started)  # type: ignore[no-any-return]

    def wait_steps(self, steps: int, restart: int | None = None) -> None:
        """Wait until rank 0 took ``steps`` steps in this launch (in attempt ``restart``)."""

        def reached(records: list[dict[str, Any]]) -> bool:
            return (
                sum(
                    1
                    for r in records
                    if "indices" in r
                    and r["rank"] == 0
                    and (restart is None or r["restart"] == restart)
                )
                >= steps
            )

        self.wait_for(f"{steps} steps", reached)

    def wait_in_save(self) -> int:
        """Wait until rank 0 pauses inside a checkpoint write; return its pid."""
        marker = self.trial.records / f"in-save-run{self.run}"

        def inside(_: list[dict[str, Any]]) -> int | None:
            try:
                return int(marker.read_text())
            except (OSError, ValueError):
                return None

        return self.wait_for("a checkpoint write", inside)  # type: ignore[no-any-return]

    def wait(self) -> int:
        try:
            return self.proc.wait(timeout=WAIT_TIMEOUT)
        except subprocess.TimeoutExpired:
            self.kill()
            raise self.fail(f"did not exit in {WAIT_TIMEOUT}s (hang)") from None

    def kill(self) -> None:
        """End torchrun and every worker it started (each runs in its own session)."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        for r in self.records():
            if r.get("start") and alive(r["pid"]) and self._ours(r["pid"]):
                _kill(r["pid"], signal.SIGKILL)

    def _ours(self, pid: int) -> bool:
        """Whether ``pid`` is still a worker of this trial (pids get reused)."""
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = f.read().split(b"\0")
        except OSError:
            return False
        return f"FAULTS_RECORD_DIR={self.trial.records}".encode() in env


class NodesLaunch(Launch):
    """Two torchrun agents, nodes ``a`` and ``b``, of one elastic job: one launch of a trial.

    Node ``a`` starts at once and hosts the rendezvous; `ElasticNodes` starts ``b``
    and loses it. The launch's process (what it waits for) is node ``a``'s agent.
    """

    def __init__(self, trial: Trial, env: dict[str, str]) -> None:
        self.trial = trial
        self.run = len(trial.launches)
        self.nproc = 1  # replicas per node
        self.hold = trial.dir / f"hold-run{self.run}"
        full_env = {
            **trial.env,
            "FAULTS_RUN": str(self.run),
            "FAULTS_HOLD_FILE": str(self.hold),
            **env,
        }
        self.nodes = ElasticNodes(SCRIPT, trial.dir, full_env, max_restarts=3)
        self.hold.touch()
        node = self.nodes.start("a")
        self.proc = node.proc
        self.log = node.log
        trial.launches.append(self)

    def output(self) -> str:
        return "\n".join(
            f"--- node {name}:\n{node.output(2000)}" for name, node in self.nodes.nodes.items()
        )

    def steps(self, replicas: int | None = None, after: float = 0.0) -> list[dict[str, Any]]:
        """The steps taken (at ``replicas`` replicas) since time ``after``, oldest first."""
        return sorted(
            (
                r
                for r in self.records()
                if "indices" in r and replicas in (None, r["replicas"]) and r["t"] > after
            ),
            key=lambda r: r["t"],
        )

    def sizes(self) -> list[int]:
        """The numbers of replicas the job trained at, in order (each change once)."""
        return [size for size, _ in itertools.groupby(r["replicas"] for r in self.steps())]

    def kill(self) -> None:
        self.nodes.kill()
        super().kill()


# --------------------------------------------------------------------------- trials


class Trial:
    """One job in its own directory, trained to the end through one kind of fault."""

    def __init__(self, index: int, kind: str, seed: int, root: Path, occurrence: int = 0) -> None:
        self.rng = random.Random(seed)
        # Which trial of its kind this is: variants of a kind alternate, so all are run.
        self.occurrence = occurrence
        self.result = Result(index=index, kind=kind, seed=seed)
        self.dir = root / f"trial-{index:03d}-{kind}"
        self.records = self.dir / "records"
        self.checkpoints = self.dir / "checkpoints"
        self.records.mkdir(parents=True)
        self.n = self.rng.choice([40, 48, 64])
        self.batch_size = self.rng.choice([4, 8])
        self.every_steps = self.rng.randint(2, 4)
        self.launches: list[Launch] = []
        self.env = {
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1",
            "FAULTS_RECORD_DIR": str(self.records),
            "FAULTS_N": str(self.n),
            "FAULTS_EPOCHS": str(EPOCHS),
            "FAULTS_BATCH_SIZE": str(self.batch_size),
            "FAULTS_STEP_SLEEP": "0.05",
            "ADAPTDL_CHECKPOINT_PATH": str(self.checkpoints),
            "ADAPTDL_CHECKPOINT_STEPS": str(self.every_steps),
            "ADAPTDL_CHECKPOINT_INTERVAL": "0",
            "ADAPTDL_JOB_ID": JOB_ID,
            "ADAPTDL_COLLECTIVE_TIMEOUT": "30",
        }
        self.result.detail = f"n={self.n} bs={self.batch_size} ckpt/{self.every_steps}"

    # -- helpers ---------------------------------------------------------------------
    def procs(self, lo: int = 1, hi: int = 3, other_than: int | None = None) -> int:
        choices = [p for p in range(lo, hi + 1) if p != other_than]
        return self.rng.choice(choices)

    def steps_per_epoch(self, nproc: int) -> int:
        """Optimiser steps in an epoch at ``nproc`` replicas (the batch splits evenly, up)."""
        local = -(-self.batch_size // nproc)
        return -(-self.n // (local * nproc))

    def step_target(self, nproc: int) -> int:
        """A random step of the job before its last four (the harness polls; leave it time)."""
        total = self.steps_per_epoch(nproc) * EPOCHS
        return self.rng.randint(1, max(1, total - 4))

    def finish(self, launch: Launch) -> None:
        """Wait for ``launch`` to end and require success."""
        rc = launch.wait()
        self.check_checkpoints(launch)
        if rc != 0:
            raise launch.fail(f"torchrun exited with {rc}, expected 0")

    def check_checkpoints(self, launch: Launch) -> None:
        """The checkpoint directory holds a loadable checkpoint (once one was written)."""
        store = CheckpointStore(self.checkpoints, job_id=JOB_ID)
        try:
            loaded = store.load()
        except CheckpointError as exc:
            raise launch.fail(f"no loadable checkpoint: {exc}") from exc
        written = any("checkpoint_s" in r for r in read_records(self.records))
        if written and loaded is None:
            raise launch.fail("checkpoints were written but none is there")
        own = [label for label in store.labels() if _job_of(self.checkpoints / label) == JOB_ID]
        if len(own) > store.keep:
            raise launch.fail(f"more than {store.keep} checkpoints: {own}")
        self.result.checkpoint_checks += 1

    def signal_torchrun(self, launch: Launch, times: int) -> None:
        for i in range(times):
            if i:
                time.sleep(self.rng.uniform(0.0, 0.6))
            if launch.proc.poll() is None:
                launch.proc.send_signal(signal.SIGTERM)

    def stopped(self, launch: Launch) -> None:
        """``launch`` got SIGTERM: every replica of its last attempt checkpointed, exit 143."""
        rc = launch.wait()
        self.check_checkpoints(launch)
        if rc == 0:
            return  # the job finished before the signal arrived
        attempt = launch.attempt()
        exits = {
            r["rank"]: r["exit"]
            for r in launch.records()
            if "exit" in r and r["restart"] == attempt
        }
        if exits != dict.fromkeys(range(launch.nproc), 143):
            raise launch.fail(f"after SIGTERM the replicas exited with {exits}, not all 143")
        # The newest checkpoint is the one of the stop: it holds every sample consumed.
        records = [r for r in launch.records() if r["restart"] == attempt]
        (start,) = [r for r in records if r.get("start") and r["rank"] == 0]
        consumed = start["samples_consumed"] + sum(
            pad.count(False) for pad in (r["padding"] for r in records if "indices" in r)
        )
        loaded = CheckpointStore(self.checkpoints, job_id=JOB_ID).load()
        saved = json.loads(loaded.entries["adaptdl-job"])["samples_consumed"] if loaded else 0
        if saved != consumed:
            raise launch.fail(
                f"the newest checkpoint holds {saved} samples consumed, but the replicas "
                f"consumed {consumed} before they stopped"
            )

    # -- the kinds -------------------------------------------------------------------
    def kill(self) -> None:
        kills = 2 if self.occurrence % 3 == 1 else 1
        launch = Launch(self, self.procs(), max_restarts=kills + 1)
        for k in range(kills):
            launch.pids()
            attempt = launch.attempt()
            if k == 0:
                launch.wait_steps(self.step_target(launch.nproc), attempt)
            else:
                launch.wait_steps(self.rng.randint(1, 3), attempt)
            pids = launch.pids()
            rank = self.rng.randrange(launch.nproc)
            self.result.detail += f" kill rank {rank}"
            _kill(pids[rank], signal.SIGKILL)
            self._wait_restart(launch, attempt)
        self.finish(launch)

    def kill_in_save(self) -> None:
        launch = Launch(self, self.procs(), max_restarts=2, env={"FAULTS_SLOW_SAVE": "1.0"})
        saver = launch.wait_in_save()
        pids = launch.pids()
        rank = 0 if self.rng.random() < 0.6 else self.rng.randrange(launch.nproc)
        self.result.detail += f" kill rank {rank} in save"
        _kill(saver if rank == 0 else pids[rank], signal.SIGKILL)
        self.finish(launch)

    def double_sigterm(self) -> None:
        self._double_sigterm(in_save=self.occurrence % 2 == 0, workers=0)

    def double_sigterm_workers(self) -> None:
        self._double_sigterm(in_save=False, workers=2)

    def _double_sigterm(self, in_save: bool, workers: int) -> None:
        env = {"FAULTS_WORKERS": str(workers)}
        if in_save:
            env["FAULTS_SLOW_SAVE"] = "1.0"
        first = Launch(self, self.procs(), max_restarts=0, env=env)
        first.pids()
        if in_save:
            first.wait_in_save()
            self.result.detail += " 2xTERM in save"
        else:
            first.wait_steps(self.step_target(first.nproc))
            self.result.detail += " 2xTERM"
        if workers:
            self.result.detail += f", {workers} loader workers"
        self.signal_torchrun(first, 2)
        self.stopped(first)
        self.finish(Launch(self, self.procs(), max_restarts=0))

    def slurm_sigterm(self) -> None:
        workers = self.rng.choice([0, 2])
        first = Launch(self, self.procs(), max_restarts=0, env={"FAULTS_WORKERS": str(workers)})
        first.pids()
        first.wait_steps(self.step_target(first.nproc))
        everyone = [first.proc.pid, *descendants(first.proc.pid)]
        self.rng.shuffle(everyone)  # scancel signals them all, in no particular order
        for pid in everyone:
            _kill(pid, signal.SIGTERM)
        self.result.detail += f" TERM to all {len(everyone)} ({workers} loader workers)"
        self.stopped(first)
        self.finish(Launch(self, self.procs(), max_restarts=0))

    def sigterm_between_loops(self) -> None:
        nproc = 2 + self.occurrence % 2
        held = self.rng.random() < 0.5
        epoch = self.rng.randrange(EPOCHS)
        env = {"FAULTS_ACCUMULATOR": "1", "FAULTS_EVAL_SLEEP": "3"}
        if held:
            env["FAULTS_EVAL_RANK0"] = "1"
        first = Launch(self, nproc, max_restarts=0, env=env)
        first.pids()
        first.wait_for(
            f"rank 0 evaluating after epoch {epoch}",
            lambda records: any(r.get("evaluating") == epoch and r["rank"] == 0 for r in records),
        )
        time.sleep(self.rng.uniform(0.0, 1.0))
        self.result.detail += f" TERM in eval {epoch} at {nproc}" + (
            " (rank 0 held)" if held else ""
        )
        self.signal_torchrun(first, 1)
        self.stopped(first)
        self.finish(Launch(self, self.procs(), max_restarts=0, env={"FAULTS_ACCUMULATOR": "1"}))
        self.analyse()
        if self.result.repeated:
            raise TrialFailure(
                f"{self.result.repeated} samples were consumed again after a stop between "
                "loops: the checkpoint was not taken where the replicas stopped"
            )

    def node(self) -> None:
        # Each replica process stands before its step k+1 while the hold file exists.
        hold_from = self.rng.randint(1, 3)
        launch = NodesLaunch(self, {"FAULTS_HOLD_FROM": str(hold_from)})
        launch.wait_steps(1)  # a trains alone before b joins
        launch.nodes.start("b")
        joined = time.time()
        (first,) = launch.wait_for("a step at 2 replicas", lambda _: launch.steps(2)[:1])
        self.result.join_seconds = first["t"] - joined
        launch.wait_for("both standing", lambda _: len(launch.steps(2)) >= 2 * hold_from)
        standing = self.rng.random() < 0.5
        if not standing:  # lose b while training, a few steps on
            launch.hold.unlink()
            time.sleep(self.rng.uniform(0.0, 0.15))
        lost = time.time()
        launch.nodes.lose("b")
        launch.hold.unlink(missing_ok=True)
        self.result.detail += f" b joins, lost {'at' if standing else 'after'} step {hold_from}"

        def resumed(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
            done = [r for r in records if r.get("exit") == 0 and r["t"] > lost]
            return launch.steps(1, lost)[:1] or done

        (after,) = launch.wait_for("a step at 1 replica after the loss", resumed)
        if "indices" in after:
            self.result.loss_seconds = after["t"] - lost
        else:
            self.result.detail += " (finished first)"
        self.finish(launch)
        sizes = launch.sizes()
        expected = [1, 2, 1] if "indices" in after else [1, 2]
        if sizes != expected:
            raise launch.fail(f"the replicas went {sizes}, not {expected}")

    def enospc(self) -> None:
        at = self.rng.randint(1, 7)  # 1: the writability probe at start
        self.result.detail += f" ENOSPC at write {at}"
        launch = Launch(self, self.procs(), max_restarts=2, env={"FAULTS_ENOSPC_AT": str(at)})
        self.finish(launch)
        text = launch.log.read_text(errors="replace")
        advice = "choose a writable directory" if at == 1 else "has space"
        if "No space left on device" not in text or advice not in text:
            raise launch.fail("the full disk was not reported clearly")

    def sharded_write(self) -> None:
        env = {"FAULTS_FSDP": "1"}
        if self.occurrence % 2 == 0:
            self._sharded_full_disk(env)
        else:
            self._sharded_lost_write(env)

    def _sharded_full_disk(self, env: dict[str, str]) -> None:
        nproc = self.procs()
        rank = self.rng.randrange(nproc)
        at = self.rng.randint(1, 3)  # rank 0 writes two files a checkpoint, the others one
        self.result.detail += f" FSDP ENOSPC at rank {rank}'s shard write {at}"
        env.update(FAULTS_SHARD_ENOSPC_AT=str(at), FAULTS_SHARD_RANK=str(rank))
        launch = Launch(self, nproc, max_restarts=2, env=env)
        self.finish(launch)
        if launch.attempt() < 1:
            raise launch.fail("the full disk in a shard write did not fail the job")
        if "No space left on device" not in launch.log.read_text(errors="replace"):
            raise launch.fail("the full disk in a shard write was not reported")

    def _sharded_lost_write(self, env: dict[str, str]) -> None:
        # The replicas stand before the step after the second checkpoint (the damaged
        # one) until a replica is killed: no later checkpoint may hide the damage.
        hold = self.dir / "hold"
        hold.touch()
        env.update(
            FAULTS_SHARD_LOSE_AT="2",
            FAULTS_SHARD_VICTIM=str(self.rng.randrange(3)),
            FAULTS_HOLD_FILE=str(hold),
            FAULTS_HOLD_FROM=str(2 * self.every_steps),
        )
        launch = Launch(self, self.procs(), max_restarts=1, env=env)
        attempt = launch.attempt()
        (damaged,) = launch.wait_for(
            "a damaged checkpoint", lambda records: [r for r in records if "damaged" in r][:1]
        )
        pids = launch.pids()
        rank = self.rng.randrange(launch.nproc)
        self.result.detail += f" FSDP lost write in {damaged['file']}, kill rank {rank}"
        _kill(pids[rank], signal.SIGKILL)
        hold.unlink()
        self._wait_restart(launch, attempt)
        self.finish(launch)
        resumed = [r for r in launch.records() if r.get("start") and r["restart"] > attempt]
        if any(r["restored"] == damaged["damaged"] for r in resumed):
            raise launch.fail(f"the restart resumed from the damaged {damaged['damaged']}")

    def resize(self) -> None:
        sizes = [self.procs()]
        for _ in range(2 if self.rng.random() < 0.3 else 1):
            sizes.append(self.procs(other_than=sizes[-1]))
        self.result.detail += " " + "->".join(map(str, sizes))
        for size in sizes[:-1]:
            launch = Launch(self, size, max_restarts=0)
            launch.pids()
            launch.wait_steps(self.rng.randint(1, self.steps_per_epoch(size)))
            self.signal_torchrun(launch, 1)
            self.stopped(launch)
        self.finish(Launch(self, sizes[-1], max_restarts=0))

    def hang(self) -> None:
        env = {"ADAPTDL_COLLECTIVE_TIMEOUT": str(HANG_TIMEOUT)}
        launch = Launch(self, self.procs(lo=2), max_restarts=1, env=env)
        pids = launch.pids()
        attempt = launch.attempt()
        launch.wait_steps(self.step_target(launch.nproc), attempt)
        rank = self.rng.randrange(launch.nproc)
        self.result.detail += f" stop rank {rank}"
        _kill(pids[rank], signal.SIGSTOP)
        start = time.monotonic()
        survivors = [pid for r, pid in pids.items() if r != rank]
        try:
            while any(alive(pid) for pid in survivors):
                if time.monotonic() - start > HANG_TIMEOUT + HANG_SLACK:
                    raise launch.fail(
                        f"survivors still running {HANG_TIMEOUT + HANG_SLACK}s after a peer "
                        f"stopped (collective timeout {HANG_TIMEOUT}s): hang"
                    )
                time.sleep(0.05)
            self.result.stop_seconds = time.monotonic() - start
        finally:
            _kill(pids[rank], signal.SIGCONT)
        errors = [
            r["error"]
            for r in launch.records()
            if "error" in r and r["restart"] == attempt and r["rank"] != rank
        ]
        if not any("timed out" in e.lower() or "timeout" in e.lower() for e in errors):
            raise launch.fail(f"the survivors did not stop on a collective timeout: {errors}")
        self._wait_restart(launch, attempt)
        self.finish(launch)

    def second_job(self) -> None:
        # The replicas stand before the step after the first checkpoint until the other
        # job's launch has ended: slow steps alone let a job finish first on a loaded
        # machine, and the other job then ran, on its own (planted) files.
        hold = self.dir / "hold"
        hold.touch()
        env = {"FAULTS_HOLD_FILE": str(hold), "FAULTS_HOLD_FROM": str(self.every_steps)}
        launch = Launch(self, self.procs(), max_restarts=1, env=env)
        launch.pids()
        attempt = launch.attempt()
        launch.wait_for("a checkpoint", lambda records: any("saved" in r for r in records))
        foreign = self._plant_foreign()
        before = _snapshot(foreign)
        # Before the launch: a second job that is wrongly let in must fail on our
        # checks, not on a missing records folder (which would pass as a refusal).
        (self.dir / "other-records").mkdir(exist_ok=True)
        other = subprocess.run(
            torchrun_command(SCRIPT, 1, max_restarts=0, monitor_interval=0.2),
            env={
                **self.env,
                "ADAPTDL_JOB_ID": OTHER_JOB,
                # Let in (this job ended first), it resumes from the planted checkpoint,
                # which holds none of the program's states: they start fresh.
                "ADAPTDL_ALLOW_MISSING_STATE": "*",
                "FAULTS_RUN": "99",
                "FAULTS_RECORD_DIR": str(self.dir / "other-records"),
            },
            capture_output=True,
            text=True,
            timeout=WAIT_TIMEOUT,
            check=False,
        )
        hold.unlink()
        (self.dir / "other-job.log").write_text(other.stdout + other.stderr)
        running = launch.proc.poll() is None
        text = other.stdout + other.stderr
        refused = "StorageLocked" in text
        if not refused and (running or other.returncode != 0):
            # Only a job that ended first frees the directory for the other one, which
            # then runs to its end on its own files (checked below).
            raise launch.fail(
                "a second job on the same checkpoint directory was not refused "
                f"(exit {other.returncode}):\n{text[-2000:]}"
            )
        if refused and not (f"'{self.checkpoints}'" in text and f"'{JOB_ID}'" in text):
            raise launch.fail(
                f"the second job's refusal names neither the directory nor "
                f"the job holding it:\n{text[-2000:]}"
            )
        self.result.detail += " 2nd job refused" if running else " 2nd job (ended first)"
        if running:
            pids = launch.pids()
            rank = self.rng.randrange(launch.nproc)
            self.result.detail += f", kill rank {rank}"
            _kill(pids[rank], signal.SIGKILL)
            if launch.proc.poll() is None:
                with contextlib.suppress(TrialFailure):  # it may have finished meanwhile
                    self._wait_restart(launch, attempt)
        self.finish(launch)
        after = _snapshot(foreign)
        changed = sorted(n for n in before.keys() | after.keys() if before.get(n) != after.get(n))
        self.result.foreign_touched = len(changed)
        if changed:
            raise TrialFailure(f"files of another job were touched: {changed[:5]}")

    def _plant_foreign(self) -> list[Path]:
        """Another job's checkpoint, save in progress and journal, beside this job's."""
        saved = CheckpointStore(self.checkpoints, job_id=OTHER_JOB).save({"x": b"other"})
        leftover = self.checkpoints / f"{TMP_PREFIX}{owner_tag(OTHER_JOB)}.ckpt-000999-feed"
        leftover.mkdir()
        (leftover / "entry-0000.bin").write_bytes(b"half-written")
        journal = Journal(LocalStorage(self.checkpoints), journal_name(OTHER_JOB))
        journal.write(Mark(samples=5, replayed=1, checkpoint=saved.sequence))
        journal.close()
        return [self.checkpoints / saved.label, leftover, self.checkpoints / journal.name]

    def _wait_restart(self, launch: Launch, attempt: int) -> None:
        launch.wait_for(
            f"restart {attempt + 1}",
            lambda records: any(r.get("start") and r["restart"] > attempt for r in records),
        )

    # -- the verdict -----------------------------------------------------------------
    def analyse(self) -> None:
        """Every epoch finished; every sample consumed; repeats only by counted replay."""
        records = read_records(self.records)
        result = self.result
        result.launches = len(self.launches)
        result.restarts = sum(launch.attempt() for launch in self.launches)
        final = [
            r
            for r in records
            if "exit" in r and r["run"] == len(self.launches) - 1 and r["rank"] == 0
        ]
        done = [r for r in final if r["exit"] == 0]
        if not done or done[-1].get("finished_epochs") != EPOCHS:
            raise TrialFailure(f"the job did not finish its {EPOCHS} epochs: {final}")
        result.finished = True
        result.replayed = done[-1]["replayed"]
        consumed: dict[int, collections.Counter[int]] = collections.defaultdict(
            collections.Counter
        )
        crashes = 0
        biggest = 0
        for r in records:
            if "indices" in r:
                biggest = max(biggest, r["batch_size"])
                for index, pad in zip(r["indices"], r["padding"], strict=True):
                    if not pad:
                        consumed[r["epoch"]][index] += 1
        crashes = sum(1 for r in records if r.get("start") and r["restart"] > 0)
        lost = repeated = 0
        for epoch in range(EPOCHS):
            counts = consumed[epoch]
            lost += sum(1 for i in range(self.n) if counts[i] == 0)
            repeated += sum(c - 1 for c in counts.values() if c > 1)
            if set(counts) - set(range(self.n)):
                raise TrialFailure(f"epoch {epoch} consumed indices outside the dataset")
        result.lost, result.repeated = lost, repeated
        # Every run and restart resumed from the newest checkpoint written before it
        # (and not damaged by the storage, which the restore must find and pass over).
        damaged = {r["damaged"] for r in records if "damaged" in r}
        newest = None
        for r in sorted(records, key=lambda r: r["t"]):
            if "saved" in r and r["saved"] not in damaged:
                newest = r["saved"]
            elif r.get("start") and r["rank"] == 0 and r["restored"] != newest:
                raise TrialFailure(
                    f"run {r['run']} restart {r['restart']} resumed from {r['restored']}, "
                    f"but the newest checkpoint was {newest}"
                )
        result.timings = [
            {k: r[k] for k in ("boundary_s", "checkpoint_s", "save_s", "plain_s")}
            for r in records
            if "checkpoint_s" in r and not r["slowed"]
        ]
        if lost:
            raise TrialFailure(f"{lost} samples were never consumed")
        if repeated > result.replayed:
            raise TrialFailure(
                f"{repeated} samples were consumed twice but only {result.replayed} replays "
                "were counted"
            )
        # A replica killed between taking a batch and finishing its step has the batch
        # counted as replayed though the step never happened: at most a batch per crash.
        if result.replayed > repeated + crashes * biggest:
            raise TrialFailure(
                f"{result.replayed} replays counted but only {repeated} samples repeated "
                f"after {crashes} crashes"
            )

    def run(self) -> Result:
        start = time.monotonic()
        try:
            getattr(self, self.result.kind)()
            self.analyse()
        except TrialFailure as exc:
            self.result.error = str(exc)
        finally:
            for launch in self.launches:
                launch.kill()
            self.result.seconds = time.monotonic() - start
        return self.result


def _job_of(checkpoint: Path) -> Any:
    """The job id in a checkpoint's manifest (None when unreadable)."""
    try:
        return json.loads((checkpoint / MANIFEST).read_text()).get("job_id")
    except (OSError, ValueError, AttributeError):
        return None


def _snapshot(paths: list[Path]) -> dict[str, tuple[int, bytes]]:
    """Every file under ``paths``: its modification time and bytes."""
    found: dict[str, tuple[int, bytes]] = {}
    for path in paths:
        for file in [path, *path.rglob("*")] if path.is_dir() else [path]:
            if file.is_file():
                found[str(file)] = (file.stat().st_mtime_ns, file.read_bytes())
            elif not file.exists():
                found[str(file)] = (-1, b"")
    return found


def _kill(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)


# --------------------------------------------------------------------------- driver


def plan(trials: int, seed: int, kinds: Sequence[str] = KINDS) -> list[tuple[str, int]]:
    """(kind, trial seed) for each trial: every kind about equally often, in random order."""
    rng = random.Random(seed)
    order = [kinds[i % len(kinds)] for i in range(trials)]
    rng.shuffle(order)
    return [(kind, rng.getrandbits(32)) for kind in order]


def run_trials(
    trials: int,
    seed: int,
    kinds: Sequence[str] = KINDS,
    root: Path | None = None,
    keep: bool = False,
    progress: Callable[[Result], None] | None = None,
    jobs: int = 1,
) -> list[Result]:
    """Run the trials in a temporary directory (kept when ``keep`` or on failure).

    ``jobs`` trials run at a time (each in its own directory, with its own
    processes and ports); ``progress`` sees each result as it ends, and the
    results come back in the plan's order.
    """
    for kind in kinds:
        if kind not in KINDS:
            raise ValueError(f"unknown fault kind {kind!r}; the kinds are {', '.join(KINDS)}")
    if jobs < 1:
        raise ValueError(f"jobs must be >= 1, got {jobs}")
    base = Path(tempfile.mkdtemp(prefix="adaptdl-faults-", dir=root))
    planned = plan(trials, seed, kinds)
    lock = threading.Lock()

    def one(index: int) -> Result:
        kind, trial_seed = planned[index]
        occurrence = sum(1 for k, _ in planned[:index] if k == kind)
        result = Trial(index, kind, trial_seed, base, occurrence).run()
        if progress is not None:
            with lock:
                progress(result)
        return result

    with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
        results = list(pool.map(one, range(len(planned))))
    if not keep and all(r.error is None for r in results):
        shutil.rmtree(base, ignore_errors=True)
    else:
        print(f"trial directories kept in {base}")
    return results


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


class _PlainTable:
    """The part of rich's Table the report uses, as plain text."""

    def __init__(self, title: str) -> None:
        self.title = title
        self.columns: list[str] = []
        self.rows: list[tuple[str, ...]] = []

    def add_column(self, name: str, **_: Any) -> None:
        self.columns.append(name)

    def add_row(self, *cells: str) -> None:
        self.rows.append(cells)

    def __str__(self) -> str:
        table = [tuple(self.columns), *self.rows]
        widths = [max(len(row[i]) for row in table) for i in range(len(self.columns))]
        lines = [self.title]
        for row in table:
            lines.append("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)))
        return "\n".join(lines)


class _PlainConsole:
    def __init__(self, **_: Any) -> None:
        pass

    def print(self, text: Any, **_: Any) -> None:
        print(re.sub(r"\[/?[a-z ]*\]", "", text) if isinstance(text, str) else text)


def report(results: list[Result], seed: int) -> None:
    """Print the per-trial rows, the summary table and the checkpoint timings."""
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:  # rich makes it pretty; plain text says the same
        Console, Table = _PlainConsole, _PlainTable  # type: ignore[assignment,misc]

    console = Console(width=120)
    rows = Table(title=f"fault-injection trials (seed {seed})")
    for column in ("#", "kind", "detail", "runs", "restarts", "lost", "repeated", "replayed"):
        rows.add_column(column)
    rows.add_column("stop s")
    rows.add_column("time s")
    rows.add_column("verdict")
    for r in results:
        rows.add_row(
            str(r.index),
            r.kind,
            r.detail,
            str(r.launches),
            str(r.restarts),
            str(r.lost),
            str(r.repeated),
            str(r.replayed),
            "" if r.stop_seconds is None else f"{r.stop_seconds:.1f}",
            f"{r.seconds:.0f}",
            "ok" if r.error is None else "FAILED",
        )
    console.print(rows)

    kinds = collections.Counter(r.kind for r in results)
    summary = Table(title="summary")
    summary.add_column("measure")
    summary.add_column("value", justify="right")
    summary.add_row("seed", str(seed))
    summary.add_row("trials", str(len(results)))
    for kind in KINDS:
        summary.add_row(f"  faults: {kind}", str(kinds[kind]))
    summary.add_row("jobs finished", str(sum(r.finished for r in results)))
    summary.add_row("torchrun launches", str(sum(r.launches for r in results)))
    summary.add_row("torchrun restarts (crash recoveries)", str(sum(r.restarts for r in results)))
    summary.add_row(
        "checkpoint directory checks passed", str(sum(r.checkpoint_checks for r in results))
    )
    summary.add_row("samples lost (must be 0)", str(sum(r.lost for r in results)))
    summary.add_row("samples repeated", str(sum(r.repeated for r in results)))
    summary.add_row("replays counted", str(sum(r.replayed for r in results)))
    stops = [r.stop_seconds for r in results if r.stop_seconds is not None]
    if stops:
        summary.add_row(
            f"slowest stop after a peer hung (timeout {HANG_TIMEOUT:.0f}s)", f"{max(stops):.1f}s"
        )
    joins = [r.join_seconds for r in results if r.join_seconds is not None]
    if joins:
        summary.add_row(
            "node joined -> first step at 2 replicas, median / max",
            f"{_median(joins):.1f}s / {max(joins):.1f}s",
        )
    losses = [r.loss_seconds for r in results if r.loss_seconds is not None]
    if losses:
        summary.add_row(
            "node lost -> first step at 1 replica, median / max",
            f"{_median(losses):.1f}s / {max(losses):.1f}s",
        )
    touched = [r.foreign_touched for r in results if r.foreign_touched is not None]
    if touched:
        summary.add_row("files of another job touched (must be 0)", str(sum(touched)))
    summary.add_row("trials failed", str(sum(r.error is not None for r in results)))
    console.print(summary)

    timings = [t for r in results for t in r.timings]
    if timings:
        boundary = _median([t["boundary_s"] for t in timings])
        plain = _median([t["plain_s"] for t in timings])
        checkpoint = _median([t["checkpoint_s"] for t in timings])
        save = _median([t["save_s"] for t in timings if t["save_s"]])
        console.print(
            f"checkpoint cost, medians over {len(timings)} checkpoints (slowed ones left out): "
            f"step boundary with a checkpoint {boundary * 1e3:.1f} ms, without "
            f"{plain * 1e3:.2f} ms; the checkpoint {checkpoint * 1e3:.1f} ms, of which the "
            f"store's write {save * 1e3:.1f} ms; stall beyond the checkpoint "
            f"{(boundary - plain - checkpoint) * 1e3:.2f} ms"
        )
    for r in results:
        if r.error is not None:
            console.print(f"[bold red]trial {r.index} ({r.kind}, seed {r.seed}) failed:[/]")
            console.print(r.error, markup=False, highlight=False)
    for kind, fault in KNOWN_LIBRARY_FAULTS.items():
        if any(r.error is not None for r in results if r.kind == kind):
            console.print(f"known library fault, {kind} trials: {fault}", markup=False)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m faults", description=__doc__.split("\n")[0])
    parser.add_argument("--trials", type=int, default=50, help="number of trials (default 50)")
    parser.add_argument("--jobs", type=int, default=1, help="trials run at a time (default 1)")
    parser.add_argument("--seed", type=int, default=None, help="seed (default: random, printed)")
    parser.add_argument(
        "--kinds", default=",".join(KINDS), help=f"comma-separated subset of {','.join(KINDS)}"
    )
    parser.add_argument("--keep", action="store_true", help="keep the trial directories")
    args = parser.parse_args(argv)
    if args.trials < 1:
        parser.error(f"--trials must be >= 1, got {args.trials}")
    if args.jobs < 1:
        parser.error(f"--jobs must be >= 1, got {args.jobs}")
    seed = args.seed if args.seed is not None else random.SystemRandom().getrandbits(31)
    kinds = [k for k in args.kinds.split(",") if k]
    print(f"fault injection: {args.trials} trials, {args.jobs} at a time, seed {seed}", flush=True)

    def progress(r: Result) -> None:
        verdict = "ok" if r.error is None else "FAILED"
        print(
            f"  trial {r.index:3d} {r.kind:15s} {r.detail:40s} {r.seconds:5.0f}s {verdict}",
            flush=True,
        )

    try:
        results = run_trials(
            args.trials, seed, kinds, keep=args.keep, progress=progress, jobs=args.jobs
        )
    except ValueError as exc:
        parser.error(str(exc))
    report(results, seed)
    return 0 if all(r.error is None for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
