"""torchrun_command: the one torchrun command line of tests, faults, experiments and benchmarks."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from adaptdl.torch.launch import NODE_ENV, Rendezvous, torchrun_command

RUN = [sys.executable, "-m", "torch.distributed.run", "--standalone"]


def test_a_script_with_its_arguments() -> None:
    assert torchrun_command(Path("/x/train.py"), 3, args=["--a", "1"]) == [
        *RUN,
        "--nproc-per-node=3",
        "--max-restarts=0",
        "/x/train.py",
        "--a",
        "1",
    ]


def test_a_module_with_restarts_and_a_monitor_interval() -> None:
    command = torchrun_command("pkg.worker", 2, module=True, max_restarts=2, monitor_interval=0.5)
    assert command == [
        *RUN,
        "--nproc-per-node=2",
        "--max-restarts=2",
        "--monitor-interval=0.5",
        "-m",
        "pkg.worker",
    ]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"nproc": 0}, "nproc must be >= 1, got 0"),
        ({"nproc": 1, "max_restarts": -1}, "max_restarts must be >= 0, got -1"),
        ({"nproc": 1, "monitor_interval": 0.0}, "monitor_interval must be > 0"),
    ],
)
def test_bad_arguments_are_named(kwargs: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        torchrun_command("t.py", **kwargs)  # type: ignore[arg-type]


def test_a_node_of_an_elastic_multi_node_job() -> None:
    rendezvous = Rendezvous(
        "head:29400", 4, run_id="job-7", conf={"last_call_timeout": 1, "keep_alive_max_attempt": 5}
    )
    command = torchrun_command("train.py", 2, max_restarts=3, rendezvous=rendezvous)
    assert command == [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=1:4",
        "--rdzv-backend=c10d",
        "--rdzv-endpoint=head:29400",
        "--rdzv-id=job-7",
        "--rdzv-conf=last_call_timeout=1,keep_alive_max_attempt=5",
        "--nproc-per-node=2",
        "--max-restarts=3",
        "train.py",
    ]
    assert NODE_ENV == {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"min_nodes": 3}, "max_nodes must be >= 3, got 2"),
        ({"min_nodes": 0}, "min_nodes must be >= 1, got 0"),
        ({"endpoint": "head"}, "endpoint must be 'host:port', got 'head'"),
        ({"endpoint": "head:http"}, "endpoint must be 'host:port'"),
        ({"run_id": "a b"}, "run_id must be a non-empty name without spaces, got 'a b'"),
        ({"conf": {"a,b": 1}}, "conf keys must be option names, got 'a,b'"),
        ({"conf": {"join_timeout": -1}}, r"conf\['join_timeout'\] must be >= 0"),
        ({"conf": {"join_timeout": 1.5}}, r"conf\['join_timeout'\] must be an int"),
    ],
)
def test_bad_rendezvous_arguments_are_named(kwargs: dict[str, object], message: str) -> None:
    arguments: dict[str, object] = {"endpoint": "h:1", "max_nodes": 2}
    with pytest.raises(ValueError, match=message):
        Rendezvous(**{**arguments, **kwargs})  # type: ignore[arg-type]
