"""A training job whose steps sleep for the time a performance model gives, so that
many run on two cores: the scheduler's test and benchmark workload.

Run as a replica (the scheduler's environment: RANK, WORLD_SIZE,
ADAPTDL_CHECKPOINT_PATH, ADAPTDL_SHARE_PATH) or alone (one replica). Rank 0 keeps the
position in a JSON checkpoint rewritten after every step, with every batch it
consumed, so that a test can check each sample of each pass was consumed exactly
once across resizes; it profiles its (emulated) step times with core's profiler and
publishes core's hints and its progress for the scheduler. SIGTERM: finish the
step, checkpoint, exit 143. ``--fail-after S``: exit 3 once S steps have run in this
launch (a crash).

``--model JSON`` makes it follow an application model that the simulator runs too
(the fields of ``adaptdl.sim.apps.ParametricApplication``: ``init_batch_size``,
``max_batch_size``, ``local_bsz_bounds``, ``dataset_size``, ``epochs``,
``perf_params``, ``noise_start``, ``noise_end``): each step it picks its batch size by
core's goodput model of the true parameters, sleeps for core's step time of that
configuration, and gains AdaScale progress at the model's gradient noise; it ends
once the model's target progress is reached, as a simulated job does. With
``"fixed_batch": true`` it keeps the submitted (initial) batch size instead, as the
simulator runs a job under a non-adaptive policy (fifo).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
import time
from pathlib import Path

from adaptdl.core.decide.batchsize import batch_size_query, even_split
from adaptdl.core.decide.hints import hints
from adaptdl.core.goodput import GoodputFunction, GradParams, PerfParams
from adaptdl.core.goodput.model import compute_time, optim_step_time
from adaptdl.core.stats.profiler import Profiler
from adaptdl.core.stats.scaling import adascale_gain
from adaptdl.sched.progress import write_job_hints, write_progress

_stop = False


def _save(ckpt: Path, state: dict) -> None:
    """Replace the emulated checkpoint whole (a reader sees the old one or the new)."""
    tmp = ckpt.with_suffix(".tmp")
    tmp.write_text(json.dumps(state))
    os.replace(tmp, ckpt)


def _on_term(signum: int, frame: object) -> None:
    global _stop
    _stop = True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--samples", type=int, default=256, help="samples in one pass")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--local-bsz", type=int, default=16)
    parser.add_argument("--alpha", type=float, default=0.05, help="seconds per step")
    parser.add_argument("--beta", type=float, default=0.004, help="seconds per local sample")
    parser.add_argument("--sync", type=float, default=0.01, help="seconds to synchronise")
    parser.add_argument("--fail-after", type=int, default=0)
    parser.add_argument("--model", default=None, help="an application model, as JSON")
    parser.add_argument(
        "--start-delay", type=float, default=0.0, help="seconds before the SIGTERM handler"
    )
    args = parser.parse_args(argv)
    # A program still starting (importing torch, say): a SIGTERM now kills it.
    time.sleep(args.start_delay)
    if args.model is not None:
        return run_model(json.loads(args.model))
    signal.signal(signal.SIGTERM, _on_term)
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    ckpt_dir = Path(os.environ.get("ADAPTDL_CHECKPOINT_PATH", "."))
    share = os.environ.get("ADAPTDL_SHARE_PATH")
    ckpt = ckpt_dir / "emulated.json"
    state = {"epoch": 0, "pos": 0, "step": 0, "consumed": []}
    if ckpt.exists():
        state = json.loads(ckpt.read_text())
    # The profile is part of the checkpoint, as a real job's is.
    profiler = Profiler.from_json(state["profile"]) if "profile" in state else Profiler()
    step_in_launch = 0
    while state["epoch"] < args.epochs:
        if _stop:
            return 143
        batch = args.local_bsz * world
        start = state["pos"]
        end = min(start + batch, args.samples)
        local = max(1, (end - start) // world)
        sync = args.sync if world > 1 else 0.0
        step_time = args.alpha + args.beta * local + sync
        time.sleep(step_time)
        step_in_launch += 1
        if args.fail_after and step_in_launch >= args.fail_after:
            return 3
        if rank == 0:
            state["consumed"].append([state["epoch"], start, end])
            state["pos"] = end
            state["step"] += 1
            if end >= args.samples:
                state["epoch"] += 1
                state["pos"] = 0
            profiler.record(1, world, local, accum_step=True, step_time=step_time - sync)
            profiler.record(1, world, local, accum_step=False, step_time=step_time, sync_time=sync)
            state["profile"] = profiler.to_json()
            _save(ckpt, state)
            if share:
                write_progress(share, replicas=world, step=state["step"], batch_size=batch)
                if step_in_launch % 5 == 0:
                    grad = GradParams(1.0, 8.0)
                    doc = hints(profiler, grad, args.local_bsz, 4096, (8, 64), False)
                    write_job_hints(share, doc)
        else:
            # The other replicas follow rank 0's position (they hold no state).
            if ckpt.exists():
                state = json.loads(ckpt.read_text())
    return 0


def _noise(model: dict, epoch: int) -> float:
    """The model's gradient noise scale (samples) in ``epoch``: geometric from start to end."""
    epochs = model["epochs"]
    frac = min(max(epoch, 0), epochs - 1) / max(epochs - 1, 1)
    start, end = model["noise_start"], model["noise_end"]
    return start * math.exp(frac * math.log(end / start))


