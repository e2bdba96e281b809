"""Benchmark of adaptdl.sim against its targets (figures and ratios, no assertions).

1. One 160-job Pollux workload (workload-1 with the measured traces) under the pollux
   policy: target <= 60 s on one core (the published simulator takes up to 30 minutes).
   Skipped with a message where ../shared/pollux is absent.
2. 1000 synthetic jobs (built-in application models) on 512 GPUs (128 nodes x 4) under
   pollux: target <= 600 s. ``--quick`` runs 200 jobs on 128 GPUs instead.
3. The adaptdl policy's time for one scheduling round with every job active at once and
   profiled (the worst round of a workload): 160 jobs on 64 GPUs (target <= 1 s) and
   1000 jobs on 512 GPUs (target <= 10 s), with pollux's round on the same state as the
   peer; medians over alternating rounds. ``--rounds-only`` runs only this part.

    python benchmarks/bench_sim.py [--quick] [--rounds-only] [--traces DIR]
"""

from __future__ import annotations

import os

# One core: keep BLAS (inside the core's L-BFGS-B fit) single-threaded.
for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

from adaptdl.sched.policies import AdaptDLPolicy, ClusterState, make_policy  # noqa: E402
from adaptdl.sim.apps import builtin_applications  # noqa: E402
from adaptdl.sim.cluster import ClusterConfig, simulate  # noqa: E402
from adaptdl.sim.jobs import SimJob  # noqa: E402
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


def _busy_state(num_jobs: int, nodes: int) -> ClusterState:
    """``num_jobs`` synthetic jobs, all active, each profiled on a few GPUs, half of them
    holding GPUs (as many as fit): the largest round a workload of that size can pose."""
    apps = builtin_applications()
    specs = synthetic_workload(apps, num_jobs, duration=3600.0, seed=1, max_replicas=16)
    free = [4] * nodes
    jobs = []
    for i, spec in enumerate(specs):
        job = SimJob(spec, apps[spec.application], adaptive=True)
        want = 1 + i % 4
        node = next((n for n, f in enumerate(free) if f >= want), None)
        if node is not None:
            job.set_allocation(spec.submit, [node] * want, 30.0)
            if i % 2:
                free[node] -= want
            else:  # profiled, then preempted: waiting
                job.set_allocation(spec.submit, [], 30.0)
        jobs.append(job)
    return ClusterState(
        time=4000.0,
        num_nodes=nodes,
        gpus_per_node=4,
        up=(True,) * nodes,
        jobs=tuple(jobs),
        interval=60.0,
        restart_penalty=30.0,
    )


def bench_rounds(repeats: int = 3) -> None:
    # The targets' sizes, and as many jobs as half the GPUs: every job is admitted and
    # the rest of the GPUs are the integer program's to split (its hardest round).
    cases = ((160, 16, 1.0), (32, 16, 1.0), (1000, 128, 10.0), (256, 128, 10.0))
    for num_jobs, nodes, target in cases:
        state = _busy_state(num_jobs, nodes)
        times: dict[str, list[float]] = {"adaptdl": [], "pollux": []}
        optimal = False
        for _ in range(repeats):
            for name in times:  # alternating, fresh policies (no cached speedups)
                policy = make_policy(name)
                start = time.process_time()
                policy.allocate(state)
                times[name].append(time.process_time() - start)
                if isinstance(policy, AdaptDLPolicy):
                    optimal = policy.rounds[-1][2]
        med = {k: statistics.median(v) for k, v in times.items()}
        spread = {k: max(v) - min(v) for k, v in times.items()}
        print(
            f"one round, {num_jobs} jobs on {nodes * 4} GPUs: adaptdl {med['adaptdl']:.2f} CPU s "
            f"(spread {spread['adaptdl']:.2f}, target {target:.0f} s, "
            f"ratio {med['adaptdl'] / target:.2f}); pollux {med['pollux']:.2f} CPU s "
            f"(adaptdl/pollux {med['adaptdl'] / max(med['pollux'], 1e-9):.1f}); "
            f"MILP optimum proven: {optimal}"
        )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smaller large-cluster run")
    parser.add_argument("--rounds-only", action="store_true", help="only the round timings")
    parser.add_argument("--traces", type=Path, default=POLLUX / "traces")
    parser.add_argument("--workload", type=Path, default=POLLUX / "workloads" / "workload-1.csv")
    args = parser.parse_args(argv)
    print("CPU seconds of this process (time.process_time), so other load does not count.")
    bench_rounds()
    if args.rounds_only:
        return
    if args.traces.is_dir() and args.workload.is_file():
        bench_trace_workload(args.traces, args.workload)
    else:
        print(f"skipped the trace workload: {args.traces} or {args.workload} not found")
    bench_large(args.quick)


if __name__ == "__main__":
    main()
