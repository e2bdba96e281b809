"""The Ray engine: each job's replicas are Ray actors in one placement group (a bundle
per replica: one GPU and the job's CPUs), each running the user's command as a
child process; and the scheduler itself, a detached named actor.

Everything a job holds is detached and named after the job and its launch
(``adaptdl-<job>-<launch>``, namespace ``adaptdl``), so that a restarted scheduler
finds its running jobs (:meth:`RayBackend.attach`) instead of restarting them.
Needs the extra ``adaptdl-sched[ray]``.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError
from ray.util.placement_group import (
    PlacementGroup,
    get_placement_group,
    placement_group,
    remove_placement_group,
)
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from adaptdl.sched.backend import LOST, Launch, LaunchError, Node, replica_env
from adaptdl.sched.local import free_port
from adaptdl.sched.record import JobSpec
from adaptdl.sched.scheduler import Scheduler

# Ray's decorators and a few of its functions are untyped or typed for functions
# only: used through these names, the rest of the module is checked.
_remote: Any = ray.remote
_ray_nodes: Callable[[], list[dict[str, Any]]] = ray.nodes
_node_ip: Callable[[], str] = ray.util.get_node_ip_address

NAMESPACE = "adaptdl"
SCHEDULER_NAME = "adaptdl-scheduler"
#: The label every Ray node carries with its id (Ray >= 2.4x): pins a bundle to a node.
NODE_LABEL = "ray.io/node-id"


@_remote(num_cpus=0, max_restarts=0)
class Replica:
    """One replica: the user's command as a child process of this actor."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen[bytes] | None = None

    def where(self) -> tuple[str, str, int]:
        """(node id, node address, a free port there)."""
        return (
            ray.get_runtime_context().get_node_id(),
            _node_ip(),
            free_port(),
        )

    def start(self, command: list[str], env: dict[str, str], log_path: str) -> int:
        with open(log_path, "ab") as out:
            self.proc = subprocess.Popen(
                command,
                env={**os.environ, **env},
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                preexec_fn=_die_with_parent,
            )
        return self.proc.pid

    def poll(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def terminate(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        if self.proc is not None:
            if self.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    self.proc.kill()
            self.proc.wait()


def _die_with_parent() -> None:
    """In the replica's child, before exec: be killed when the actor's process dies
    (Linux), so that a replica whose actor or raylet is gone cannot keep writing the
    job's checkpoint beside its relaunched self."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


_PR_SET_PDEATHSIG = 1


def _group_name(job: str, number: int) -> str:
    return f"adaptdl-{job}-{number}"


class RayBackend:
    """The :class:`~adaptdl.sched.backend.Backend` on the Ray cluster this process
    is connected to (``ray.init`` first)."""

    def __init__(self, launch_timeout: float = 60.0, poll_timeout: float = 10.0) -> None:
        self.launch_timeout = launch_timeout
        self.poll_timeout = poll_timeout
        self._jobs: dict[str, tuple[PlacementGroup, list[Any]]] = {}

    def nodes(self) -> list[Node]:
        out = []
        for n in _ray_nodes():
            if not n.get("Alive"):
                continue
            res = n.get("Resources", {})
            gpus = int(res.get("GPU", 0))
            out.append(
                Node(n["NodeID"], gpus, float(res.get("CPU", 0.0)), n["NodeManagerAddress"])
            )
        return out

    def launch(self, launch: Launch) -> tuple[str, ...]:
        name = _group_name(launch.job, launch.number)
        bundles = [{"GPU": 1.0, "CPU": launch.cpus_per_replica} for _ in launch.node_ids]
        pg = placement_group(
            bundles,
            strategy="PACK",
            name=name,
            lifetime="detached",
            bundle_label_selector=[{NODE_LABEL: n} for n in launch.node_ids],
        )
        try:
            ray.get(pg.ready(), timeout=self.launch_timeout)
        except GetTimeoutError:
            remove_placement_group(pg)
            raise LaunchError(
                f"placement group {name} not placed in {self.launch_timeout} s"
            ) from None
        actors = [
            Replica.options(  # type: ignore[attr-defined]
                name=f"{name}-{rank}",
                namespace=NAMESPACE,
                lifetime="detached",
                num_cpus=launch.cpus_per_replica,
                num_gpus=1,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    pg, placement_group_bundle_index=rank
                ),
            ).remote()
            for rank in range(len(launch.node_ids))
        ]
        self._jobs[launch.job] = (pg, actors)
        try:
            where = ray.get([a.where.remote() for a in actors], timeout=self.launch_timeout)
            node_ids = tuple(w[0] for w in where)
            _, addr, port = where[0]
            placed = Launch(**{**_fields(launch), "node_ids": node_ids})
            ray.get(
                [
                    a.start.remote(
                        list(launch.command),
                        replica_env(placed, rank, addr, port),
                        str(Path(launch.log_dir) / f"replica-{rank}.log"),
                    )
                    for rank, a in enumerate(actors)
                ],
                timeout=self.launch_timeout,
            )
        except (GetTimeoutError, RayActorError) as exc:
            self.release(launch.job)
            raise LaunchError(f"replicas of {name} did not start: {exc}") from exc
        return node_ids

    def attach(self, job: str, number: int, replicas: int) -> bool:
        name = _group_name(job, number)
        try:
            pg = get_placement_group(name)
            actors = [ray.get_actor(f"{name}-{r}", namespace=NAMESPACE) for r in range(replicas)]
        except ValueError:
            return False
        self._jobs[job] = (pg, actors)
        return True

    def poll(self, job: str) -> list[int | None]:
        _, actors = self._jobs.get(job, (None, []))
        codes: list[int | None] = []
        for a in actors:
            try:
                codes.append(ray.get(a.poll.remote(), timeout=self.poll_timeout))
            except GetTimeoutError:
                codes.append(None)
            except RayActorError:
                codes.append(LOST)
        return codes

    def terminate(self, job: str) -> None:
        _, actors = self._jobs.get(job, (None, []))
        for a in actors:
            a.terminate.remote()

    def release(self, job: str) -> None:
        pg, actors = self._jobs.pop(job, (None, []))
        for a in actors:
            with contextlib.suppress(RayActorError, GetTimeoutError):
                ray.get(a.kill.remote(), timeout=self.poll_timeout)
            ray.kill(a)
        if pg is not None:
            remove_placement_group(pg)


def _fields(launch: Launch) -> dict[str, Any]:
    return {
        "job": launch.job,
        "number": launch.number,
        "node_ids": launch.node_ids,
        "command": launch.command,
        "cpus_per_replica": launch.cpus_per_replica,
        "env": launch.env,
        "log_dir": launch.log_dir,
    }


@_remote(num_cpus=0, max_concurrency=8)
class SchedulerActor:
    """The scheduler as a detached named actor: ticks every ``tick`` seconds in a
    thread; the operator's verbs are its methods."""

    def __init__(self, storage: str, policy: str, interval: float, tick: float = 1.0) -> None:
        self._lock = threading.Lock()
        self._sched = Scheduler(RayBackend(), storage, policy=policy, interval=interval)
        self._tick = tick
        self._running = True
        self._error: str | None = None
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while self._running:
            try:
                with self._lock:
                    self._sched.tick()
            except Exception as exc:
                self._error = f"{type(exc).__name__}: {exc}"
            time.sleep(self._tick)

    def submit(self, spec: dict[str, Any]) -> str:
        with self._lock:
            return self._sched.submit(JobSpec(**spec))

    def stop(self, name: str) -> None:
        with self._lock:
            self._sched.stop(name)

    def rows(self) -> list[dict[str, Any]]:
        with self._lock:
            return self._sched.rows()

    def log_dir(self, name: str) -> str:
        with self._lock:
            return self._sched.job(name).log_dir

    def status(self) -> dict[str, Any]:
        with self._lock:
            return {
                "storage": str(self._sched.storage),
                "policy": self._sched.policy_name,
                "interval": self._sched.interval,
                "rounds": self._sched.rounds,
                "nodes": len(self._sched.backend.nodes()),
                "error": self._error,
            }

    def drain(self, timeout: float = 120.0) -> list[str]:
        """Checkpoint and stop every running job (they stay queued), rounds off."""
        with self._lock:
            self._sched.draining = True
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            with self._lock:
                left = self._sched.drain()
            if not left:
                return []
            time.sleep(self._tick)
        return left

    def shutdown(self) -> None:
        self._running = False
        self._thread.join()
