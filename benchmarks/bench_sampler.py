"""Benchmark: our sampler's Shard against a materialised, stride-split permutation.

The peer is what torch's DistributedSampler (and the original AdaptDL sampler) do
each epoch: ``torch.randperm(n).tolist()`` and then ``[rank::num_replicas]``. Each
side runs in a fresh subprocess, so that neither one's memory or import cost leaks
into the other's figures; peak extra memory is ``ru_maxrss`` minus its value once
the imports are done.

    python benchmarks/bench_sampler.py            # n = 10**8 (the peer needs ~5 GB)
    python benchmarks/bench_sampler.py --quick    # n = 10**6, a smoke run
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable, Iterable
from itertools import islice
from typing import Any

TARGET_FIRST_MS = 1.0
TARGET_EXTRA_MB = 10.0
TARGET_BATCH_RATE = 20e6
BATCH = 1 << 16
# Local indices drawn per throughput measurement (fewer if the shard is shorter).
BATCH_DRAWS = 1 << 24
ITER_DRAWS = 1 << 22
REPEATS = 3


def peak_rss_mb() -> float:
    """Peak resident memory of this process so far, in MB (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def best_rate(draw: Callable[[], int]) -> float:
    """Best of a few runs of ``draw`` (which returns how many it drew), per CPU second.

    CPU time of this process, not wall time: on a shared machine the wall clock
    also counts the time other processes held the core.
    """
    best = 0.0
    for _ in range(REPEATS):
        start = time.process_time()
        drawn = draw()
        best = max(best, drawn / max(time.process_time() - start, 1e-9))
    return best


def consume(iterable: Iterable[int], count: int) -> int:
    """Pull ``count`` items at C speed, so only the iterator's own cost is timed."""
    deque(islice(iterable, count), maxlen=0)
    return count


def measure_ours(n: int, replicas: int, rank: int) -> dict[str, Any]:
    import numpy as np

    from adaptdl.core.order.sampling import Shard

    baseline = peak_rss_mb()
    start = time.perf_counter()
    shard = Shard(n, 0, replicas, rank, seed=0, epoch=0)
    first = next(iter(shard))
    first_s = time.perf_counter() - start
    first_extra = peak_rss_mb() - baseline

    count = len(shard)
    batch_draws = min(count, BATCH_DRAWS)
    iter_draws = min(count, ITER_DRAWS)

    def draw_batches() -> int:
        checksum = 0
        for lo in range(0, batch_draws, BATCH):
            checksum ^= int(shard.indices(lo, min(lo + BATCH, batch_draws))[-1])
        assert checksum >= 0
        return batch_draws

    batch_rate = best_rate(draw_batches)
    iter_rate = best_rate(lambda: consume(shard, iter_draws))
    assert isinstance(first, int)
    assert np.int64(first) < n
    return {
        "first_s": first_s,
        "first_extra_mb": first_extra,
        "batch_rate": batch_rate,
        "iter_rate": iter_rate,
        "drawing_extra_mb": peak_rss_mb() - baseline,
    }


def measure_peer(n: int, replicas: int, rank: int) -> dict[str, Any]:
    import torch

    baseline = peak_rss_mb()
    start = time.perf_counter()
    generator = torch.Generator()
    generator.manual_seed(0)
    local = torch.randperm(n, generator=generator).tolist()[rank::replicas]
    first = local[0]
    first_s = time.perf_counter() - start
    first_extra = peak_rss_mb() - baseline

    count = len(local)
    batch_draws = min(count, BATCH_DRAWS)
    iter_draws = min(count, ITER_DRAWS)

    def draw_batches() -> int:
        checksum = 0
        for lo in range(0, batch_draws, BATCH):
            checksum ^= local[lo : lo + BATCH][-1]
        assert checksum >= 0
        return batch_draws

    batch_rate = best_rate(draw_batches)
    iter_rate = best_rate(lambda: consume(iter(local), iter_draws))
    assert first < n
    return {
        "first_s": first_s,
        "first_extra_mb": first_extra,
        "batch_rate": batch_rate,
        "iter_rate": iter_rate,
        "drawing_extra_mb": peak_rss_mb() - baseline,
    }


def run_child(side: str, n: int, replicas: int, rank: int) -> dict[str, Any] | None:
    """Measure one side in a fresh interpreter; None (with the reason) if it failed."""
    command = [sys.executable, __file__, "--child", side, "--n", str(n)]
    command += ["--replicas", str(replicas), "--rank", str(rank)]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        print(f"{side}: failed ({result.returncode}): {result.stderr.strip()[-500:]}")
        return None
    figures: dict[str, Any] = json.loads(result.stdout.strip().splitlines()[-1])
    return figures


def fmt_rate(rate: float) -> str:
    return f"{rate / 1e6:,.1f} M/s"


def fmt_ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.3f} ms"


