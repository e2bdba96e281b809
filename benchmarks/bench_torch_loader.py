"""Benchmark: AdaptiveDataLoader throughput against a plain DataLoader, in CPU and wall time.

One process (one replica, no launcher) runs every case. In each case both loaders
read the same dataset at the same batch size, shuffled, for one epoch per side per
round; the rounds alternate which side goes first, so that drift in machine load
and cache warmth hits both sides alike. Per case the script prints the throughput
ratio AdaptiveDataLoader / DataLoader (samples per second; >1 means the adaptive one
is faster) four ways: from CPU time and from wall time, each as the median of the
per-round ratios and as best-of (the fastest epoch of each side), and the quartiles
of the per-round CPU ratios to show the spread. The CPU-time median is the figure to
judge by (the verdict column uses it): on a shared machine other processes stretch wall time but
not the CPU time this process spends; wall time is shown because it is what a user
waits for (with workers it also includes the hand-off between processes).

Cases: ``num_workers`` 0 and 2, each with and without ``ADAPTDL_CHECKPOINT_PATH`` (with
it, the job journals every batch before the loop sees it); ``num_workers=2`` with
``persistent_workers=True`` on both sides; and a dataset whose ``__getitem__`` busy-waits
50 µs (the cost of a light real dataset) at 0 and 2 workers. Targets: a ratio of at
least 0.98, and 0.99 for the 50 µs dataset. The adaptive side runs one epoch loop
(``remaining_epochs_until``) across the warm-up and all rounds of a case, as a training
program does: the final checkpoint that ends such a loop is written after the
measurements, not once per round.

How CPU time is measured. An epoch's CPU time is that of this process (all its
threads: ``time.process_time``) plus that of its DataLoader worker processes. Workers
are children of this process, but ``resource.getrusage(RUSAGE_CHILDREN)`` only counts
children that have exited *and been reaped*; persistent workers never exit between
epochs, so it would miss their work. The clock used here therefore adds three parts:

* ``time.process_time()`` of this process;
* ``getrusage(RUSAGE_CHILDREN)`` user+system time: every worker that was reaped (torch
  joins non-persistent workers when an iterator ends);
* for every child alive at the moment of reading (listed in
  ``/proc/self/task/*/children``): the CPU time of all its threads, in nanoseconds from
  ``/proc/<pid>/task/<tid>/schedstat`` (falling back to clock ticks of
  ``/proc/<pid>/stat``).

Read before and after an epoch, the difference counts each worker exactly once: a
worker alive at both readings contributes its growth; one alive at the start and
reaped before the end contributes (total, via rusage) minus (start value); one born
and reaped within the epoch contributes its total; one born and alive at the end its
value at the end. Nothing else in this process starts children while it measures.
Without ``/proc`` (not Linux) live workers cannot be read and the script says so.

Worker starts are counted by a ``worker_init_fn`` that increments a shared counter in
each worker as it starts (the AdaptiveDataLoader calls the user's function from its own).

    python benchmarks/bench_torch_loader.py            # about 3-4 minutes
    python benchmarks/bench_torch_loader.py --quick    # a smoke run, under 30 s
"""

from __future__ import annotations

import argparse
import functools
import multiprocessing
import os
import resource
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from torch.utils.data import DataLoader, Dataset

import adaptdl.torch as adl
import torch
from adaptdl.torch import _context

BATCH_SIZE = 64


# -- datasets -----------------------------------------------------------------------


class Samples(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """A map-style in-memory dataset of (features, label) rows; ``cost_s`` busy-waits per item."""

    def __init__(self, n: int, cost_s: float = 0.0) -> None:
        gen = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 32, generator=gen)
        self.y = torch.randint(0, 10, (n,), generator=gen)
        self.cost_s = cost_s

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.cost_s:
            # Busy-wait, not sleep: a real __getitem__ (decoding, augmenting) spends CPU.
            end = time.perf_counter() + self.cost_s
            while time.perf_counter() < end:
                pass
        return self.x[i], self.y[i]


# -- clocks ---------------------------------------------------------------------------


_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
HAVE_PROC = os.path.isdir(f"/proc/{os.getpid()}/task")


def _live_children() -> list[int]:
    pids: list[int] = []
    base = f"/proc/{os.getpid()}/task"
    for tid in os.listdir(base):
        try:
            with open(f"{base}/{tid}/children") as f:
                pids.extend(int(p) for p in f.read().split())
        except OSError:
            continue  # the thread ended meanwhile
    return pids


