"""``adaptdl``: the operator's console for the live scheduler on Ray.

    adaptdl scheduler start [--address ADDR] [--num-gpus N] [--interval S] [--policy NAME]
                            [--storage DIR]
    adaptdl scheduler stop | status
    adaptdl submit [--name NAME] [--min-replicas N] [--max-replicas N]
                   [--cpus-per-replica N] [--env K=V]... -- COMMAND [ARG...]
    adaptdl ls [--json]
    adaptdl logs NAME [--follow]
    adaptdl stop NAME
    adaptdl wait NAME... [--timeout S]

Bad input (min above max, no command, an unknown job, no scheduler running) is one
line on stderr naming the problem, and exit status 2; nothing is started then.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

from adaptdl.sched.policies import DEFAULT_POLICY, LIVE_POLICIES
from adaptdl.sched.record import NAME_PATTERN, JobSpec

#: Where the scheduler keeps its state, checkpoints and logs unless ``--storage``.
STORAGE_VAR = "ADAPTDL_STORAGE"
#: Written under the storage root when ``scheduler start`` started the Ray cluster.
STARTED_RAY = "started-ray.json"
DONE = ("Succeeded", "Failed", "Stopped")


class UsageError(Exception):
    """Bad input: printed as one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise UsageError(message)


def _default_storage() -> str:
    return os.environ.get(STORAGE_VAR) or str(Path.home() / ".adaptdl")


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="adaptdl", description="Goodput-driven scheduling of AdaptDL jobs on Ray.")
    p.add_argument(
        "--address", default=None, help="Ray cluster address (default: RAY_ADDRESS or local)"
    )
    sub = p.add_subparsers(dest="verb", required=True, parser_class=_Parser)

    sched = sub.add_parser("scheduler", help="start, stop or show the scheduler")
    ssub = sched.add_subparsers(dest="action", required=True, parser_class=_Parser)
    start = ssub.add_parser("start", help="start the scheduler (and a local Ray cluster)")
    start.add_argument("--address", dest="start_address", default=None)
    start.add_argument("--num-gpus", type=int, default=None, help="GPUs this machine declares")
    start.add_argument("--interval", type=float, default=60.0, help="seconds between rounds")
    start.add_argument(
        "--policy", default=DEFAULT_POLICY, help=f"one of {', '.join(LIVE_POLICIES)}"
    )
    start.add_argument("--storage", default=None, help="state, checkpoints and logs")
    ssub.add_parser("stop", help="stop the scheduler (its jobs keep running)")
    ssub.add_parser("status", help="show the scheduler")

    submit = sub.add_parser("submit", help="submit a job; prints its name")
    submit.add_argument("--name", default=None)
    submit.add_argument("--min-replicas", type=int, default=1)
    submit.add_argument("--max-replicas", type=int, default=1)
    submit.add_argument("--cpus-per-replica", type=float, default=1.0)
    submit.add_argument("--max-failures", type=int, default=3)
    submit.add_argument("--env", action="append", default=[], metavar="K=V")
    submit.add_argument("command", nargs=argparse.REMAINDER)

    ls = sub.add_parser("ls", help="list the jobs")
    ls.add_argument("--json", action="store_true")

    logs = sub.add_parser("logs", help="print a job's log (rank 0)")
    logs.add_argument("name")
    logs.add_argument("--follow", action="store_true")

    stop = sub.add_parser("stop", help="stop a job gracefully (checkpoint, then Stopped)")
    stop.add_argument("name")

    wait = sub.add_parser("wait", help="wait for jobs to end; exit 0 when all succeeded")
    wait.add_argument("names", nargs="+")
    wait.add_argument("--timeout", type=float, default=None)
    return p


def _spec(args: argparse.Namespace) -> JobSpec:
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise UsageError("submit: no command (give it after '--')")
    env = {}
    for item in args.env:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise UsageError(f"--env {item!r}: expected K=V")
        env[key] = value
    name = args.name
    if name is None:
        stem = "".join(c if c.isalnum() else "-" for c in Path(command[0]).name.lower())
        stem = stem.strip("-")[:50] or "job"
        name = f"{stem}-{secrets.token_hex(3)}"
        if not NAME_PATTERN.fullmatch(name):
            name = f"job-{secrets.token_hex(3)}"
    try:
        return JobSpec(
            name=name,
            command=tuple(command),
            min_replicas=args.min_replicas,
            max_replicas=args.max_replicas,
            cpus_per_replica=args.cpus_per_replica,
            env=env,
            max_failures=args.max_failures,
        )
    except (ValueError, TypeError) as exc:
        raise UsageError(f"submit: {exc}") from None


