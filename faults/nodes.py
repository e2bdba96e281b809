"""Several torchrun agents on this machine as the nodes of one elastic job (c10d rendezvous).

The one multi-node launcher of the project: the end-to-end test
(``tests/e2e/test_multinode.py``) and the ``node`` fault kind of ``python -m faults``
both start their nodes, and lose one, through `ElasticNodes`.

Each node is a torchrun agent (``--nnodes=1:<max>``, c10d rendezvous on one free
port of this machine, `NODE_ENV` in its environment) in its own process group.
torchrun starts its workers in sessions of their own, so ending an agent's
process group leaves its workers running: `ElasticNodes.lose` freezes the agent,
collects every process below it (workers and their DataLoader workers) and
kills them all, as when a machine is switched off.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from collections.abc import Mapping
from pathlib import Path

from adaptdl.torch.launch import NODE_ENV, Rendezvous, torchrun_command

# Rendezvous settings that make membership changes quick on one machine (torchrun's
# defaults in brackets): a round completes 1 s after its first node arrived [30 s],
# and a node that sent no heartbeat for 5 x 1 s is dead [3 x 5 s]. A node sends one
# up to 2 intervals apart: at 2 x 1 s a live node was declared dead, and the node
# that joined started a job of its own (refused by the checkpoint directory's lock).
FAST_RDZV: Mapping[str, int] = {
    "last_call_timeout": 1,
    "keep_alive_interval": 1,
    "keep_alive_max_attempt": 5,
}


def free_port() -> int:
    """A TCP port of 127.0.0.1 that nothing listens on (a moment ago)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie waiting for its parent to reap it does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def descendants(pid: int) -> set[int]:
    """Every live process below ``pid`` (children, their children, ...)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    found: set[int] = set()
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def _signal(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)


class Node:
    """One torchrun agent: its process, its log and when it was started."""

    def __init__(self, name: str, proc: subprocess.Popen[bytes], log: Path) -> None:
        self.name = name
        self.proc = proc
        self.log = log
        self.started = time.time()

    def output(self, chars: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-chars:]


class ElasticNodes:
    """The nodes of one elastic job of 1 to ``max_nodes`` nodes, started one by one.

    Every node runs ``script`` with ``nproc_per_node`` replicas under the same
    command (`torchrun_command` with a `Rendezvous`) and ``env``, plus `NODE_ENV` and
    ``FAULTS_NODE=<name>``; its torchrun output goes to ``<log_dir>/node-<name>.log``.
    """

    def __init__(
        self,
        script: Path,
        log_dir: Path,
        env: Mapping[str, str],
        *,
        max_nodes: int = 2,
        nproc_per_node: int = 1,
        max_restarts: int = 10,
        monitor_interval: float = 0.2,
        rdzv_conf: Mapping[str, int] = FAST_RDZV,
        run_id: str = "adaptdl-nodes",
    ) -> None:
        self.endpoint = f"127.0.0.1:{free_port()}"
        rendezvous = Rendezvous(self.endpoint, max_nodes, run_id=run_id, conf=rdzv_conf)
        self.command = torchrun_command(
            script,
            nproc_per_node,
            max_restarts=max_restarts,
            monitor_interval=monitor_interval,
            rendezvous=rendezvous,
        )
        self.log_dir = log_dir
        self.env = {**env, **NODE_ENV}
        self.nodes: dict[str, Node] = {}

    def start(self, name: str) -> Node:
        """Start node ``name`` (the first one started hosts the rendezvous store)."""
        if name in self.nodes:
            raise ValueError(f"node {name!r} was started already")
        log = self.log_dir / f"node-{name}.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                self.command,
                env={**self.env, "FAULTS_NODE": name},
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        node = self.nodes[name] = Node(name, proc, log)
        return node

    def lose(self, name: str) -> set[int]:
        """Kill node ``name`` at once, its agent and every process below it; return their pids.

        The agent is frozen first, so that it starts and reaps nothing while its
        processes are collected, and they are frozen until none is left to find.
        """
        node = self.nodes[name]
        pid = node.proc.pid
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGSTOP)
        frozen: set[int] = set()
        while True:
            found = descendants(pid) - frozen
            if not found:
                break
            for child in found:
                _signal(child, signal.SIGSTOP)
            frozen |= found
        for child in frozen:
            _signal(child, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)
        node.proc.wait()
        return frozen | {pid}

    def wait(self, name: str, timeout: float) -> int | None:
        """Node ``name``'s exit status, or None when it still runs after ``timeout`` s."""
        try:
            return self.nodes[name].proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None

    def kill(self) -> None:
        """End every node that still runs, with all its processes."""
        for name, node in self.nodes.items():
            if node.proc.poll() is None:
                self.lose(name)
