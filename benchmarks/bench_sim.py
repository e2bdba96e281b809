"""Benchmark of adaptdl.sim against its targets (figures and ratios, no assertions).

1. One 160-job Pollux workload (workload-1 with the measured traces) under the pollux
   policy: target <= 60 s on one core (the published simulator takes up to 30 minutes).
   Skipped with a message where ../shared/pollux is absent.
2. 1000 synthetic jobs (built-in application models) on 512 GPUs (128 nodes x 4) under
   pollux: target <= 600 s. ``--quick`` runs 200 jobs on 128 GPUs instead.

    python benchmarks/bench_sim.py [--quick] [--traces DIR]
"""

from __future__ import annotations

import os

# One core: keep BLAS (inside the core's L-BFGS-B fit) single-threaded.
for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

from adaptdl.sched.policies import make_policy  # noqa: E402
from adaptdl.sim.apps import builtin_applications  # noqa: E402
from adaptdl.sim.cluster import ClusterConfig, simulate  # noqa: E402
from adaptdl.sim.traces import load_traces  # noqa: E402
from adaptdl.sim.workload import read_workload, synthetic_workload  # noqa: E402

POLLUX = Path(__file__).resolve().parents[1] / ".." / "shared" / "pollux"


def _report(label: str, seconds: float, target: float, result: object) -> None:
    r = result
    print(
        f"{label}: {seconds:.1f} CPU s (target {target:.0f} s, ratio {seconds / target:.2f}); "
        f"{len(r.jobs)} jobs, {r.rounds} rounds, avg JCT {r.avg_jct / 3600:.2f} h, "  # type: ignore[attr-defined]
        f"makespan {r.makespan / 3600:.2f} h, {r.unfinished} unfinished"  # type: ignore[attr-defined]
    )


def bench_trace_workload(traces: Path, workload: Path) -> None:
    apps = load_traces(traces)
    jobs = read_workload(workload, apps)
    start = time.process_time()
    result = simulate(jobs, apps, make_policy("pollux"))
    _report(
        f"{workload.name} ({len(jobs)} jobs, pollux, traces)",
        time.process_time() - start,
        60.0,
        result,
    )


def bench_large(quick: bool) -> None:
    apps = builtin_applications()
    num_jobs, nodes = (200, 32) if quick else (1000, 128)
    jobs = synthetic_workload(apps, num_jobs, duration=8 * 3600.0, seed=0, max_replicas=16)
    start = time.process_time()
    result = simulate(jobs, apps, make_policy("pollux"), ClusterConfig(num_nodes=nodes))
    label = f"{num_jobs} synthetic jobs on {nodes * 4} GPUs (pollux)"
    _report(label + (" [quick]" if quick else ""), time.process_time() - start, 600.0, result)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smaller large-cluster run")
    parser.add_argument("--traces", type=Path, default=POLLUX / "traces")
    parser.add_argument("--workload", type=Path, default=POLLUX / "workloads" / "workload-1.csv")
    args = parser.parse_args(argv)
    print("CPU seconds of this process (time.process_time), so other load does not count.")
    if args.traces.is_dir() and args.workload.is_file():
        bench_trace_workload(args.traces, args.workload)
    else:
        print(f"skipped the trace workload: {args.traces} or {args.workload} not found")
    bench_large(args.quick)


if __name__ == "__main__":
    main()