def _local_cluster() -> str | None:
    """The address of the Ray cluster this machine last started, if it answers.

    Ray's own "auto" keeps retrying a cluster that is gone for minutes; the address
    file it reads outlives its cluster.
    """
    # Where `ray start` writes it (Ray's temp dir is /tmp/ray on Linux and macOS).
    path = Path("/tmp/ray/ray_current_cluster")
    try:
        address = path.read_text().strip()
        host, _, port = address.rpartition(":")
        with socket.create_connection((host, int(port)), timeout=2.0):
            return address
    except (OSError, ValueError):
        return None


def _connect(address: str | None) -> Any:
    """The running scheduler actor, or UsageError."""
    import ray

    from adaptdl.sched.rayengine import NAMESPACE, SCHEDULER_NAME

    target = address or os.environ.get("RAY_ADDRESS") or _local_cluster()
    if target is None:
        raise UsageError(
            "no scheduler running: no Ray cluster on this machine "
            "(start one with 'adaptdl scheduler start', or give --address)"
        )
    if not ray.is_initialized():
        try:
            ray.init(
                address=target,
                namespace=NAMESPACE,
                logging_level=logging.ERROR,
                log_to_driver=False,
            )
        except (ConnectionError, RuntimeError) as exc:
            raise UsageError(
                f"no scheduler running: no Ray cluster at {target} ({exc}); "
                "start one with 'adaptdl scheduler start'"
            ) from None
    try:
        return ray.get_actor(SCHEDULER_NAME, namespace=NAMESPACE)
    except ValueError:
        raise UsageError(
            "no scheduler running on this Ray cluster; start it with 'adaptdl scheduler start'"
        ) from None


def _call(actor: Any, method: str, *args: Any) -> Any:
    import ray

    try:
        return ray.get(getattr(actor, method).remote(*args))
    except ray.exceptions.RayTaskError as exc:
        cause = exc.cause if hasattr(exc, "cause") else exc
        raise UsageError(str(cause)) from None


def _start(args: argparse.Namespace) -> int:
    if args.policy not in LIVE_POLICIES:
        raise UsageError(f"--policy {args.policy!r}: choose from {', '.join(LIVE_POLICIES)}")
    if args.interval <= 0:
        raise UsageError(f"--interval {args.interval}: must be above 0")
    if args.num_gpus is not None and args.num_gpus < 0:
        raise UsageError(f"--num-gpus {args.num_gpus}: must be 0 or more")
    storage = Path(args.storage or _default_storage()).resolve()
    storage.mkdir(parents=True, exist_ok=True)
    import ray

    from adaptdl.sched.rayengine import NAMESPACE, SCHEDULER_NAME, SchedulerActor

    address = args.start_address or args.address or os.environ.get("RAY_ADDRESS")
    address = address or _local_cluster()  # one already running on this machine
    if address is not None:
        _init(address)
    else:
        _start_local_ray(storage, args.num_gpus)
    try:
        ray.get_actor(SCHEDULER_NAME, namespace=NAMESPACE)
    except ValueError:
        pass
    else:
        raise UsageError("a scheduler is already running on this cluster")
    actor = SchedulerActor.options(  # type: ignore[attr-defined]
        name=SCHEDULER_NAME, namespace=NAMESPACE, lifetime="detached"
    ).remote(str(storage), args.policy, args.interval)
    status = ray.get(actor.status.remote())
    print(f"scheduler started: policy {status['policy']}, storage {status['storage']}")
    return 0


def _init(address: str) -> None:
    import ray

    from adaptdl.sched.rayengine import NAMESPACE

    ray.init(
        address=address, namespace=NAMESPACE, logging_level=logging.ERROR, log_to_driver=False
    )


