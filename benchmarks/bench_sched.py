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
medians over rounds), each job's live and simulated JCT (the simulator replays the
live run's event log: `adaptdl.sim.workload.workload_from_events`), pollux's over
fifo's, and the median restart cost pollux
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
from adaptdl.sim.workload import workload_from_events

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


def applications(jobs: int) -> dict[str, ParametricApplication]:
    """The simulator's model of each job of the trace, by job name."""
    return {
        name: ParametricApplication(
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
        for _, name, m in trace(jobs)
    }


def replay(policy: str, jobs: int, events: Path, restart_penalty: float) -> dict[str, float]:
    """Each job's JCT when the live run's event log (``events.jsonl``: its arrivals) is
    replayed by the simulator on the same cluster under ``policy``."""
    apps = applications(jobs)
    config = ClusterConfig(
        num_nodes=1, gpus_per_node=GPUS, interval=INTERVAL, restart_penalty=restart_penalty
    )
    result = simulate(workload_from_events(events, apps), apps, make_policy(policy), config)
    return {j.name: float(j.finish - j.submit) for j in result.jobs if j.finish is not None}


def run_trace(policy: str, jobs: int, storage: Path) -> tuple[dict[str, float], list[float], str]:
    """(each job's JCT in seconds, every restart cost measured, the event log) of one
    run of the trace."""
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
    jct = {j.name: j.finished - j.submit for j in records if j.finished is not None}
    costs = [c for j in records for c in j.restart_costs]
    return jct, costs, sched.events_path.read_text()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=1, help="alternating rounds per policy")
    parser.add_argument("--jobs", type=int, default=6)
    args = parser.parse_args(argv)
    print("Wall seconds (the jobs sleep their modelled step times); medians over rounds.")
    jcts: dict[str, list[float]] = {"pollux": [], "fifo": []}
    last: dict[str, tuple[dict[str, float], str]] = {}  # each policy's last run
    costs: list[float] = []
    for r in range(args.rounds):
        order = ["pollux", "fifo"] if r % 2 == 0 else ["fifo", "pollux"]
        for policy in order:
            with tempfile.TemporaryDirectory(prefix=f"bench-sched-{policy}-") as tmp:
                per_job, measured, events = run_trace(policy, args.jobs, Path(tmp))
            jcts[policy].append(statistics.mean(per_job.values()))
            last[policy] = (per_job, events)
            if policy == "pollux":
                costs.extend(measured)
            print(f"round {r}: {policy} average JCT {jcts[policy][-1]:.1f} s")
    pollux, fifo = statistics.median(jcts["pollux"]), statistics.median(jcts["fifo"])
    print(f"average JCT live: pollux {pollux:.1f} s, fifo {fifo:.1f} s, ratio {pollux / fifo:.2f}")
    # The simulator replays each policy's last live run from its event log, with the
    # restart penalty pollux measured live.
    penalty = statistics.median(costs) if costs else 2.0
    simulated: dict[str, float] = {}
    for policy in ("pollux", "fifo"):
        per_job, events = last[policy]
        with tempfile.TemporaryDirectory(prefix="bench-sched-replay-") as tmp:
            log = Path(tmp) / "events.jsonl"
            log.write_text(events)
            sim = replay(policy, args.jobs, log, penalty)
        simulated[policy] = statistics.mean(sim.values())
        live = statistics.median(jcts[policy])
        print(
            f"{policy}: live {live:.1f} s, simulated {simulated[policy]:.1f} s (restart "
            f"penalty {penalty:.1f} s), live / simulated {live / simulated[policy]:.2f} "
            "(target within 15%)"
        )
        print(
            "  job by job (last run), live / simulated: "
            + ", ".join(f"{name} {per_job[name]:.1f}/{sim[name]:.1f}" for name in sorted(per_job))
        )
    print(
        f"pollux over fifo: live {pollux / fifo:.2f}, "
        f"simulated {simulated['pollux'] / simulated['fifo']:.2f}"
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
