"""``adaptdl-sim``: replay one elastic job, or simulate a cluster under scheduling policies."""

from __future__ import annotations

import os

# The simulator is single-threaded numpy/scipy on tiny arrays; OpenBLAS threads only
# contend (measured: the core's performance-model fit runs several times slower with
# them on a loaded machine). Set before numpy loads; a user's setting wins.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import argparse
import functools
import importlib.metadata
import json
import sys
from collections.abc import Callable, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import attrs
import numpy as np

from adaptdl.sched.policies import POLICIES, AdaptDLPolicy, Policy, make_policy
from adaptdl.sched.policies.adaptdl import ABLATIONS
from adaptdl.sim.apps import ApplicationModel, builtin_applications
from adaptdl.sim.cluster import ClusterConfig, simulate
from adaptdl.sim.metrics import SimResult
from adaptdl.sim.replay import (
    ReplayReport,
    builtin_scenarios,
    load_scenario,
    run_replay,
)
from adaptdl.sim.traces import TraceError, load_traces
from adaptdl.sim.workload import JobSpec, read_workload, synthetic_workload

DEFAULT_SCENARIO = "elastic"
SYNTHETIC_JOBS = 40


def _hours(seconds: float | None) -> str:
    return "-" if seconds is None or not np.isfinite(seconds) else f"{seconds / 3600:.2f}"


