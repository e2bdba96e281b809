"""Benchmark: adaptive steps against plain DistributedDataParallel and plain FSDP2.

A 10-million-parameter MLP trains on CPU under torchrun (gloo, one thread per
replica) in four cases: 2 replicas; 2 replicas accumulating 4 micro-batches per
optimiser step; 1 replica; and 2 replicas sharded by ``fully_shard`` (FSDP2, each
Linear and the whole model). Each job alternates rounds of plain steps (DDP, or
the sharded model; a DataLoader with a DistributedSampler; accumulation under
``no_sync``) and rounds of adaptive steps (`AdaptiveDataParallel` or
`AdaptiveFSDP`; an AdaptiveDataLoader inside ``remaining_epochs_until``, the split
fixed by `FixedSplit`): the same model, micro-batch and data. Which model is built
first may matter (memory placement), so each case runs two jobs, each building
another side first. Every round holds one run of each side, so each round gives
one ratio, adaptive over plain, of the time per optimiser step, from CPU time
(both replicas' summed: it moves least on a loaded machine) and from wall time;
a case's figure is the median of its rounds' ratios over both jobs, printed with
their spread (the quartiles, and the least and greatest round). Target: a median
of at most 1.03 each. On a shared, loaded machine rounds vary by tens of percent:
read the figures from a quiet one, or compare runs alternated with each other.
Beside each case: the share of steps the adaptive side measured at the end, and
the CPU cost of a measured step (`adaptdl.core.stats.statsbudget`).

In the 2-replica case a third side trains the adaptive model and reports each
step's loss (``report_loss``, the opt-in noise floor). Its overhead over the
adaptive side is printed for reference; the target (at most 1%) is judged on the
call's own cost: a tiny model in this process, steps with and without
``report_loss`` in alternating rounds, the median over rounds of the difference
of CPU time per step, over one replica's adaptive CPU step of the MLP.

    python benchmarks/bench_torch_ddp.py            # launches torchrun itself
    python benchmarks/bench_torch_ddp.py --quick
    python benchmarks/bench_torch_ddp.py --case accumulation --rounds 12
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import time
from collections.abc import Callable
from typing import Any

TARGET_RATIO = 1.03
TARGET_LOSS_OVERHEAD = 0.01
SIDES = ("plain", "adaptive", "report_loss")
LOCAL_BATCH = 32
#: Micro-batches per replica per round (12 optimiser steps, or 3 of 4 micro-batches).
MICRO_PER_ROUND = 12
PARAMS = 1000 * 2000 + 2000 + 2 * (2000 * 2000 + 2000) + 2000 * 10 + 10
#: Per case: replicas, micro-batches per optimiser step, sides.
CASES: dict[str, tuple[int, int, tuple[str, ...]]] = {
    "replicas": (2, 1, SIDES),
    "accumulation": (2, 4, SIDES[:2]),
    "single": (1, 1, SIDES[:2]),
    "fsdp": (2, 1, SIDES[:2]),
}
LABELS = {
    "replicas": "2 replicas",
    "accumulation": "2 replicas x 4 micro-batches",
    "single": "1 replica",
    "fsdp": "FSDP2, 2 replicas",
}
#: The peers each case compares.
PEERS = {
    "fsdp": "AdaptiveFSDP / fully_shard",
}
DEFAULT_PEERS = "AdaptiveDataParallel / DistributedDataParallel"


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


def worker(case: str, first: str, rounds: int) -> None:
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    import adaptdl.torch as adl
    import torch
    from adaptdl.core.decide.batchsize import FixedSplit
    from adaptdl.torch._context import current_job
    from adaptdl.torch.fsdp import AdaptiveFSDP

    torch.set_num_threads(1)
    adl.init_process_group("gloo")
    replicas = dist.get_world_size()
    _, micro, sides = CASES[case]
    steps = MICRO_PER_ROUND // micro
    n = LOCAL_BATCH * replicas * MICRO_PER_ROUND
    gen = torch.Generator().manual_seed(0)
    dataset = TensorDataset(torch.randn(n, 1000, generator=gen), torch.randint(0, 10, (n,)))
    rounds_of: dict[str, Callable[[int], None]] = {}
    sharded = case == "fsdp"
    adaptive_model: list[Any] = []

    def shard(model: Any) -> Any:
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer)
        return fully_shard(model)

    def build_plain() -> None:
        torch.manual_seed(0)
        model = mlp()
        if sharded:
            model = shard(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        ddp = model if sharded else DistributedDataParallel(model)
        sampler = DistributedSampler(dataset, shuffle=True)
        loader = DataLoader(dataset, batch_size=LOCAL_BATCH, sampler=sampler)

        def one_round(epoch: int) -> None:
            sampler.set_epoch(epoch)
            for i, (x, y) in enumerate(loader):
                last = (i + 1) % micro == 0
                with ddp.no_sync() if not last and not sharded else contextlib.nullcontext():
                    loss = torch.nn.functional.cross_entropy(ddp(x), y)
                    (loss / micro if micro > 1 else loss).backward()
                if last:
                    optimizer.step()
                    optimizer.zero_grad()

        rounds_of["plain"] = one_round

    current_job().batch_size_decision = FixedSplit(LOCAL_BATCH, micro - 1)
    # One training loader per job: the adaptive sides read it, a pass a round.
    loader = adl.AdaptiveDataLoader(dataset, batch_size=LOCAL_BATCH * replicas * micro)

    def build_adaptive(report: bool) -> None:
        torch.manual_seed(0)
        model = mlp()
        if sharded:
            model = shard(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        # Two models in one job, each under its own name; one reports its loss.
        name = "report_loss" if report else "adaptive"
        adp: Any
        if sharded:
            adp = AdaptiveFSDP(model, optimizer, name=name)
        else:
            adp = adl.AdaptiveDataParallel(model, optimizer, name=name)
        if not report:
            adaptive_model.append(adp)

        def one_round(epoch: int) -> None:
            for _ in adl.remaining_epochs_until(adl.finished_epochs() + 1):
                for x, y in loader:
                    loss = torch.nn.functional.cross_entropy(adp(x), y)
                    loss.backward()
                    optimizer.step()
                    optimizer.zero_grad()
                    if report:
                        adp.report_loss(loss)

        rounds_of[name] = one_round

    builders = {
        "plain": build_plain,
        "adaptive": lambda: build_adaptive(False),
        "report_loss": lambda: build_adaptive(True),
    }
    for side in (first, *(side for side in sides if side != first)):
        builders[side]()
    wall: dict[str, list[float]] = {side: [] for side in sides}
    cpu: dict[str, list[float]] = {side: [] for side in sides}
    for r in range(rounds + 1):  # round 0 warms up
        # Rotate which side goes first, so that none always runs warmer.
        k = r % len(sides)
        for side in sides[k:] + sides[:k]:
            dist.barrier()
            start, start_cpu = time.perf_counter(), time.process_time()
            rounds_of[side](r)
            if r:
                wall[side].append((time.perf_counter() - start) / steps)
                cpu[side].append((time.process_time() - start_cpu) / steps)
    # Each round's CPU time, the replicas' together.
    mine = torch.tensor([cpu[side] for side in sides], dtype=torch.float64)
    dist.all_reduce(mine)
    if dist.get_rank() == 0:
        totals = dict(zip(sides, mine.tolist(), strict=True))
        budget = adaptive_model[0]._steps.budget
        stats = {"share": budget.share, "cost": budget.cost, "step": budget.step_time}
        print("RESULT " + json.dumps({"wall": wall, "cpu": totals, "stats": stats}), flush=True)


def report_loss_cost(rounds: int = 21, steps: int = 200) -> list[float]:
    """CPU seconds ``report_loss`` adds to a step, one figure per round: a tiny model
    (whose step costs little else), alternating rounds with and without it."""
    from torch.utils.data import TensorDataset

    import adaptdl.torch as adl
    import torch

    torch.set_num_threads(1)
    adl.init_process_group("gloo")
    n = 64 * steps
    gen = torch.Generator().manual_seed(0)
    dataset = TensorDataset(torch.randn(n, 8, generator=gen), torch.randn(n, 1, generator=gen))
    loader = adl.AdaptiveDataLoader(dataset, batch_size=64)
    sides: dict[bool, tuple[Any, Any]] = {}
    for report in (False, True):
        model = torch.nn.Linear(8, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        name = "report_loss" if report else "adaptive"
        sides[report] = (adl.AdaptiveDataParallel(model, optimizer, name=name), optimizer)
    times: dict[bool, list[float]] = {False: [], True: []}
    for r in range(rounds + 1):  # round 0 warms up
        for report in (False, True) if r % 2 else (True, False):
            adp, optimizer = sides[report]
            start = time.process_time()
            for _ in adl.remaining_epochs_until(adl.finished_epochs() + 1):
                for x, y in loader:
                    optimizer.zero_grad()
                    loss = torch.nn.functional.mse_loss(adp(x), y)
                    loss.backward()
                    optimizer.step()
                    if report:
                        adp.report_loss(loss)
            if r:
                times[report].append((time.process_time() - start) / steps)
    return [a - b for a, b in zip(times[True], times[False], strict=True)]


def launch(case: str, first: str, rounds: int) -> dict[str, Any]:
    """One torchrun job of ``case`` that builds ``first`` first and alternates rounds."""
    from adaptdl.torch.launch import torchrun_command  # the parent needs no torch until here

    command = torchrun_command(
        os.path.abspath(__file__),
        CASES[case][0],
        args=[f"--case={case}", f"--worker={first}", f"--rounds={rounds}"],
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        print(done.stdout[-3000:], done.stderr[-3000:])
        raise SystemExit(f"the benchmark workers failed (exit {done.returncode})")
    result: dict[str, Any] = json.loads(lines[-1][len("RESULT ") :])
    return result


def round_ratios(
    result: dict[str, Any], kind: str, side: str = "adaptive", peer: str = "plain"
) -> list[float]:
    """Each round's ``side`` time over ``peer``'s (``kind``: cpu, wall)."""
    pairs = zip(result[kind][side], result[kind][peer], strict=True)
    return [a / b for a, b in pairs]


def spread(values: list[float], fmt: str = "{:.3f}") -> str:
    """The median of ``values``, their quartiles and their least and greatest."""
    if len(values) < 2:
        return fmt.format(values[0])
    q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
    med = statistics.median(values)
    low, high = min(values), max(values)
    return (
        f"{fmt.format(med)} (quartiles {fmt.format(q1)}-{fmt.format(q3)}, "
        f"range {fmt.format(low)}-{fmt.format(high)}, {len(values)} rounds)"
    )


def run_case(case: str, rounds: int) -> dict[str, Any]:
    """The case's two jobs (each building another side first), printed; its rounds' ratios."""
    cpu: list[float] = []
    wall: list[float] = []
    loss: list[float] = []
    step_cpu, stats = [], []
    for first in ("plain", "adaptive"):
        result = launch(case, first, rounds)
        for side in result["wall"]:
            print(f"{LABELS[case]:>28}, {first:>8} built first, {side:>11}: wall "
                  + " ".join(f"{t * 1e3:6.1f}" for t in result["wall"][side])
                  + " ms/step; CPU (replicas summed) median "
                  + f"{statistics.median(result['cpu'][side]) * 1e3:6.1f} ms/step")  # fmt: skip
        cpu += round_ratios(result, "cpu")
        wall += round_ratios(result, "wall")
        step_cpu.append(statistics.median(result["cpu"]["adaptive"]) / CASES[case][0])
        stats.append(result["stats"])
        if "report_loss" in result["cpu"]:
            loss += round_ratios(result, "cpu", "report_loss", "adaptive")
    return {"cpu": cpu, "wall": wall, "loss": loss, "step_cpu": statistics.median(step_cpu),
            "stats": stats}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds")
    parser.add_argument("--case", choices=CASES, action="append", help="only these cases")
    parser.add_argument("--worker", choices=SIDES, help=argparse.SUPPRESS)
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--no-loss-cost", action="store_true", help="skip report_loss's cost")
    args = parser.parse_args()
    rounds = args.rounds or (3 if args.quick else 8)
    if args.worker:
        worker(args.case[0], args.worker, rounds)
        return
    figures = {case: run_case(case, rounds) for case in args.case or CASES}
    for case, fig in figures.items():
        cpu, wall = statistics.median(fig["cpu"]), statistics.median(fig["wall"])
        verdict = "meets" if max(cpu, wall) <= TARGET_RATIO else "misses"
        measured = ", ".join(
            f"share {st['share']:.2f} at {st['cost'] * 1e3:.1f} ms CPU a measured step "
            f"of {st['step'] * 1e3:.0f}"
            for st in fig["stats"]
        )
        print(
            f"{PEERS.get(case, DEFAULT_PEERS)} step time, {LABELS[case]} "
            f"({PARAMS / 1e6:.1f}M-parameter MLP, CPU, gloo, alternating rounds, two build "
            f"orders; {verdict} the target <= {TARGET_RATIO:.2f}):\n"
            f"    CPU  {spread(fig['cpu'])}\n    wall {spread(fig['wall'])}\n"
            f"    statistics measured (the adaptive side's budget, per job): {measured}"
        )
    main_case = figures.get("replicas")
    if main_case is None or args.no_loss_cost:
        return
    step_cpu = main_case["step_cpu"]
    costs = report_loss_cost(rounds=5 if args.quick else 21)
    cost = statistics.median(costs)
    verdict = "meets" if cost / step_cpu <= TARGET_LOSS_OVERHEAD else "misses"
    shares = [c / step_cpu * 100 for c in costs]
    print(
        f"report_loss each step: {cost * 1e6:+.0f} us of CPU per step (a tiny model, "
        f"alternating rounds), {cost / step_cpu * 100:+.2f}% of one replica's adaptive "
        f"{step_cpu * 1e3:.1f} ms CPU step of the MLP ({verdict} the target <= "
        f"{TARGET_LOSS_OVERHEAD * 100:.0f}%); per round, in %: {spread(shares, '{:+.2f}')}\n"
        f"    the MLP jobs' own CPU-time comparison, report_loss / adaptive, for "
        f"reference: {spread(main_case['loss'])}"
    )


if __name__ == "__main__":
    main()
