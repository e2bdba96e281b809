"""Benchmark of the live scheduler (figures and ratios, no assertions).

A mini-trace of emulated jobs (``tests/sched/live/emulated_job.py``: real processes
whose steps sleep for a performance model's time, so that two cores suffice)
submitted over a few seconds to the live scheduler on this machine (``LocalBackend``,
4 declared GPUs, rounds every 2 s), once under pollux and once under fifo, in
alternating rounds. Prints each policy's average job completion time (wall seconds,
submission to success), pollux's over fifo's (the median over rounds), and the
median restart cost pollux measured (stop requested to the first step at the new
size; target at most 10 s for a tiny job).

Not yet here (issue #33): the same trace through the simulator, for the live
average JCT against the simulated one.

    python benchmarks/bench_sched.py [--rounds N] [--jobs N]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from adaptdl.sched.local import LocalBackend
from adaptdl.sched.record import JobSpec, Status
from adaptdl.sched.scheduler import Scheduler

JOB = Path(__file__).resolve().parents[1] / "tests" / "sched" / "live" / "emulated_job.py"


def run_trace(policy: str, jobs: int, storage: Path) -> tuple[float, list[float]]:
    """(average JCT in seconds, every restart cost measured) of one run of the trace."""
    backend = LocalBackend(gpus=4)
    sched = Scheduler(backend, storage, policy=policy, interval=2.0, restart_penalty=2.0)
    env = {"OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    arrivals = [(2.0 * i, f"job-{i}", 512 * (1 + i % 3)) for i in range(jobs)]
    start = time.monotonic()
    try:
        while not (len(sched.jobs) == jobs and all(j.status.done for j in sched.jobs.values())):
            now = time.monotonic() - start
            for at, name, samples in arrivals:
                if at <= now and name not in sched.jobs:
                    command = (sys.executable, str(JOB), "--samples", str(samples))
                    sched.submit(
                        JobSpec(
                            name=name,
                            command=command,
                            max_replicas=4,
                            cpus_per_replica=0.25,
                            env=env,
                        )
                    )
            if now > 900:
                raise RuntimeError(f"trace not done in 900 s: {sched.rows()}")
            sched.tick()
            time.sleep(0.1)
    finally:
        backend.close()
    records = list(sched.jobs.values())
    bad = [j.name for j in records if j.status is not Status.SUCCEEDED]
    if bad:
        raise RuntimeError(f"jobs did not succeed under {policy}: {bad}")
    jct = statistics.mean(j.finished - j.submit for j in records if j.finished is not None)
    costs = [c for j in records for c in j.restart_costs]
    return jct, costs


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=1, help="alternating rounds per policy")
    parser.add_argument("--jobs", type=int, default=6)
    args = parser.parse_args(argv)
    print("Wall seconds (the jobs sleep their modelled step times); medians over rounds.")
    jcts: dict[str, list[float]] = {"pollux": [], "fifo": []}
    costs: list[float] = []
    for r in range(args.rounds):
        order = ["pollux", "fifo"] if r % 2 == 0 else ["fifo", "pollux"]
        for policy in order:
            with tempfile.TemporaryDirectory(prefix=f"bench-sched-{policy}-") as tmp:
                jct, measured = run_trace(policy, args.jobs, Path(tmp))
            jcts[policy].append(jct)
            if policy == "pollux":
                costs.extend(measured)
            print(f"round {r}: {policy} average JCT {jct:.1f} s")
    pollux, fifo = statistics.median(jcts["pollux"]), statistics.median(jcts["fifo"])
    print(f"average JCT: pollux {pollux:.1f} s, fifo {fifo:.1f} s, ratio {pollux / fifo:.2f}")
    if costs:
        print(
            f"restart cost under pollux: median {statistics.median(costs):.1f} s over "
            f"{len(costs)} resizes (min {min(costs):.1f}, max {max(costs):.1f}; target <= 10 s)"
        )
    else:
        print("restart cost under pollux: no resize measured")


if __name__ == "__main__":
    main()
