"""Benchmark: reading JSON-lines shards through AdaptiveDataLoader against a plain read.

The plain side opens each shard in turn, decodes every line with ``json.loads``
and hands the samples over in lists of the batch size: the fastest a single
process can stream them, in file order. Our
side reads the same shards as a ``ShardedDataset`` through ``AdaptiveDataLoader``
(one replica, no workers, samples handed over as lists, shuffled: blocks in
permuted order, samples permuted within blocks). Rounds alternate so that drift in
machine load hits both alike; the figure is the ratio of samples per second (best
round of each side; target >= 0.9), with CPU seconds per side.

It also prints the read amplification (samples read over samples used) that
core's order gives for several block sizes, local batch sizes and replica counts,
from core alone, with one cached block per reader.

    python benchmarks/bench_shards.py
    python benchmarks/bench_shards.py --quick
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import adaptdl.torch as adl
import torch
from adaptdl.core.shards import DEFAULT_BLOCK_SIZE, BlockOrder, micro_batches
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
        with open(path, "rb") as f:
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
    wall, cpu = time.perf_counter(), time.process_time()
    count = run()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    assert count == n, (count, n)
    return wall, cpu


def amplification(n: int, block_size: int, replicas: int, local_bsz: int) -> float:
    """Samples read over samples used in one pass, each replica caching one block."""
    order = BlockOrder(n, block_size, seed=0)
    read = 0
    for rank in range(replicas):
        cached = -1
        for chunk in micro_batches(n, 0, replicas, rank, local_bsz):
            for run in order.runs(chunk.lo, chunk.hi):
                if run.block != cached:
                    read += run.stop - run.start
                    cached = run.block
    return read / n


def compare(paths: list[Path], n: int, block_size: int, batch_size: int, rounds: int) -> None:
    """Alternating rounds of the plain read and our loader; prints the ratio."""
    dataset = ShardedDataset(paths, JsonLinesReader(), block_size=block_size)
    loader = adl.AdaptiveDataLoader(dataset, batch_size=batch_size, shuffle=True, collate_fn=list)
    plain_pass(paths, batch_size)  # warm the page cache and both code paths
    adaptive_pass(loader)
    plain, ours, ratios = [], [], []
    for r in range(rounds):
        sides = [
            ("plain", lambda: plain_pass(paths, batch_size)),
            ("ours", lambda: adaptive_pass(loader)),
        ]
        if r % 2:  # alternate which side goes first
            sides.reverse()
        times = {name: timed(run, n) for name, run in sides}
        plain.append(times["plain"])
        ours.append(times["ours"])
        ratios.append(times["plain"][0] / times["ours"][0])
    ratio = min(t for t, _ in plain) / min(t for t, _ in ours)
    cpu = statistics.median(c for _, c in plain) / statistics.median(c for _, c in ours)
    verdict = "meets" if ratio >= TARGET_RATIO else "misses"
    print(
        f"  block {block_size:4d}, batch {batch_size:4d}: {n / min(t for t, _ in ours):9.0f} "
        f"samples/s vs {n / min(t for t, _ in plain):9.0f}: ratio {ratio:.3f} ({verdict} "
        f"{TARGET_RATIO}; median of rounds {statistics.median(ratios):.3f}); CPU ratio {cpu:.3f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smaller smoke run")
    parser.add_argument("--words", type=int, default=150, help="words of text per sample")
    args = parser.parse_args()
    shards, per_shard, rounds = (8, 1000, 3) if args.quick else (32, 2500, 7)
    n = shards * per_shard
    torch.set_num_threads(1)
    adl.init_process_group("gloo")
    with tempfile.TemporaryDirectory() as tmp:
        paths = write_shards(Path(tmp), shards, per_shard, args.words)
        size = sum(p.stat().st_size for p in paths) / n
        print(
            f"sharded AdaptiveDataLoader / plain sequential read, samples per second (best of "
            f"{rounds} rounds each; {n} JSON lines of ~{size:.0f} bytes in {shards} shards):"
        )
        for block_size, batch_size in (
            (DEFAULT_BLOCK_SIZE, 64),
            (DEFAULT_BLOCK_SIZE, 256),
            (64, 64),
            (256, 256),
        ):
            compare(paths, n, block_size, batch_size, rounds)
    print("read amplification (samples read / used), one cached block per replica:")
    print("  block  local batch   R=1    R=2    R=4    R=8")
    for block_size in (4, 16, 64, 256):
        for local_bsz in (24, 100, 250):
            row = [amplification(20_000, block_size, r, local_bsz) for r in (1, 2, 4, 8)]
            print(f"  {block_size:5d}  {local_bsz:11d}  " + "  ".join(f"{a:5.2f}" for a in row))


if __name__ == "__main__":
    main()