def _version() -> str:
    """The installed distribution's version; "unknown" when run from a bare source tree."""
    try:
        return importlib.metadata.version("adaptdl-sim")
    except importlib.metadata.PackageNotFoundError:
        return "unknown (not installed)"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="adaptdl-sim",
        description=(
            "Discrete-event simulator of elastic, goodput-driven training: replay one job "
            "through resizes, preemptions and crashes on the real adaptdl.core, or run a "
            "cluster of jobs under the pollux, tiresias, optimus, fifo and adaptdl policies."
        ),
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)

    rp = sub.add_parser("replay", help="replay one job through a timeline of events")
    rp.add_argument(
        "scenario",
        nargs="?",
        default=DEFAULT_SCENARIO,
        help=f"a built-in scenario ({', '.join(builtin_scenarios())}) or a JSON file "
        f"(default {DEFAULT_SCENARIO})",
    )
    _common(rp)

    def cluster_options(p: argparse.ArgumentParser) -> None:
        p.add_argument("--traces", type=Path, help="folder of measured traces (Pollux layout)")
        p.add_argument(
            "--nodes", dest="num_nodes", type=int, default=16, help="nodes (default 16)"
        )
        p.add_argument("--gpus-per-node", type=int, default=4, help="GPUs per node (default 4)")
        p.add_argument(
            "--interval", type=float, default=60.0, help="scheduling interval, s (default 60)"
        )
        p.add_argument(
            "--restart-penalty",
            type=float,
            default=30.0,
            help="seconds lost at every allocation change (default 30)",
        )
        p.add_argument(
            "--node-mtbf",
            type=float,
            default=0.0,
            help="mean seconds between failures of one node (default 0: none)",
        )
        p.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
        p.add_argument("--max-time", type=float, help="stop after this many simulated seconds")
        p.add_argument(
            "--jobs",
            type=int,
            default=SYNTHETIC_JOBS,
            help=f"jobs of the built-in synthetic workload (default {SYNTHETIC_JOBS})",
        )
        _common(p)

    cp = sub.add_parser("cluster", help="simulate one workload under one policy")
    cp.add_argument("--policy", choices=POLICIES, default="pollux", help="default pollux")
    cp.add_argument(
        "workload", nargs="?", type=Path, help="workload CSV (default: built-in synthetic)"
    )
    cluster_options(cp)

    mp = sub.add_parser("compare", help="every policy on one or more workloads, as a table")
    mp.add_argument(
        "workloads", nargs="*", type=Path, help="workload CSVs (default: built-in synthetic)"
    )
    mp.add_argument(
        "--policies",
        default=",".join(POLICIES),
        help=f"comma-separated policies (default {','.join(POLICIES)})",
    )
    cluster_options(mp)

    ap = sub.add_parser(
        "ablation",
        help="pollux, adaptdl, and adaptdl with each of its ingredients switched off in turn",
    )
    ap.add_argument(
        "workloads", nargs="*", type=Path, help="workload CSVs (default: built-in synthetic)"
    )
    cluster_options(ap)
    return parser


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print a JSON result instead of tables")
    p.add_argument("--plot", type=Path, metavar="DIR", help="write PNG plots into DIR")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``adaptdl-sim`` console script."""
    args = _parser().parse_args(argv)
    try:
        if args.plot is not None:
            _check_plot(args.plot)
        if args.command == "replay":
            return _replay(args)
        return _cluster(args)
    except (TraceError, ValueError) as exc:
        print(f"adaptdl-sim: error: {exc}", file=sys.stderr)
        return 2


def _check_plot(folder: Path) -> None:
    """Fail before a long simulation, not after it, when ``--plot`` cannot work."""
    from adaptdl.sim.plots import check_plot_folder

    try:
        check_plot_folder(folder)
    except ValueError as exc:
        raise ValueError(f"--plot: {exc}") from None


# -- replay ---------------------------------------------------------------------


def _replay(args: argparse.Namespace) -> int:
    scenarios = builtin_scenarios()
    if args.scenario in scenarios:
        scenario = scenarios[args.scenario]
    elif Path(args.scenario).is_file():
        scenario = load_scenario(args.scenario)
    else:
        raise ValueError(
            f"scenario {args.scenario!r} is neither built in ({', '.join(scenarios)}) nor a file"
        )
    report = run_replay(scenario)
    if args.plot:
        from adaptdl.sim.plots import plot_replay

        for path in plot_replay(report, args.plot):
            print(f"wrote {path}", file=sys.stderr)
    if args.json:
        print(json.dumps(report.to_json(), indent=2))
    else:
        _print_replay(report)
    return 0 if report.exactly_once else 1


def _print_replay(report: ReplayReport) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    table = Table(title=f"replay {report.scenario}: samples per epoch")
    for col in ("epoch", "passes", "samples", "padding", "duplicates", "missing", "replayed"):
        table.add_column(col, justify="right")
    table.add_column("exactly once")
    for e in report.epochs:
        table.add_row(
            str(e.epoch),
            str(e.passes),
            str(e.samples),
            str(e.padding),
            str(e.duplicates),
            str(e.missing),
            str(e.replayed),
            "[green]yes[/green]" if e.exactly_once else "[red]NO[/red]",
        )
    console.print(table)
    tl = Table(title="batch size, accumulation and goodput over time")
    for col in ("time s", "replicas", "local bsz", "accum", "batch", "goodput", "progress"):
        tl.add_column(col, justify="right")
    rows = report.timeline
    step = max(1, len(rows) // 25)
    for row in list(rows[::step]) + ([rows[-1]] if rows and (len(rows) - 1) % step else []):
        t, r, b, a, m, g, p = row
        tl.add_row(f"{t:.1f}", str(r), str(b), str(a), str(m), f"{g:.0f}", f"{p:.0f}")
    console.print(tl)
    console.print(
        f"finished at {report.end_time:.1f} s simulated; {report.restarts} restarts "
        f"({report.crashes} crashes), {report.restart_seconds:.0f} s restarting, "
        f"{report.lost_seconds:.1f} s of work lost to crashes, {report.checkpoints} checkpoints; "
        + ("every sample consumed exactly once" if report.exactly_once else "[red]FAILED[/red]")
    )


# -- cluster --------------------------------------------------------------------


def _applications(traces: Path | None) -> dict[str, ApplicationModel]:
    apps: dict[str, ApplicationModel] = dict(builtin_applications())
    if traces is not None:
        apps.update(load_traces(traces))
    return apps


def _workloads(
    args: argparse.Namespace, paths: Sequence[Path], apps: Mapping[str, ApplicationModel]
) -> dict[str, list[JobSpec]]:
    if not paths:
        builtin = {k: v for k, v in apps.items() if k in builtin_applications()}
        return {"synthetic": synthetic_workload(builtin, args.jobs, seed=args.seed)}
    out = {}
    for path in paths:
        try:
            out[path.stem] = read_workload(path, apps)
        except TraceError as exc:
            if "unknown application" in str(exc) and args.traces is None:
                raise TraceError(
                    path, None, f"{exc}; pass --traces DIR for measured ones"
                ) from None
            raise
    return out


def _config(args: argparse.Namespace) -> ClusterConfig:
    # Every cluster option's destination is named after its ClusterConfig field.
    names = [f.name for f in attrs.fields(ClusterConfig) if hasattr(args, f.name)]
    return ClusterConfig(**{name: getattr(args, name) for name in names})


@contextmanager
def _native_stdout_to_stderr() -> Any:
    """Point the process's standard output (file descriptor 1) at standard error
    while it lasts: a native library may write there past Python (HiGHS, under the
    adaptdl policy's integer program, prints a line of its own now and then), and
    ``--json`` promises one JSON document on standard output."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        os.dup2(2, 1)
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


@contextmanager
def _progress(enabled: bool, total: int) -> Any:
    if not enabled:
        yield lambda label: lambda done, n: None
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    with Progress(
        "[progress.description]{task.description}",
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=Console(stderr=True),
        transient=True,
    ) as bar:

        def track(label: str) -> Callable[[int, int], None]:
            task = bar.add_task(label, total=total)

            def update(done: int, n: int) -> None:
                bar.update(task, completed=done, total=n)

            return update

        yield track


def _cluster(args: argparse.Namespace) -> int:
    apps = _applications(args.traces)
    paths = [args.workload] if args.command == "cluster" and args.workload else []
    makers: dict[str, Callable[[], Policy]] = {}
    if args.command == "compare":
        paths = list(args.workloads)
        policies = [p.strip() for p in args.policies.split(",") if p.strip()]
        for p in policies:
            if p not in POLICIES:
                raise ValueError(f"unknown policy {p!r}; choose from {list(POLICIES)}")
    elif args.command == "ablation":
        paths = list(args.workloads)
        makers["pollux"] = functools.partial(make_policy, "pollux")
        for label, kwargs in ABLATIONS.items():
            makers[label] = functools.partial(AdaptDLPolicy, **kwargs)
        policies = list(makers)
    else:
        policies = [args.policy]
    for p in policies:
        makers.setdefault(p, functools.partial(make_policy, p))
    workloads = _workloads(args, paths, apps)
    config = _config(args)
    show = not args.json and not args.no_progress and sys.stderr.isatty()
    results: dict[str, dict[str, SimResult]] = {}
    with (
        _native_stdout_to_stderr(),
        _progress(show, max(len(w) for w in workloads.values())) as track,
    ):
        for wname, jobs in workloads.items():
            results[wname] = {}
            for policy in policies:
                update = track(f"{wname} {policy}")
                results[wname][policy] = simulate(
                    jobs, apps, makers[policy](), config, on_progress=update
                )
    if args.plot:
        from adaptdl.sim.plots import plot_cluster

        for wname, by_policy in results.items():
            prefix = f"{wname}_" if len(results) > 1 else ""
            for path in plot_cluster(list(by_policy.values()), args.plot, prefix):
                print(f"wrote {path}", file=sys.stderr)
    if args.command == "cluster":
        result = next(iter(results.values()))[policies[0]]
        if args.json:
            # One run: include each job's timeline and the utilisation over time.
            print(json.dumps(result.to_json(history=True), indent=2))
        else:
            _print_cluster(result, next(iter(results)))
        return 0
    if args.json:
        print(json.dumps(_compare_json(results, policies), indent=2))
    else:
        _print_compare(results, policies)
    return 0


def _print_cluster(result: SimResult, workload: str) -> None:
    from rich.console import Console

    _print_compare({workload: {result.policy: result}}, [result.policy])
    Console().print(
        f"{len(result.jobs)} jobs, {result.unfinished} unfinished, {result.rounds} rounds; "
        f"policy CPU time per round: max {result.max_round_seconds:.3f} s, "
        f"mean {result.mean_round_seconds:.4f} s; use --json for every job"
    )


def _summary(results: Sequence[SimResult]) -> dict[str, float]:
    def mean(values: list[float]) -> float:
        return float(np.mean(values)) if values else float("nan")

    return {
        "avg_jct": mean([r.avg_jct for r in results]),
        "p50_jct": mean([r.p50_jct for r in results]),
        "p99_jct": mean([r.p99_jct for r in results]),
        "makespan": mean([r.makespan for r in results]),
        "avg_utilization": mean([r.avg_utilization for r in results]),
        "avg_restarts": mean([r.avg_restarts for r in results]),
        "unfinished": float(sum(r.unfinished for r in results)),
        "max_round_seconds": max((r.max_round_seconds for r in results), default=float("nan")),
        "max_slowdown": mean([r.max_slowdown for r in results]),
    }


def _compare_json(
    results: Mapping[str, Mapping[str, SimResult]], policies: Sequence[str]
) -> dict[str, Any]:
    return {
        "policies": list(policies),
        "workloads": {w: {p: r.to_json() for p, r in by.items()} for w, by in results.items()},
        "mean": {p: _summary([by[p] for by in results.values()]) for p in policies},
    }


def _print_compare(
    results: Mapping[str, Mapping[str, SimResult]], policies: Sequence[str]
) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    if len(results) > 1:
        table = Table(title="average JCT (hours) per workload")
        table.add_column("workload")
        for p in policies:
            table.add_column(p, justify="right")
        for w, by in results.items():
            table.add_row(w, *[_hours(by[p].avg_jct) for p in policies])
        means = [_summary([by[p] for by in results.values()])["avg_jct"] for p in policies]
        table.add_row("[bold]mean[/bold]", *[f"[bold]{_hours(m)}[/bold]" for m in means])
        console.print(table)
    title = "policies" if len(results) == 1 else f"mean over {len(results)} workloads"
    table = Table(title=f"{title} (times in hours)")
    base_summary = (
        _summary([by["pollux"] for by in results.values()]) if "pollux" in policies else None
    )
    columns = ["policy", "avg JCT", "p50 JCT", "p99 JCT", "makespan", "GPU util", "restarts/job"]
    columns += ["worst slowdown", "max s/round"]
    if base_summary is not None:
        columns += ["avg/pollux", "p99/pollux", "makespan/pollux"]
    for col in columns:
        table.add_column(col, justify="right")
    base = None if base_summary is None else base_summary["avg_jct"]
    for p in policies:
        s = _summary([by[p] for by in results.values()])
        row = [
            p,
            _hours(s["avg_jct"]),
            _hours(s["p50_jct"]),
            _hours(s["p99_jct"]),
            _hours(s["makespan"]),
            f"{100 * s['avg_utilization']:.0f}%",
            f"{s['avg_restarts']:.1f}",
            f"{s['max_slowdown']:.1f}",
            f"{s['max_round_seconds']:.3f}",
        ]
        if base_summary is not None:
            row += [f"{s[k] / base_summary[k]:.3f}" for k in ("avg_jct", "p99_jct", "makespan")]
        table.add_row(*row)
    console.print(table)
    if base is not None:
        for p in policies:
            if p != "pollux":
                other = _summary([by[p] for by in results.values()])["avg_jct"]
                if other > base:
                    console.print(
                        f"pollux average JCT is {100 * (1 - base / other):.0f}% lower than {p}'s"
                    )
                elif other > 0:
                    console.print(
                        f"{p} average JCT is {100 * (1 - other / base):.0f}% lower than pollux's"
                    )


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
