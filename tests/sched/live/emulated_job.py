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
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

from adaptdl.core.goodput import GradParams
from adaptdl.core.hints import hints
from adaptdl.core.profiler import Profiler
from adaptdl.sched.progress import write_job_hints, write_progress

_stop = False


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
    args = parser.parse_args(argv)
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
            tmp = ckpt.with_suffix(".tmp")
            tmp.write_text(json.dumps(state))
            os.replace(tmp, ckpt)
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


if __name__ == "__main__":
    sys.exit(main())
