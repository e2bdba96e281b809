"""Benchmark of the live scheduler (figures and ratios, no assertions).

A mini-trace of emulated jobs (``tests/sched/live/emulated_job.py --model``: real
processes that follow an application model, so that two cores suffice: each step
they pick their batch size by core's goodput model, sleep for core's step time of
that configuration and gain AdaScale progress at the model's gradient noise, ending
at the model's target progress) submitted over a few seconds to the live scheduler
on this machine (``LocalBackend``, 4 declared GPUs, rounds every 2 s), once under
pollux and once under fifo, in alternating rounds; and the same trace, the same
application models (``adaptdl.sim.apps.ParametricApplication``), through the
simulator on the same cluster with the same round interval. Prints each policy's
average job completion time live and simulated (seconds, submission to success;
medians over rounds), pollux's over fifo's, and the median restart cost pollux
measured live (stop requested to the first step at the new size; target at most
10 s for a tiny job), which is also the simulator's restart penalty.

    python benchmarks/bench_sched.py [--rounds N] [--jobs N]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from adaptdl.core.goodput import PerfParams
from adaptdl.sched.local import LocalBackend
from adaptdl.sched.policies import make_policy
from adaptdl.sched.record import JobSpec, Status
from adaptdl.sched.scheduler import Scheduler
from adaptdl.sim.apps import ParametricApplication
from adaptdl.sim.cluster import ClusterConfig, simulate
from adaptdl.sim.workload import JobSpec as SimJobSpec

JOB = Path(__file__).resolve().parents[1] / "tests" / "sched" / "live" / "emulated_job.py"
GPUS, INTERVAL, GAP = 4, 2.0, 2.0  # declared GPUs, seconds between rounds and arrivals
# Core's throughput model of the emulated jobs: ~0.08 s a step of 32 on one GPU.
PERF = PerfParams(
    alpha_c=0.02, beta_c=0.002, alpha_n=0.03, beta_n=0.01, alpha_r=0.005, beta_r=0.001, gamma=1.5
)


def model(samples: int) -> dict:
    """The application model of an emulated job that trains 2 epochs of ``samples``."""
    return {
        "init_batch_size": 32,
        "max_batch_size": 1024,
        "local_bsz_bounds": [8, 128],
        "dataset_size": samples,
        "epochs": 2,
        "perf_params": PERF.to_dict(),
        "noise_start": 100.0,
        "noise_end": 1000.0,
    }


def trace(jobs: int) -> list[tuple[float, str, dict]]:
    """(submission second, name, application model) of each job of the mini-trace."""
    return [(GAP * i, f"job-{i}", model(2048 * (1 + i % 3))) for i in range(jobs)]


def simulate_trace(policy: str, jobs: int, restart_penalty: float) -> float:
    """Average JCT of the same trace through the simulator (seconds)."""
    apps, specs = {}, []
    for at, name, m in trace(jobs):
        apps[name] = ParametricApplication(
            name,
            m["init_batch_size"],
            m["max_batch_size"],
            tuple(m["local_bsz_bounds"]),
            m["dataset_size"],
            m["epochs"],
            perf_params=PERF,
            noise_start=m["noise_start"],
            noise_end=m["noise_end"],
        )
        # fifo gives a job what it asks: the live scheduler's max_replicas.
        specs.append(SimJobSpec(name, at, name, GPUS, m["init_batch_size"]))
    config = ClusterConfig(
        num_nodes=1, gpus_per_node=GPUS, interval=INTERVAL, restart_penalty=restart_penalty
    )
    return float(simulate(specs, apps, make_policy(policy), config).avg_jct)


def run_trace(policy: str, jobs: int, storage: Path) -> tuple[float, list[float]]:
    """(average JCT in seconds, every restart cost measured) of one run of the trace."""
    backend = LocalBackend(gpus=GPUS)
    sched = Scheduler(backend, storage, policy=policy, interval=INTERVAL, restart_penalty=2.0)
    env = {"OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    arrivals = trace(jobs)
    start = time.monotonic()
    try:
        while not (len(sched.jobs) == jobs and all(j.status.done for j in sched.jobs.values())):
            now = time.monotonic() - start
            for at, name, m in arrivals:
                if at <= now and name not in sched.jobs:
                    # A non-adaptive policy runs the submitted batch size, as simulated.
                    m = {**m, "fixed_batch": not make_policy(policy).adaptive}
                    command = (sys.executable, str(JOB), "--model", json.dumps(m))
                    sched.submit(
                        JobSpec(
                            name=name,
                            command=command,
                            max_replicas=GPUS,
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
    print(f"average JCT live: pollux {pollux:.1f} s, fifo {fifo:.1f} s, ratio {pollux / fifo:.2f}")
    penalty = statistics.median(costs) if costs else 2.0
    for policy, live in (("pollux", pollux), ("fifo", fifo)):
        sim = simulate_trace(policy, args.jobs, penalty)
        print(
            f"{policy}: live {live:.1f} s, simulated {sim:.1f} s (restart penalty "
            f"{penalty:.1f} s), live / simulated {live / sim:.2f} (target within 15%)"
        )
    if costs:
        print(
            f"restart cost under pollux: median {statistics.median(costs):.1f} s over "
            f"{len(costs)} resizes (min {min(costs):.1f}, max {max(costs):.1f}; target <= 10 s)"
        )
    else:
        print("restart cost under pollux: no resize measured")


if __name__ == "__main__":
    main()
