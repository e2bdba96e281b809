"""A backend of plain processes on this machine: one node with declared GPUs.

For a workstation without Ray, and for the scheduler's own tests. Replicas are child
processes of the scheduler, so a restarted scheduler cannot find them again
(:meth:`LocalBackend.attach` says so and the job resumes from its checkpoint).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
from pathlib import Path

from adaptdl.core.validate import check_float, check_int
from adaptdl.sched.backend import Launch, LaunchError, Node, replica_env


def free_port() -> int:
    """A TCP port free on this machine now (for MASTER_PORT)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class LocalBackend:
    """Replicas as processes of this machine, which counts as one node of ``gpus`` GPUs."""

    def __init__(self, gpus: int, cpus: float | None = None, node_id: str = "local") -> None:
        check_int("gpus", gpus, min=0)
        self.gpus = gpus
        self.cpus = (
            float(os.cpu_count() or 1) if cpus is None else check_float("cpus", cpus, min=0.0)
        )
        self.node_id = node_id
        self._procs: dict[str, list[subprocess.Popen[bytes]]] = {}

    def nodes(self) -> list[Node]:
        return [Node(self.node_id, self.gpus, self.cpus, "127.0.0.1")]

    def launch(self, launch: Launch) -> tuple[str, ...]:
        if launch.job in self._procs:
            raise LaunchError(f"job {launch.job!r} still has replicas")
        if any(n != self.node_id for n in launch.node_ids):
            raise LaunchError(f"unknown nodes in {list(launch.node_ids)}")
        port = free_port()
        procs: list[subprocess.Popen[bytes]] = []
        try:
            for rank in range(len(launch.node_ids)):
                env = {**os.environ, **replica_env(launch, rank, "127.0.0.1", port)}
                log = Path(launch.log_dir) / f"replica-{rank}.log"
                with log.open("ab") as out:
                    procs.append(
                        subprocess.Popen(
                            list(launch.command),
                            env=env,
                            stdout=out,
                            stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL,
                            start_new_session=True,
                        )
                    )
        except OSError as exc:
            for p in procs:
                p.kill()
                p.wait()
            raise LaunchError(f"cannot start {launch.command[0]!r}: {exc}") from exc
        self._procs[launch.job] = procs
        return launch.node_ids

    def attach(self, job: str, number: int, replicas: int) -> bool:
        return False

    def poll(self, job: str) -> list[int | None]:
        return [p.poll() for p in self._procs.get(job, [])]

    def terminate(self, job: str) -> None:
        for p in self._procs.get(job, []):
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    p.send_signal(signal.SIGTERM)

    def release(self, job: str) -> None:
        for p in self._procs.pop(job, []):
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    p.kill()
            p.wait()

    def close(self) -> None:
        """Kill every replica still running (each by its own process id)."""
        for job in list(self._procs):
            self.release(job)
