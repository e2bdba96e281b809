"""Benchmark: reading JSON-lines shards through AdaptiveDataLoader against a plain read.

The plain side opens each shard in turn in text mode, decodes every line with
``json.loads`` (what ``JsonLinesReader.decode`` is) and hands the samples over in
lists of the batch size: the fastest simple loop a single process can stream them
with, in file order. Our side reads the same shards as a ``ShardedDataset``
through ``AdaptiveDataLoader`` (one replica, no workers, samples handed over as
lists, shuffled: blocks in permuted order, samples permuted within blocks).

Each case warms both sides up with one pass, then runs alternating rounds (which
side goes first alternates), one pass per side per round. The figure to judge by
is the median over rounds of the per-round CPU-time ratio (plain CPU seconds over
ours, for the same samples: >1 means ours is faster; target >= 0.9): on a shared
machine other processes stretch wall time, much less the CPU time this process
spends. Also printed: the quartiles of the per-round CPU ratios, the best-of ratio
(fastest pass of each side), the wall-time median ratio, and CPU ms per pass.

It also prints the read amplification (samples read over samples used) that
core's order gives for several block sizes, local batch sizes and replica counts,
from core alone, with one cached block per reader.

    python benchmarks/bench_shards.py            # about a minute
    python benchmarks/bench_shards.py --quick    # a smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import adaptdl.torch as adl
import torch
from adaptdl.core.order.shards import DEFAULT_BLOCK_SIZE, BlockOrder, StreamPlan
from adaptdl.torch.shards import JsonLinesReader, ShardedDataset

TARGET_RATIO = 0.9


def write_shards(directory: Path, shards: int, per_shard: int, words: int) -> list[Path]:
    """JSON lines of an id, a label and a text of ``words`` words (~6 bytes each)."""
    rng = random.Random(0)
    vocabulary = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta"]
    paths, i = [], 0
    for s in range(shards):
        path = directory / f"part-{s:04d}.jsonl"
        with open(path, "w", encoding="utf-8") as out:
            for _ in range(per_shard):
                text = " ".join(rng.choice(vocabulary) for _ in range(words))
                out.write(json.dumps({"id": i, "label": i % 10, "text": text}) + "\n")
                i += 1
        paths.append(path)
    return paths


def plain_pass(paths: list[Path], batch_size: int) -> int:
    """Every line in file order, decoded and handed over in lists of ``batch_size``."""
    count, batch = 0, []
    for path in paths:
        with open(path, encoding="utf-8") as f:
            for line in f:
                batch.append(json.loads(line))
                if len(batch) == batch_size:
                    count, batch = count + len(batch), []
    return count + len(batch)


def adaptive_pass(loader: adl.AdaptiveDataLoader) -> int:
    """The job's next epoch through the loader."""
    count = 0
    for _ in adl.remaining_epochs_until(adl.finished_epochs() + 1):
        for batch in loader:
            count += len(batch)
    return count


def timed(run: Callable[[], int], n: int) -> tuple[float, float]:
    """(CPU seconds, wall seconds) of one pass, which must yield ``n`` samples."""
    wall, cpu = time.perf_counter(), time.process_time()
    count = run()
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    if count != n:
        raise RuntimeError(f"a pass yielded {count} samples, expected {n}")
    return cpu, wall


def amplification(n: int, block_size: int, replicas: int, local_bsz: int) -> float:
    """Samples read over samples used in one pass, each replica caching one block."""
    order = BlockOrder(n, block_size, seed=0)
    read = 0
    for rank in range(replicas):
        cached = -1
        for chunk in StreamPlan(n, block_size, 0, 0, 0, replicas, rank, local_bsz).chunks():
            for run in order.runs(chunk.lo, chunk.hi):
                if run.block != cached:
                    read += run.stop - run.start
                    cached = run.block
    return read / n