def _process_cpu(pid: int) -> float:
    """CPU seconds of all threads of a live process (0 if it is gone)."""
    total_ns = 0
    try:
        tids = os.listdir(f"/proc/{pid}/task")
        for tid in tids:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                total_ns += int(f.read().split()[0])
        return total_ns / 1e9
    except FileNotFoundError:
        pass
    except OSError:
        return 0.0
    try:  # no schedstat (kernel without CONFIG_SCHED_INFO): clock ticks of stat
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / _TICK  # utime, stime
    except (OSError, IndexError, ValueError):
        return 0.0


def cpu_clock() -> float:
    """CPU seconds of this process plus all its worker processes, alive or reaped."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    live = sum(_process_cpu(pid) for pid in _live_children()) if HAVE_PROC else 0.0
    return time.process_time() + usage.ru_utime + usage.ru_stime + live


# -- cases ----------------------------------------------------------------------------


class WorkerStarts:
    """A ``worker_init_fn`` counting worker process starts in a shared counter."""

    def __init__(self) -> None:
        self.count = multiprocessing.get_context("fork").Value("i", 0)

    def __call__(self, worker_id: int) -> None:
        with self.count.get_lock():
            self.count.value += 1

    @property
    def value(self) -> int:
        return int(self.count.value)


@dataclass(frozen=True)
class Case:
    name: str
    num_workers: int = 0
    checkpoint: bool = False
    persistent: bool = False
    cost_s: float = 0.0
    target: float = 0.98


CASES = (
    Case("workers=0"),
    Case("workers=0 checkpoint", checkpoint=True),
    Case("workers=2", num_workers=2),
    Case("workers=2 checkpoint", num_workers=2, checkpoint=True),
    Case("workers=2 persistent", num_workers=2, persistent=True),
    Case("50us/item workers=0", cost_s=50e-6, target=0.99),
    Case("50us/item workers=2", num_workers=2, cost_s=50e-6, target=0.99),
)


@dataclass
class Side:
    cpu: list[float] = field(default_factory=list)
    wall: list[float] = field(default_factory=list)
    starts: int = 0


@dataclass
class Result:
    case: Case
    samples: int
    rounds: int
    plain: Side
    adaptive: Side

    def ratios(self, which: str) -> tuple[float, float]:
        """(median of per-round ratios, best-of ratio) of adaptive/plain throughput."""
        p: list[float] = getattr(self.plain, which)
        a: list[float] = getattr(self.adaptive, which)
        return statistics.median(self.per_round(which)), min(p) / min(a)

    def per_round(self, which: str) -> list[float]:
        p: list[float] = getattr(self.plain, which)
        a: list[float] = getattr(self.adaptive, which)
        return [tp / ta for tp, ta in zip(p, a, strict=True)]


def _epoch(batches: Iterable[Any]) -> int:
    count = 0
    for x, _ in batches:
        count += len(x)
    return count


def _adaptive_epoch(loader: adl.AdaptiveDataLoader, epochs: Iterator[int]) -> int:
    """The next epoch of one epoch loop that spans every round of a case.

    One loop for all rounds, as a training program has: each run of
    ``remaining_epochs_until`` ends with the final checkpoint of a finished
    training, which a program writes once, not once an epoch.
    """
    next(epochs)
    return _epoch(loader)


def _measure(run: Callable[[], int], n: int, side: Side) -> None:
    wall0, cpu0 = time.perf_counter(), cpu_clock()
    count = run()
    cpu1, wall1 = cpu_clock(), time.perf_counter()
    if count != n:
        raise RuntimeError(f"an epoch yielded {count} samples, expected {n}")
    side.cpu.append(cpu1 - cpu0)
    side.wall.append(wall1 - wall0)


def _fresh_job(checkpoint_dir: str | None) -> None:
    # Each case gets its own job so that the checkpoint directory (read when the job
    # starts) is on or off; the private reset is the one the tests use.
    _context._reset()
    os.environ.pop("ADAPTDL_CHECKPOINT_PATH", None)
    if checkpoint_dir is not None:
        os.environ["ADAPTDL_CHECKPOINT_PATH"] = checkpoint_dir
    adl.init_process_group("gloo")


def run_case(case: Case, n: int, rounds: int) -> Result:
    """Warm both loaders up with one epoch, then time ``rounds`` alternating rounds."""
    with tempfile.TemporaryDirectory(prefix="adaptdl-bench-") as tmp:
        _fresh_job(tmp if case.checkpoint else None)
        dataset = Samples(n, case.cost_s)
        starts_plain, starts_adaptive = WorkerStarts(), WorkerStarts()
        common: dict[str, Any] = {"num_workers": case.num_workers}
        if case.num_workers:
            common["persistent_workers"] = case.persistent
        plain = DataLoader(
            dataset, batch_size=BATCH_SIZE, shuffle=True, worker_init_fn=starts_plain, **common
        )
        adaptive = adl.AdaptiveDataLoader(
            dataset, batch_size=BATCH_SIZE, shuffle=True, worker_init_fn=starts_adaptive, **common
        )
        # One epoch loop over the warm-up and every round; it ends (and writes the
        # final checkpoint) after the measurements.
        epochs = iter(adl.remaining_epochs_until(rounds + 1))
        _epoch(plain)
        _adaptive_epoch(adaptive, epochs)
        before = starts_plain.value, starts_adaptive.value
        result = Result(case, n, rounds, Side(), Side())
        for r in range(rounds):
            sides = [
                (functools.partial(_epoch, plain), result.plain),
                (functools.partial(_adaptive_epoch, adaptive, epochs), result.adaptive),
            ]
            for run, side in sides if r % 2 == 0 else sides[::-1]:
                _measure(run, n, side)
        for _ in epochs:  # none is left: this ends the loop
            raise RuntimeError("the epoch loop outlived the rounds")
        result.plain.starts = starts_plain.value - before[0]
        result.adaptive.starts = starts_adaptive.value - before[1]
        del plain, adaptive  # persistent workers end with their loaders
        _context._reset()
    os.environ.pop("ADAPTDL_CHECKPOINT_PATH", None)
    return result


def report(results: Sequence[Result], file: Any = sys.stdout) -> None:
    """The table of ratios and worker starts, one line per case."""
    head = (
        f"{'case':<24} {'target':>6}  {'cpu med':>7} {'cpu q1-q3':>11} {'cpu best':>8}  "
        f"{'wall med':>8} {'wall best':>9}  {'verdict (cpu med)':<17}  "
        f"{'ms/epoch cpu plain/adapt':>24}  worker starts/epoch plain/adapt"
    )
    print(head, file=file)
    print("-" * len(head), file=file)
    for res in results:
        cpu_med, cpu_best = res.ratios("cpu")
        wall_med, wall_best = res.ratios("wall")
        q1, _, q3 = statistics.quantiles(res.per_round("cpu"), n=4)
        verdict = "meets" if cpu_med >= res.case.target else "MISSES"
        ms = (
            f"{1e3 * statistics.median(res.plain.cpu):.0f} / "
            f"{1e3 * statistics.median(res.adaptive.cpu):.0f}"
        )
        starts = f"{res.plain.starts / res.rounds:.1f} / {res.adaptive.starts / res.rounds:.1f}"
        print(
            f"{res.case.name:<24} {res.case.target:>6.2f}  {cpu_med:>7.3f} "
            f"{f'{q1:.3f}-{q3:.3f}':>11} {cpu_best:>8.3f}  "
            f"{wall_med:>8.3f} {wall_best:>9.3f}  {verdict:<17}  {ms:>24}  {starts}",
            file=file,
        )


def _plan(case: Case, quick: bool) -> tuple[int, int]:
    """(samples, rounds) of a case: about 5-20 s each on a quiet 2-core machine."""
    if quick:
        return (500, 2) if case.cost_s else (2_000, 2)
    if case.cost_s:
        return 10_000, 11
    # 61 rounds each: with workers the per-round ratios spread about +-5% (the worker
    # processes' scheduling), and 21 rounds let the median wander by ~1.5%: a
    # workers=2 case read 0.973 over 21 rounds and 1.001 over 201 on one tree.
    return 20_000, 61


def _cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run (under 30 s)")
    parser.add_argument(
        "--cases", help="comma-separated substrings of case names to run (default: all)"
    )
    args = parser.parse_args(argv)
    # (samples, rounds) for the in-memory and the 50 µs datasets.
    cases = [
        c
        for c in CASES
        if not args.cases or any(s.strip() in c.name for s in args.cases.split(","))
    ]
    torch.set_num_threads(1)
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "ADAPTDL_CHECKPOINT_PATH"):
        os.environ.pop(name, None)
    if not HAVE_PROC:
        print("no /proc: CPU time of live (persistent) workers is not counted", file=sys.stderr)
    print(
        f"AdaptiveDataLoader / DataLoader throughput ratio, batch {BATCH_SIZE}, one process; "
        f"load average {os.getloadavg()[0]:.2f} on {_cpus()} usable CPUs at the start"
    )
    results = []
    started = time.perf_counter()
    for case in cases:
        n, rounds = _plan(case, args.quick)
        results.append(run_case(case, n, rounds))
        print(f"  {case.name}: {n} samples x {rounds} rounds done", file=sys.stderr, flush=True)
    print()
    report(results)
    print(
        f"\nratio > 1: the adaptive loader is faster. med: median of per-round ratios (q1-q3: "
        f"their quartiles); best: fastest epoch of each side. "
        f"{time.perf_counter() - started:.0f} s in all; "
        f"load average {os.getloadavg()[0]:.2f} at the end."
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
