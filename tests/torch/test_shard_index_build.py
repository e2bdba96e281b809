"""The shard index is built once by real processes racing for it, with no collective.

Several processes (replicas of one job on one host) construct the same
`ShardedDataset` at once, before `init_process_group`; one scans the shards, the
others wait for its lock and read what it wrote; then they form a gloo process
group and agree on the dataset. A builder killed mid-scan leaves no lock held.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import pytest
import torch.distributed as dist

import torch
from adaptdl.torch.shards import JsonLinesReader, ShardedDataset

COUNTS = [40, 3, 0, 25, 52]
REPLICAS = 4
TIMEOUT = 120.0  # generous: the test machine is shared and loaded
FORK = multiprocessing.get_context("fork")


def write_jsonl(directory: Path, counts: list[int]) -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    paths, i = [], 0
    for s, count in enumerate(counts):
        path = directory / f"part-{s:03d}.jsonl"
        path.write_text("".join(json.dumps({"i": i + k}) + "\n" for k in range(count)))
        i += count
        paths.append(path)
    return paths


class LoggedScans(JsonLinesReader):
    """Appends "pid shard-start" to a log for every shard it scans, slowly."""

    def __init__(self, log: Path, delay: float = 0.2, stall: Any = None) -> None:
        self.log = log
        self.delay = delay
        self.stall = stall  # an Event: set on the first scan, then sleep "forever"

    def scan(self, stream: IO[bytes]) -> Iterator[int]:
        with open(self.log, "a", encoding="utf-8") as out:
            out.write(f"{os.getpid()}\n")
        if self.stall is not None:
            self.stall.set()
            time.sleep(600)
        time.sleep(self.delay)  # so that the others arrive while it builds
        return super().scan(stream)


def replica(rank: int, paths: list[Path], log: Path, store: Path, out: Path, barrier: Any) -> None:
    barrier.wait(TIMEOUT)
    # Constructed before the process group exists: nothing here may be collective.
    ds = ShardedDataset(paths, LoggedScans(log), block_size=8)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=REPLICAS)
    sizes = torch.tensor([len(ds), ds.index.counts[0]])
    gathered = [torch.zeros_like(sizes) for _ in range(REPLICAS)]
    dist.all_gather(gathered, sizes)
    samples = [s["i"] for s in ds]
    dist.destroy_process_group()
    out.write_text(json.dumps({"gathered": [g.tolist() for g in gathered], "samples": samples}))


def scans(log: Path) -> list[int]:
    return [int(line) for line in log.read_text().split()] if log.exists() else []


def join(process: Any) -> int:
    process.join(TIMEOUT)
    if process.is_alive():
        process.kill()
        process.join()
        pytest.fail(f"process {process.pid} did not finish in {TIMEOUT} s")
    return int(process.exitcode)


def test_replicas_racing_for_the_index_scan_the_shards_once(tmp_path: Path) -> None:
    paths = write_jsonl(tmp_path / "data", COUNTS)
    log = tmp_path / "scans.log"
    barrier = FORK.Barrier(REPLICAS)
    processes = [
        FORK.Process(
            target=replica,
            args=(r, paths, log, tmp_path / "store", tmp_path / f"out-{r}.json", barrier),
        )
        for r in range(REPLICAS)
    ]
    for p in processes:
        p.start()
    assert [join(p) for p in processes] == [0] * REPLICAS
    # One process scanned every shard once; the others read its index.
    scanners = scans(log)
    assert len(scanners) == len(COUNTS) and len(set(scanners)) == 1
    assert scanners[0] in {p.pid for p in processes}
    n = sum(COUNTS)
    for r in range(REPLICAS):
        result = json.loads((tmp_path / f"out-{r}.json").read_text())
        assert result["gathered"] == [[n, COUNTS[0]]] * REPLICAS
        assert result["samples"] == list(range(n))


def build_stalled(paths: list[Path], log: Path, stall: Any) -> None:
    ShardedDataset(paths, LoggedScans(log, stall=stall), block_size=8)


def build(paths: list[Path], log: Path, out: Path) -> None:
    ds = ShardedDataset(paths, LoggedScans(log, delay=0.0), block_size=8)
    out.write_text(json.dumps([s["i"] for s in ds]))


def test_a_builder_killed_mid_scan_leaves_the_lock_to_the_next(tmp_path: Path) -> None:
    paths = write_jsonl(tmp_path / "data", COUNTS)
    log = tmp_path / "scans.log"
    stall = FORK.Event()
    first = FORK.Process(target=build_stalled, args=(paths, log, stall))
    first.start()
    assert stall.wait(TIMEOUT), "the first builder never started scanning"
    second = FORK.Process(target=build, args=(paths, log, tmp_path / "out.json"))
    second.start()
    # The second waits for the first's lock instead of scanning too.
    time.sleep(1.0)
    assert second.is_alive() and scans(log) == [first.pid]
    assert first.pid is not None
    os.kill(first.pid, signal.SIGKILL)
    first.join(TIMEOUT)
    assert join(second) == 0
    assert scans(log) == [first.pid] + [second.pid] * len(COUNTS)
    assert json.loads((tmp_path / "out.json").read_text()) == list(range(sum(COUNTS)))
    # The index it wrote is the one a later dataset reads, without scanning.
    ShardedDataset(paths, LoggedScans(log), block_size=8)
    assert len(scans(log)) == 1 + len(COUNTS)