def run_model(model: dict) -> int:
    """Train as the application ``model`` says (see the module docstring)."""
    signal.signal(signal.SIGTERM, _on_term)
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    ckpt = Path(os.environ.get("ADAPTDL_CHECKPOINT_PATH", ".")) / "emulated.json"
    share = os.environ.get("ADAPTDL_SHARE_PATH")
    perf = PerfParams.from_dict(model["perf_params"])
    init, top = model["init_batch_size"], model["max_batch_size"]
    bounds = tuple(model["local_bsz_bounds"])
    n = model["dataset_size"]
    per_epoch = n / init  # progress (initial-batch steps) of one epoch
    target = per_epoch * model["epochs"]
    state = {"pos": 0, "step": 0, "progress": 0.0, "consumed": []}
    if ckpt.exists():
        state = json.loads(ckpt.read_text())
    profiler = Profiler.from_json(state["profile"]) if "profile" in state else Profiler()
    decided = None
    while state["progress"] < target:
        if _stop:
            return 143
        epoch = min(int(state["progress"] // per_epoch), model["epochs"] - 1)
        # sqr fixed at 1: B_noise = M0 * var / sqr.
        grad = GradParams(1.0, _noise(model, epoch) / init)
        if decided is None or decided[0] != epoch:
            if model.get("fixed_batch"):
                # What a non-adaptive policy runs (the simulator's `SimJob.fixed_config`):
                # the submitted batch, split evenly, accumulating above the upper bound.
                query = batch_size_query(
                    1, world, init, local_bsz_bounds=(None, bounds[1]), gradient_accumulation=True
                )
                local, accum = even_split(query)
            else:
                fn = GoodputFunction(perf, grad, init)
                _, local, _ = fn.optimize(1, world, max_batch_size=top, atomic_bsz_range=bounds)
                accum = 0
            decided = (epoch, int(local), int(accum))
        _, local, accum = decided
        compute = float(compute_time(perf, local))
        optim = compute if world == 1 else float(optim_step_time(perf, 1, world, local))
        step_time = accum * compute + optim
        time.sleep(step_time)
        batch = local * (accum + 1) * world
        if rank == 0:
            start = state["pos"]
            state["consumed"].append([start, start + batch])  # positions over passes
            state["pos"] = start + batch
            state["step"] += 1
            state["progress"] += adascale_gain(grad.sqr, grad.var, batch / init)
            profiler.record(1, world, local, accum_step=True, step_time=compute)
            profiler.record(
                1, world, local, accum_step=False, step_time=optim, sync_time=optim - compute
            )
            state["profile"] = profiler.to_json()
            _save(ckpt, state)
            if share:
                write_progress(share, replicas=world, step=state["step"], batch_size=batch)
                if state["step"] % 5 == 0:
                    doc = hints(profiler, grad, init, top, bounds, False)
                    write_job_hints(share, doc)
        elif ckpt.exists():
            state = json.loads(ckpt.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