def _start_local_ray(storage: Path, num_gpus: int | None) -> None:
    """Start a Ray head on this machine that outlives this command (``ray start
    --head --block``, in its own session); its process id goes under ``storage`` so
    that ``scheduler stop`` stops it, and only it."""
    ray_bin = shutil.which("ray") or str(Path(sys.executable).with_name("ray"))
    cmd = [ray_bin, "start", "--head", "--block", "--include-dashboard=false"]
    cmd.append("--disable-usage-stats")
    if num_gpus is not None:
        cmd.append(f"--num-gpus={num_gpus}")
    log = storage / "ray-head.log"
    with log.open("ab") as out:
        proc = subprocess.Popen(
            cmd,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    (storage / STARTED_RAY).write_text(json.dumps({"pid": proc.pid}))
    end = time.monotonic() + 120.0
    while True:
        if proc.poll() is not None:
            raise UsageError(f"'ray start --head' exited with status {proc.returncode}; see {log}")
        address = _local_cluster()
        if address is not None:
            _init(address)
            return
        if time.monotonic() > end:
            proc.terminate()
            raise UsageError(f"the local Ray cluster did not come up in 120 s; see {log}")
        time.sleep(1.0)


def _stop_scheduler(args: argparse.Namespace) -> int:
    import ray

    actor = _connect(args.address)
    status = _call(actor, "status")
    marker = Path(status["storage"]) / STARTED_RAY
    if marker.exists():
        # The cluster goes too: let every job checkpoint first (they stay queued).
        left = _call(actor, "drain")
        if left:
            print(f"not stopped in time, killed: {', '.join(left)}", file=sys.stderr)
    _call(actor, "shutdown")
    ray.kill(actor)
    ray.shutdown()
    if marker.exists():
        pid = int(json.loads(marker.read_text())["pid"])
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
        end = time.monotonic() + 60.0
        while _alive(pid) and time.monotonic() < end:
            time.sleep(0.5)
        marker.unlink()
    print("scheduler stopped")
    return 0


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie of ours would count as alive: reap it if it is our child.
    with contextlib.suppress(ChildProcessError):
        done, _ = os.waitpid(pid, os.WNOHANG)
        return done == 0
    return True


def _print_rows(rows: list[dict[str, Any]]) -> None:
    cols = ["name", "status", "replicas", "nodes", "batch_size", "speedup", "restarts"]
    times = ["submitted", "started", "finished"]
    header = [c.upper().replace("_", " ") for c in cols + times]
    table = [header]
    for r in rows:
        cells = ["" if r[c] is None else str(r[c]) for c in cols]
        cells += [
            "" if r[t] is None else time.strftime("%H:%M:%S", time.localtime(r[t])) for t in times
        ]
        table.append(cells)
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    for row in table:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())


def _logs(args: argparse.Namespace) -> int:
    actor = _connect(args.address)
    log = Path(_call(actor, "log_dir", args.name)) / "replica-0.log"
    pos = 0
    while True:
        if log.exists():
            with log.open("rb") as f:
                f.seek(pos)
                chunk = f.read()
                pos += len(chunk)
            sys.stdout.write(chunk.decode(errors="replace"))
            sys.stdout.flush()
        if not args.follow:
            return 0
        rows = {r["name"]: r for r in _call(actor, "rows")}
        if rows[args.name]["status"] in DONE and log.exists() and log.stat().st_size == pos:
            return 0
        time.sleep(1.0)


def _wait(args: argparse.Namespace) -> int:
    actor = _connect(args.address)
    end = None if args.timeout is None else time.monotonic() + args.timeout
    while True:
        rows = {r["name"]: r for r in _call(actor, "rows")}
        missing = [n for n in args.names if n not in rows]
        if missing:
            raise UsageError(f"no job named {missing[0]!r}")
        status = {n: rows[n]["status"] for n in args.names}
        if all(s in DONE for s in status.values()):
            bad = {n: s for n, s in status.items() if s != "Succeeded"}
            for n, s in bad.items():
                print(f"{n}: {s}", file=sys.stderr)
            return 0 if not bad else 1
        if end is not None and time.monotonic() > end:
            print(f"timed out after {args.timeout} s: {status}", file=sys.stderr)
            return 1
        time.sleep(1.0)


def run(argv: Sequence[str] | None = None) -> int:
    """Run one command; raises UsageError on bad input."""
    args = _parser().parse_args(argv)
    if args.verb == "scheduler":
        if args.action == "start":
            return _start(args)
        if args.action == "stop":
            return _stop_scheduler(args)
        print(json.dumps(_call(_connect(args.address), "status")))
        return 0
    if args.verb == "submit":
        spec = _spec(args)  # checked before anything is contacted
        actor = _connect(args.address)
        print(_call(actor, "submit", _spec_dict(spec)))
        return 0
    if args.verb == "ls":
        rows = _call(_connect(args.address), "rows")
        if args.json:
            print(json.dumps(rows, indent=1))
        else:
            _print_rows(rows)
        return 0
    if args.verb == "logs":
        return _logs(args)
    if args.verb == "stop":
        _call(_connect(args.address), "stop", args.name)
        return 0
    return _wait(args)


def _spec_dict(spec: JobSpec) -> dict[str, Any]:
    return {
        "name": spec.name,
        "command": list(spec.command),
        "min_replicas": spec.min_replicas,
        "max_replicas": spec.max_replicas,
        "cpus_per_replica": spec.cpus_per_replica,
        "env": dict(spec.env),
        "max_failures": spec.max_failures,
    }


def main(argv: Sequence[str] | None = None) -> int:
    """The console entry point: exit status 2 and one line on bad input."""
    try:
        return run(argv)
    except UsageError as exc:
        print(f"adaptdl: error: {exc}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as exc:
        if exc.name == "ray":
            print(
                "adaptdl: error: the scheduler needs Ray: pip install 'adaptdl-sched[ray]'",
                file=sys.stderr,
            )
            return 2
        raise


if __name__ == "__main__":
    sys.exit(main())
