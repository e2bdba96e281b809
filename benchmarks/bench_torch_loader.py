"""Benchmark: AdaptiveDataLoader iteration throughput against a plain DataLoader.

Both iterate the same in-memory dataset with the same batch size, shuffled, in one
process (one replica); the rounds alternate so that drift in machine load hits
both sides alike. The figure is the ratio of the adaptive loader's samples per
second to the plain one's (target: at least 0.97), from the best round of each
side (the least disturbed by other load) and, for reference, the median of the
per-round ratios.

    python benchmarks/bench_torch_loader.py
    python benchmarks/bench_torch_loader.py --quick
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable

from torch.utils.data import DataLoader, Dataset

import adaptdl.torch as adl
import torch

TARGET_RATIO = 0.97


class Samples(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """A map-style dataset of (features, label) rows: the common case of a Dataset."""

    def __init__(self, n: int) -> None:
        gen = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 32, generator=gen)
        self.y = torch.randint(0, 10, (n,), generator=gen)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


def plain_epoch(loader: DataLoader) -> int:  # type: ignore[type-arg]
    count = 0
    for x, _ in loader:
        count += len(x)
    return count


def adaptive_epoch(loader: adl.AdaptiveDataLoader, epoch: int) -> int:
    count = 0
    for _ in adl.remaining_epochs_until(epoch + 1):
        for x, _ in loader:
            count += len(x)
    return count


def timed(epoch: Callable[[], int], n: int) -> float:
    start = time.perf_counter()
    count = epoch()
    elapsed = time.perf_counter() - start
    assert count == n, (count, n)
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smaller smoke run")
    parser.add_argument("--batch-size", type=int, default=64)
    args = parser.parse_args()
    n, rounds = (10_000, 3) if args.quick else (30_000, 15)
    torch.set_num_threads(1)
    adl.init_process_group("gloo")
    dataset = Samples(n)
    plain = DataLoader(dataset, batch_size=args.batch_size, shuffle=True)
    adaptive = adl.AdaptiveDataLoader(dataset, batch_size=args.batch_size, shuffle=True)
    plain_epoch(plain)  # warm up both
    adaptive_epoch(adaptive, 0)
    ratios, plain_times, adaptive_times = [], [], []
    for r in range(rounds):
        run_adaptive = functools.partial(adaptive_epoch, adaptive, r + 1)
        run_plain = functools.partial(plain_epoch, plain)
        # Alternate which side goes first, so that neither always runs warmer.
        if r % 2:
            t_adaptive = timed(run_adaptive, n)
            t_plain = timed(run_plain, n)
        else:
            t_plain = timed(run_plain, n)
            t_adaptive = timed(run_adaptive, n)
        ratios.append(t_plain / t_adaptive)
        plain_times.append(t_plain)
        adaptive_times.append(t_adaptive)
        print(
            f"round {r}: DataLoader {n / t_plain:10.0f} samples/s  "
            f"AdaptiveDataLoader {n / t_adaptive:10.0f} samples/s  ratio {ratios[-1]:.3f}"
        )
    ratio = min(plain_times) / min(adaptive_times)
    verdict = "meets" if ratio >= TARGET_RATIO else "misses"
    print(
        f"AdaptiveDataLoader / DataLoader throughput ratio (best of {rounds} rounds each): "
        f"{ratio:.3f} ({verdict} the target >= {TARGET_RATIO}); "
        f"median of per-round ratios {statistics.median(ratios):.3f}"
    )


if __name__ == "__main__":
    main()
