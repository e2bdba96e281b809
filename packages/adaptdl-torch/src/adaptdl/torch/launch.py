"""The torchrun command line that starts local replicas of a training script.

One builder for every place that launches real replicas on one machine (the
end-to-end tests, the fault-injection harness, the outcome experiments, the
benchmarks and the demo), so that they all run torchrun the same way; and the
command of one node of an elastic multi-node job (with a `Rendezvous`).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence

import attrs

from adaptdl.core.validate import check_float, check_int

__all__ = ["NODE_ENV", "Rendezvous", "torchrun_command"]

# What every node of a multi-node elastic job needs in its environment. With
# torchrun's default (the workers reuse the rendezvous TCP store), a node that
# stays rank 0 through a re-rendezvous does not publish the workers' MASTER_ADDR
# for the new round: a node that joins a running job waits for it, and the
# rendezvous fails after 60 s (DistStoreError ... MASTER_ADDR).
NODE_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


@attrs.frozen
class Rendezvous:
    """torchrun's c10d rendezvous of an elastic job of ``min_nodes`` to ``max_nodes`` nodes.

    Every node runs the same command. ``endpoint`` is ``host:port``: the node on
    that host keeps the rendezvous store, so it must outlive the job. ``conf`` is
    torchrun's ``--rdzv-conf``, in whole seconds or counts (for example
    ``last_call_timeout``, ``keep_alive_interval``, ``keep_alive_max_attempt``).
    Run the nodes with `NODE_ENV` in their environment.
    """

    endpoint: str
    max_nodes: int
    min_nodes: int = 1
    run_id: str = "adaptdl"
    conf: Mapping[str, int] = attrs.field(factory=dict, converter=dict)

    def __attrs_post_init__(self) -> None:
        host, _, port = self.endpoint.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"endpoint must be 'host:port', got {self.endpoint!r}")
        check_int("min_nodes", self.min_nodes, min=1)
        check_int("max_nodes", self.max_nodes, min=self.min_nodes)
        if not self.run_id or any(c.isspace() for c in self.run_id):
            raise ValueError(
                f"run_id must be a non-empty name without spaces, got {self.run_id!r}"
            )
        for key, value in self.conf.items():
            if not key.isidentifier():
                raise ValueError(f"conf keys must be option names, got {key!r}")
            check_int(f"conf[{key!r}]", value, min=0)

    def arguments(self) -> list[str]:
        """torchrun's options for this rendezvous."""
        options = [
            f"--nnodes={self.min_nodes}:{self.max_nodes}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={self.endpoint}",
            f"--rdzv-id={self.run_id}",
        ]
        if self.conf:
            options.append("--rdzv-conf=" + ",".join(f"{k}={v}" for k, v in self.conf.items()))
        return options


def torchrun_command(
    target: str | os.PathLike[str],
    nproc: int,
    *,
    args: Sequence[str] = (),
    module: bool = False,
    max_restarts: int = 0,
    monitor_interval: float | None = None,
    rendezvous: Rendezvous | None = None,
    python: str = sys.executable,
) -> list[str]:
    """``python -m torch.distributed.run`` running ``nproc`` replicas of ``target`` on this node.

    ``target`` is a script path, or a module name when ``module`` (``-m``); ``args``
    follow it. torchrun restarts the whole group up to ``max_restarts`` times after
    a replica fails, checking the replicas every ``monitor_interval`` seconds
    (torchrun's default when None). Without ``rendezvous`` the job is this node
    alone (``--standalone``); with it, this node is one node of an elastic job.
    """
    check_int("nproc", nproc, min=1)
    check_int("max_restarts", max_restarts, min=0)
    launcher = ["--standalone"] if rendezvous is None else rendezvous.arguments()
    command = [
        python,
        "-m",
        "torch.distributed.run",
        *launcher,
        f"--nproc-per-node={nproc}",
        f"--max-restarts={max_restarts}",
    ]
    if monitor_interval is not None:
        seconds = check_float("monitor_interval", monitor_interval, min=0.0, min_exclusive=True)
        command.append(f"--monitor-interval={seconds:g}")
    command += ["-m", str(target)] if module else [os.fspath(target)]
    return [*command, *args]
