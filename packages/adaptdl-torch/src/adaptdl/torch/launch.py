"""The torchrun command line that starts local replicas of a training script.

One builder for every place that launches real replicas on one machine (the
end-to-end tests, the fault-injection harness, the outcome experiments, the
benchmarks and the demo), so that they all run torchrun the same way; and the
command of one node of an elastic multi-node job (`torchrun_node_command`).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence

from adaptdl.core._validate import check_float, check_int

__all__ = ["NODE_ENV", "torchrun_command", "torchrun_node_command"]

# What every node of a multi-node elastic job needs in its environment. With
# torchrun's default (the workers reuse the rendezvous TCP store), a node that
# stays rank 0 through a re-rendezvous does not publish the workers' MASTER_ADDR
# for the new round: a node that joins a running job waits for it, and the
# rendezvous fails after 60 s (DistStoreError ... MASTER_ADDR).
NODE_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def torchrun_command(
    target: str | os.PathLike[str],
    nproc: int,
    *,
    args: Sequence[str] = (),
    module: bool = False,
    max_restarts: int = 0,
    monitor_interval: float | None = None,
    python: str = sys.executable,
) -> list[str]:
    """``python -m torch.distributed.run --standalone`` running ``nproc`` replicas of ``target``.

    ``target`` is a script path, or a module name when ``module`` (``-m``); ``args``
    follow it. torchrun restarts the whole group up to ``max_restarts`` times after
    a replica fails, checking the replicas every ``monitor_interval`` seconds
    (torchrun's default when None).
    """
    check_int("nproc", nproc, min=1)
    launcher = ["--standalone", f"--nproc-per-node={nproc}"]
    return _command(launcher, target, args, module, max_restarts, monitor_interval, python)


def torchrun_node_command(
    target: str | os.PathLike[str],
    nproc_per_node: int,
    *,
    endpoint: str,
    min_nodes: int = 1,
    max_nodes: int,
    run_id: str = "adaptdl",
    rdzv_conf: Mapping[str, int] | None = None,
    args: Sequence[str] = (),
    module: bool = False,
    max_restarts: int = 0,
    monitor_interval: float | None = None,
    python: str = sys.executable,
) -> list[str]:
    """The torchrun command of one node of an elastic job of ``min_nodes``..``max_nodes`` nodes.

    Every node runs the same command: c10d rendezvous at ``endpoint`` (``host:port``;
    the node on that host keeps the rendezvous store, so it must outlive the job),
    ``nproc_per_node`` replicas of ``target`` each. ``rdzv_conf`` is torchrun's
    ``--rdzv-conf``, whole seconds or counts (for example ``last_call_timeout``,
    ``keep_alive_interval``, ``keep_alive_max_attempt``).
    Run it with `NODE_ENV` in the environment. The other arguments are as in
    `torchrun_command`.
    """
    check_int("nproc_per_node", nproc_per_node, min=1)
    check_int("min_nodes", min_nodes, min=1)
    check_int("max_nodes", max_nodes, min=min_nodes)
    host, _, port = endpoint.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"endpoint must be 'host:port', got {endpoint!r}")
    if not run_id or any(c.isspace() for c in run_id):
        raise ValueError(f"run_id must be a non-empty name without spaces, got {run_id!r}")
    launcher = [
        f"--nnodes={min_nodes}:{max_nodes}",
        f"--nproc-per-node={nproc_per_node}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={endpoint}",
        f"--rdzv-id={run_id}",
    ]
    if rdzv_conf:
        options = []
        for key, value in rdzv_conf.items():
            if not key.isidentifier():
                raise ValueError(f"rdzv_conf keys must be option names, got {key!r}")
            options.append(f"{key}={check_int(f'rdzv_conf[{key!r}]', value, min=0)}")
        launcher.append("--rdzv-conf=" + ",".join(options))
    return _command(launcher, target, args, module, max_restarts, monitor_interval, python)


def _command(
    launcher: list[str],
    target: str | os.PathLike[str],
    args: Sequence[str],
    module: bool,
    max_restarts: int,
    monitor_interval: float | None,
    python: str,
) -> list[str]:
    check_int("max_restarts", max_restarts, min=0)
    command = [python, "-m", "torch.distributed.run", *launcher, f"--max-restarts={max_restarts}"]
    if monitor_interval is not None:
        seconds = check_float("monitor_interval", monitor_interval, min=0.0, min_exclusive=True)
        command.append(f"--monitor-interval={seconds:g}")
    command += ["-m", str(target)] if module else [os.fspath(target)]
    return [*command, *args]