def compare(paths: list[Path], n: int, block_size: int, batch_size: int, rounds: int) -> None:
    """Alternating rounds of the plain read and our loader; prints the ratios."""
    dataset = ShardedDataset(paths, JsonLinesReader(), block_size=block_size)
    loader = adl.AdaptiveDataLoader(dataset, batch_size=batch_size, shuffle=True, collate_fn=list)
    plain_pass(paths, batch_size)  # warm the page cache and both code paths
    adaptive_pass(loader)
    plain: list[tuple[float, float]] = []
    ours: list[tuple[float, float]] = []
    for r in range(rounds):
        sides = [
            (lambda: plain_pass(paths, batch_size), plain),
            (lambda: adaptive_pass(loader), ours),
        ]
        for run, times in sides if r % 2 == 0 else sides[::-1]:
            times.append(timed(run, n))
    cpu = [p[0] / o[0] for p, o in zip(plain, ours, strict=True)]
    wall = [p[1] / o[1] for p, o in zip(plain, ours, strict=True)]
    q1, _, q3 = statistics.quantiles(cpu, n=4)
    best = min(c for c, _ in plain) / min(c for c, _ in ours)
    verdict = "meets" if statistics.median(cpu) >= TARGET_RATIO else "MISSES"
    ms = f"{1e3 * statistics.median(c for c, _ in plain):.0f} / "
    ms += f"{1e3 * statistics.median(c for c, _ in ours):.0f}"
    print(
        f"  {block_size:5d}  {batch_size:5d}  {statistics.median(cpu):7.3f} "
        f"{f'{q1:.3f}-{q3:.3f}':>11} {best:8.3f}  {statistics.median(wall):8.3f}  "
        f"{verdict:<7}  {ms:>13}  {n / statistics.median(c for c, _ in ours):9.0f}",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smaller smoke run")
    parser.add_argument("--words", type=int, default=150, help="words of text per sample")
    args = parser.parse_args()
    shards, per_shard, rounds = (8, 1000, 4) if args.quick else (32, 2500, 15)
    n = shards * per_shard
    torch.set_num_threads(1)
    adl.init_process_group("gloo")
    with tempfile.TemporaryDirectory() as tmp:
        paths = write_shards(Path(tmp), shards, per_shard, args.words)
        size = sum(p.stat().st_size for p in paths) / n
        print(
            f"sharded AdaptiveDataLoader / plain sequential read, throughput ratio from CPU "
            f"time ({n} JSON lines of ~{size:.0f} bytes in {shards} shards, {rounds} "
            f"alternating rounds; load average {os.getloadavg()[0]:.2f} at the start):"
        )
        print(
            "  block  batch  cpu med   cpu q1-q3 cpu best  wall med  verdict  "
            "ms cpu pl/ours  ours samples/cpu-s"
        )
        for block_size, batch_size in (
            (DEFAULT_BLOCK_SIZE, 64),
            (DEFAULT_BLOCK_SIZE, 256),
            (64, 64),
            (256, 256),
        ):
            compare(paths, n, block_size, batch_size, rounds)
    # More shards than a reader keeps open (256 at most): shuffled blocks mostly open
    # their shard again, which is read with a pread per block instead of a map.
    many = (300, 20) if args.quick else (1000, 80)
    with tempfile.TemporaryDirectory() as tmp:
        paths = write_shards(Path(tmp), *many, args.words)
        print(f"the same with {many[0]} shards of {many[1]} lines (more than stay open):")
        compare(paths, many[0] * many[1], DEFAULT_BLOCK_SIZE, 64, rounds)
    print(
        f"  ratio > 1: ours is faster; target {TARGET_RATIO} on the CPU median. Load average "
        f"{os.getloadavg()[0]:.2f} at the end."
    )
    print("read amplification (samples read / used), one cached block per replica:")
    print("  block  local batch   R=1    R=2    R=4    R=8")
    for block_size in (4, 16, 64, 256):
        for local_bsz in (24, 100, 250):
            row = [amplification(20_000, block_size, r, local_bsz) for r in (1, 2, 4, 8)]
            print(f"  {block_size:5d}  {local_bsz:11d}  " + "  ".join(f"{a:5.2f}" for a in row))


if __name__ == "__main__":
    main()
