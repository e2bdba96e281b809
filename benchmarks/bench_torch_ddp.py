"""Benchmark: AdaptiveDataParallel step time against plain DistributedDataParallel.

A 10-million-parameter MLP trains on CPU with 2 replicas under torchrun (gloo).
Each replica alternates rounds of plain DDP steps (a DataLoader with a
DistributedSampler) and rounds of AdaptiveDataParallel steps (an
AdaptiveDataLoader inside ``remaining_epochs_until``): the same model, batch size
and data. Which model is built first may matter (memory placement; one early
run suggested so, on a loaded machine), so two jobs run, one per build order, and
the figure is the geometric mean over both of the overhead of the best adaptive
round over the best plain one (target: at most 5%); the same from the medians, for
reference. On a shared, loaded machine the rounds vary by tens of percent: read the
figure from a quiet one.

    python benchmarks/bench_torch_ddp.py            # launches torchrun itself
    python benchmarks/bench_torch_ddp.py --quick
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import time
from collections.abc import Callable
from typing import Any

TARGET_OVERHEAD = 0.05
LOCAL_BATCH = 32
STEPS = 10
PARAMS = 1000 * 2000 + 2000 + 2 * (2000 * 2000 + 2000) + 2000 * 10 + 10


def mlp() -> Any:
    import torch

    # 1000*2000 + 2000*2000 + 2000*2000 + 2000*10 weights, ~10.0M parameters in all.
    return torch.nn.Sequential(
        torch.nn.Linear(1000, 2000),
        torch.nn.ReLU(),
        torch.nn.Linear(2000, 2000),
        torch.nn.ReLU(),
        torch.nn.Linear(2000, 2000),
        torch.nn.ReLU(),
        torch.nn.Linear(2000, 10),
    )


def worker(first: str, rounds: int) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    import adaptdl.torch as adl
    import torch

    torch.set_num_threads(1)
    adl.init_process_group("gloo")
    replicas = dist.get_world_size()
    n = LOCAL_BATCH * replicas * STEPS
    gen = torch.Generator().manual_seed(0)
    dataset = TensorDataset(torch.randn(n, 1000, generator=gen), torch.randint(0, 10, (n,)))
    rounds_of: dict[str, Callable[[int], None]] = {}

    def step(net: Any, optimizer: Any, x: torch.Tensor, y: torch.Tensor) -> None:
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(net(x), y).backward()
        optimizer.step()

    def build_plain() -> None:
        torch.manual_seed(0)
        model = mlp()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        ddp = DistributedDataParallel(model)
        sampler = DistributedSampler(dataset, shuffle=True)
        loader = DataLoader(dataset, batch_size=LOCAL_BATCH, sampler=sampler)

        def one_round(epoch: int) -> None:
            sampler.set_epoch(epoch)
            for x, y in loader:
                step(ddp, optimizer, x, y)

        rounds_of["plain"] = one_round

    def build_adaptive() -> None:
        torch.manual_seed(0)
        model = mlp()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        adp = adl.AdaptiveDataParallel(model, optimizer)
        loader = adl.AdaptiveDataLoader(dataset, batch_size=LOCAL_BATCH * replicas, shuffle=True)

        def one_round(epoch: int) -> None:
            for _ in adl.remaining_epochs_until(epoch + 1):
                for x, y in loader:
                    step(adp, optimizer, x, y)

        rounds_of["adaptive"] = one_round

    for side in (first, "adaptive" if first == "plain" else "plain"):
        (build_plain if side == "plain" else build_adaptive)()
    times: dict[str, list[float]] = {"plain": [], "adaptive": []}
    for r in range(rounds + 1):  # round 0 warms up
        # Alternate which side goes first, so that neither always runs warmer.
        for side in ("plain", "adaptive") if r % 2 else ("adaptive", "plain"):
            dist.barrier()
            start = time.perf_counter()
            rounds_of[side](r)
            if r:
                times[side].append((time.perf_counter() - start) / STEPS)
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps(times), flush=True)


def launch(first: str, rounds: int) -> dict[str, list[float]]:
    """One torchrun job that builds ``first`` first and alternates rounds of both sides."""
    from adaptdl.torch.launch import torchrun_command  # the parent needs no torch until here

    command = torchrun_command(
        os.path.abspath(__file__), 2, args=[f"--worker={first}", f"--rounds={rounds}"]
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        print(done.stdout[-3000:], done.stderr[-3000:])
        raise SystemExit(f"the benchmark workers failed (exit {done.returncode})")
    result: dict[str, list[float]] = json.loads(lines[-1][len("RESULT ") :])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds")
    parser.add_argument("--worker", choices=["plain", "adaptive"], help=argparse.SUPPRESS)
    parser.add_argument("--rounds", type=int, default=None)
    args = parser.parse_args()
    rounds = args.rounds or (2 if args.quick else 4)
    if args.worker:
        worker(args.worker, rounds)
        return
    ratios, medians = [], []
    for first in ("plain", "adaptive"):
        times = launch(first, rounds)
        for side in ("plain", "adaptive"):
            print(f"{first:>8} built first, {side:>8}: "
                  + " ".join(f"{t * 1e3:7.1f}" for t in times[side]) + " ms/step")  # fmt: skip
        ratios.append(min(times["adaptive"]) / min(times["plain"]))
        medians.append(statistics.median(times["adaptive"]) / statistics.median(times["plain"]))
    # The geometric mean over both build orders cancels the order's own effect.
    overhead = math.sqrt(ratios[0] * ratios[1]) - 1
    median = math.sqrt(medians[0] * medians[1]) - 1
    verdict = "meets" if overhead <= TARGET_OVERHEAD else "misses"
    print(
        f"AdaptiveDataParallel step-time overhead over DistributedDataParallel "
        f"({PARAMS / 1e6:.1f}M-parameter MLP, 2 replicas, CPU, gloo, best round of each side, "
        f"both build orders): {overhead * 100:+.1f}% ({verdict} the target "
        f"<= {TARGET_OVERHEAD * 100:.0f}%); from medians {median * 100:+.1f}%"
    )


if __name__ == "__main__":
    main()