def fmt_mb(mb: float) -> str:
    return f"{mb:,.1f} MB"


def report(
    n: int, replicas: int, rank: int, ours: dict[str, Any], peer: dict[str, Any] | None
) -> None:
    print(f"bench_sampler: n={n:,}, {replicas} replicas, rank {rank}")
    print("peer: torch.randperm(n).tolist()[rank::num_replicas]; each side in its own process")
    print("time to first index is wall time; rates are per CPU second (best of 3)")
    rows: list[tuple[str, str, Callable[[float], str], bool]] = [
        # (label, key, format, higher is better)
        ("time to first local index", "first_s", fmt_ms, False),
        ("peak extra memory at first index", "first_extra_mb", fmt_mb, False),
        ("peak extra memory after drawing", "drawing_extra_mb", fmt_mb, False),
        (f"local indices/s, batches of {BATCH}", "batch_rate", fmt_rate, True),
        ("local indices/s, __iter__", "iter_rate", fmt_rate, True),
    ]
    print(f"{'':36} {'ours (Shard)':>16} {'peer':>16} {'ours vs peer':>14}")
    for label, key, fmt, higher in rows:
        mine = ours[key]
        if peer is None:
            print(f"{label:36} {fmt(mine):>16} {'n/a':>16} {'':>14}")
            continue
        theirs = peer[key]
        if higher:
            ratio = f"{mine / theirs:.3g}x" if theirs > 0 else "inf"
        else:
            # "Nx better" for costs: the peer's cost over ours.
            ratio = f"{theirs / mine:,.3g}x less" if mine > 0 else "-"
        print(f"{label:36} {fmt(mine):>16} {fmt(theirs):>16} {ratio:>14}")
    print("targets:")
    checks = [
        (f"first index within {TARGET_FIRST_MS:g} ms", ours["first_s"] * 1e3 <= TARGET_FIRST_MS),
        (
            f"under {TARGET_EXTRA_MB:g} MB extra memory",
            max(ours["first_extra_mb"], ours["drawing_extra_mb"]) < TARGET_EXTRA_MB,
        ),
        (
            f"at least {TARGET_BATCH_RATE / 1e6:g} M local indices/s in batches",
            ours["batch_rate"] >= TARGET_BATCH_RATE,
        ),
    ]
    for label, ok in checks:
        print(f"  {'met ' if ok else 'MISS'} {label}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=None, help="dataset length (default 10**8)")
    parser.add_argument("--quick", action="store_true", help="smoke run with n = 10**6")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--no-peer", action="store_true", help="measure only our sampler")
    parser.add_argument("--child", choices=["ours", "peer"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    n = args.n if args.n is not None else (10**6 if args.quick else 10**8)
    if not (n >= 1 and args.replicas >= 1 and 0 <= args.rank < args.replicas):
        parser.error("need n >= 1, replicas >= 1 and 0 <= rank < replicas")

    if args.child is not None:
        measure = measure_ours if args.child == "ours" else measure_peer
        print(json.dumps(measure(n, args.replicas, args.rank)))
        return

    ours = run_child("ours", n, args.replicas, args.rank)
    if ours is None:
        sys.exit(1)
    peer = None if args.no_peer else run_child("peer", n, args.replicas, args.rank)
    report(n, args.replicas, args.rank, ours, peer)


if __name__ == "__main__":
    main()
