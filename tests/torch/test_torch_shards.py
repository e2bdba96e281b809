"""ShardedDataset, its readers, and AdaptiveDataLoader over it, in one process."""

from __future__ import annotations

import io
import itertools
import json
import mmap
import os
import subprocess
import sys
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import IterableDataset

import adaptdl.torch as adl
from adaptdl.core.decide.batchsize import RedecideSchedule
from adaptdl.core.loop.boundary import Preempted
from adaptdl.core.order.shards import BlockOrder
from adaptdl.torch import _context
from adaptdl.torch import shards as shards_module
from adaptdl.torch.data import AdaptiveDataLoader, current_dataloader
from adaptdl.torch.shards import (
    JsonLinesReader,
    ParquetReader,
    ShardedDataset,
    ShardedStream,
    TarReader,
)

COUNTS = [7, 30, 1, 0, 45, 37]  # 120 samples, an empty shard, one of a single sample


def write_jsonl(directory: Path, counts: list[int], blank_lines: bool = False) -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    paths, i = [], 0
    for s, count in enumerate(counts):
        path = directory / f"part-{s:03d}.jsonl"
        with open(path, "w", encoding="utf-8") as out:
            for _ in range(count):
                out.write(json.dumps({"i": i, "x": [float(i), -float(i)]}) + "\n")
                if blank_lines:
                    out.write("\n")
                i += 1
        paths.append(path)
    return paths


def write_tar(directory: Path, counts: list[int]) -> list[Path]:
    """WebDataset-style shards: each sample a .cls and a .txt member under one key."""
    directory.mkdir(parents=True, exist_ok=True)
    paths, i = [], 0
    for s, count in enumerate(counts):
        path = directory / f"shard-{s:03d}.tar"
        with tarfile.open(path, "w") as tar:
            for _ in range(count):
                for ext, data in (("cls", str(i).encode()), ("txt", b"text %d" % i)):
                    info = tarfile.TarInfo(f"samples/{i:06d}.{ext}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
                i += 1
        paths.append(path)
    return paths


def tar_sample(sample: dict[str, Any]) -> dict[str, Any]:
    return {"i": int(sample["cls"]), "key": sample["__key__"], "txt": sample["txt"].decode()}


def consume(loader: AdaptiveDataLoader, key: str = "i") -> list[int]:
    seen: list[int] = []
    for batch in loader:
        seen += batch[key].tolist()
    return seen


class Recording(JsonLinesReader):
    """A JSON-lines reader that counts the shards it scans."""

    def __init__(self) -> None:
        self.scans = 0

    def scan(self, stream: IO[bytes]) -> Iterator[int]:
        self.scans += 1
        return super().scan(stream)


def record_spans(
    ds: ShardedDataset, monkeypatch: pytest.MonkeyPatch
) -> list[tuple[int, int, int]]:
    """Every (shard, begin, end) byte span the dataset reads from now on."""
    spans: list[tuple[int, int, int]] = []
    read_span = ds._read_span

    def recording_span(shard: int, begin: int, end: int) -> bytes:
        spans.append((shard, begin, end))
        return read_span(shard, begin, end)

    ds.close()
    monkeypatch.setattr(ds, "_read_span", recording_span)
    return spans


# -- the dataset and its index -----------------------------------------------------------


def test_a_numpy_block_size_builds_and_reuses_the_index(tmp_path: Path) -> None:
    # Configuration files and argparse with numpy types give numpy integers: the index
    # (JSON) holds the checked plain int.
    paths = write_jsonl(tmp_path, COUNTS)
    ds = ShardedDataset(paths, Recording(), block_size=np.int64(4))
    assert type(ds.block_size) is int and len(ds) == 120
    assert ShardedDataset(paths, Recording(), block_size=4).index_path == ds.index_path


def test_jsonl_shards_are_counted_once_and_the_index_is_cached(tmp_path: Path) -> None:
    paths = write_jsonl(tmp_path, COUNTS)
    reader = Recording()
    ds = ShardedDataset(paths, reader, block_size=4)
    assert len(ds) == 120 and list(ds.index.counts) == COUNTS
    assert reader.scans == len(COUNTS)
    assert ds.index_path.parent == tmp_path and ds.index_path.exists() and ds.seek_path.exists()
    assert json.loads(ds.index_path.read_text())["block_size"] == 4
    # Built once: a second dataset reads the cached index.
    ShardedDataset(paths, reader, block_size=4)
    assert reader.scans == len(COUNTS)
    # Stale (a shard grew, or another block size): rebuilt.
    with open(paths[0], "a", encoding="utf-8") as out:
        out.write(json.dumps({"i": 120, "x": [0.0, 0.0]}) + "\n")
    assert len(ShardedDataset(paths, reader, block_size=4)) == 121
    assert reader.scans == 2 * len(COUNTS)
    # Another block size has its own index, and leaves this one in place.
    other = ShardedDataset(paths, reader, block_size=5)
    assert reader.scans == 3 * len(COUNTS) and other.index_path != ds.index_path
    ShardedDataset(paths, reader, block_size=4)
    assert reader.scans == 3 * len(COUNTS)


def test_a_damaged_index_is_rebuilt(tmp_path: Path) -> None:
    paths = write_jsonl(tmp_path, COUNTS)
    ds = ShardedDataset(paths, JsonLinesReader(), block_size=4)
    ds.index_path.write_text("{not json")
    assert len(ShardedDataset(paths, JsonLinesReader(), block_size=4)) == 120


def test_iterating_directly_yields_every_sample_once(tmp_path: Path) -> None:
    ds = ShardedDataset(write_jsonl(tmp_path, COUNTS, blank_lines=True), JsonLinesReader())
    assert [s["i"] for s in ds] == list(range(120))  # blank lines are not samples


def test_tar_samples_group_members_by_key(tmp_path: Path) -> None:
    ds = ShardedDataset(write_tar(tmp_path, [3, 0, 5]), TarReader(), transform=tar_sample)
    samples = list(ds)
    assert [s["i"] for s in samples] == list(range(8))
    assert samples[4] == {"i": 4, "key": "samples/000004", "txt": "text 4"}


class RecordsOnly:
    """A reader with only the protocol's required methods (no split): read through records."""

    def __init__(self) -> None:
        self.inner = JsonLinesReader()

    def scan(self, stream: IO[bytes]) -> Iterator[int]:
        return self.inner.scan(stream)

    def records(self, stream: IO[bytes]) -> Iterator[bytes]:
        return (line for line in stream if line.strip())

    def decode(self, record: bytes) -> Any:
        return json.loads(record)


@settings(max_examples=25, deadline=None)
@given(
    counts=st.lists(st.integers(0, 40), min_size=1, max_size=8).filter(lambda c: sum(c) > 0),
    block_size=st.integers(1, 20),
    seed=st.integers(0, 100),
    lo_frac=st.floats(0, 1),
)
def test_take_reads_the_samples_of_the_order_sequentially_from_block_starts(
    tmp_path_factory: pytest.TempPathFactory,
    counts: list[int],
    block_size: int,
    seed: int,
    lo_frac: float,
) -> None:
    for kind, write, reader, transform in (
        ("jsonl", write_jsonl, JsonLinesReader(), None),
        ("records", write_jsonl, RecordsOnly(), None),
        ("tar", write_tar, TarReader(), tar_sample),
    ):
        paths = write(tmp_path_factory.mktemp(kind), counts)
        ds = ShardedDataset(paths, reader, block_size=block_size, transform=transform)
        n = len(ds)
        order = BlockOrder(n, block_size, seed=seed)
        lo = int(lo_frac * n)
        with pytest.MonkeyPatch.context() as monkeypatch:
            spans = record_spans(ds, monkeypatch)
            assert [s["i"] for s in ds.take(order, lo, n)] == order.take(lo, n).tolist()
        assert spans or lo == n
        # One block cached, a bounded number of open files, whatever was read.
        assert lo == n or (ds._block is not None and len(ds._block[1]) <= block_size)
        assert len(ds._handles) <= ds._max_open <= 256
        # Each read is one span from a block start (or a shard's start, where a block
        # goes on into the next shard) to the next block start or the shard's end.
        block_starts = {ds._seek_position(b) for b in range(order.num_blocks)}
        sizes = [path.stat().st_size for path in paths]
        for shard, begin, end in spans:
            assert begin in block_starts | {0}
            assert end in block_starts | {sizes[shard]} and begin < end
        # Every block the positions fall in is read once, nothing else is read.
        blocks = {run.block for run in order.runs(lo, n)}
        assert ds.stats["blocks"] == len(blocks)
        assert ds.stats["records"] == sum(len(range(*order.block_span(b))) for b in blocks)


def test_open_shards_are_bounded_the_oldest_closed_first(tmp_path: Path) -> None:
    ds = ShardedDataset(write_jsonl(tmp_path, [3] * 12), JsonLinesReader(), block_size=2)
    assert ds._max_open >= 8  # local shards: descriptors, many kept
    ds._max_open = 3
    order = BlockOrder(len(ds), 2, seed=4)
    assert [s["i"] for s in ds.take(order, 0, 36)] == order.take(0, 36).tolist()
    assert len(ds._handles) == 3
    # Local shards are read through read-only maps, a slice per block.
    assert all(isinstance(h, mmap.mmap) for h in ds._handles.values())
    ds.close()
    assert ds._handles == {}
    assert [s["i"] for s in ds.take(order, 5, 9)] == order.take(5, 9).tolist()


def test_more_shards_than_stay_open_are_read_with_pread_not_maps(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(shards_module, "_OPEN_DESCRIPTORS", 8)
    monkeypatch.setattr(shards_module, "_descriptor_limit", lambda: 64)
    many = ShardedDataset(
        write_jsonl(tmp_path / "many", [3] * 12), JsonLinesReader(), block_size=2
    )
    few = ShardedDataset(write_jsonl(tmp_path / "few", [3] * 8), JsonLinesReader(), block_size=2)
    assert many._max_open == few._max_open == 8
    for ds, kind in ((many, int), (few, mmap.mmap)):
        order = BlockOrder(len(ds), 2, seed=4)
        assert [s["i"] for s in ds.take(order, 0, len(ds))] == order.take(0, len(ds)).tolist()
        assert 0 < len(ds._handles) <= 8
        assert all(type(h) is kind for h in ds._handles.values())
        ds.close()


TRUNCATE_AFTER_A_BATCH = """
import os, sys
import adaptdl.torch as adl
from adaptdl.torch.data import AdaptiveDataLoader
from adaptdl.torch.shards import JsonLinesReader, ShardedDataset
path, open_first = sys.argv[1], sys.argv[2] == "1"
ds = ShardedDataset([path], JsonLinesReader())
if open_first:  # the map is made before the file shrinks: reads past its end are refused
    ds.read_block(0, 0, 16)
else:  # the map is made after: a map shorter than the index counts is refused
    ds.close()
loader = AdaptiveDataLoader(ds, batch_size=16, shuffle=True)
try:
    for _ in adl.remaining_epochs_until(1):
        for k, _batch in enumerate(loader):
            if k == 0:
                os.truncate(path, 1000)
                if not open_first:
                    ds.close()
except ValueError as exc:
    print("refused:", exc)
    sys.exit(3)
"""


@pytest.mark.parametrize("open_first", [True, False])
def test_a_shard_truncated_while_read_is_a_clear_error_not_sigbus(
    tmp_path: Path, open_first: bool
) -> None:
    (path,) = write_jsonl(tmp_path, [20_000])
    env = {**os.environ, "ADAPTDL_CHECKPOINT_PATH": str(tmp_path / "ckpt")}
    done = subprocess.run(
        [sys.executable, "-c", TRUNCATE_AFTER_A_BATCH, str(path), str(int(open_first))],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )
    assert done.returncode == 3, (done.returncode, done.stdout, done.stderr[-2000:])
    assert "is 1000 bytes where its index counts" in done.stdout
    assert "delete the index" in done.stdout


def test_for_loader_takes_its_options_and_sets_no_sampler(tmp_path: Path) -> None:
    ds = ShardedDataset(write_jsonl(tmp_path, COUNTS), JsonLinesReader(), block_size=8)
    kwargs: dict[str, Any] = {"collate_fn": list, "drop_last": True, "num_workers": 0}
    stream = ShardedStream.for_loader(ds, True, 0, kwargs)
    assert kwargs == {"num_workers": 0}
    assert stream.collate_fn is list and stream.drop_last


def test_lengths_use_the_current_size_and_leave_the_plan_alone(tmp_path: Path) -> None:
    ds = ShardedDataset(write_jsonl(tmp_path, COUNTS), JsonLinesReader(), block_size=8)
    loader = AdaptiveDataLoader(ds, batch_size=5, shuffle=True)
    stream = loader.dataset
    assert isinstance(stream, ShardedStream)
    stream.start(0, 20, 1, 0, 4)
    plan = stream._plan
    assert len(loader) == 20  # 100 samples left at the target size 5
    assert len(stream.sampler) == 25  # at the size issued now, 4
    stream.sizes.resize(8, 0)
    stream.sizes.issue()
    assert len(stream.sampler) == 13  # 100 samples left at the size issued now, 8
    assert stream._plan is plan


def test_a_sole_reader_reads_each_sample_once_and_decodes_only_what_it_uses(
    tmp_path: Path,
) -> None:
    ds = ShardedDataset(write_jsonl(tmp_path, COUNTS), JsonLinesReader(), block_size=8)
    loader = AdaptiveDataLoader(ds, batch_size=5, shuffle=True)
    for _ in adl.remaining_epochs_until(1):
        assert sorted(consume(loader)) == list(range(120))
    assert ds.stats == {"blocks": 15, "records": 120, "decoded": 120}


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"shards": []}, "at least one shard"),
        ({"shards": "a.jsonl"}, "sequence of paths"),
        ({"block_size": 0}, r"block_size must be in \[1, 1048576\], got 0"),
        ({"block_size": 2**21}, r"block_size must be in \[1, 1048576\], got 2097152"),
        ({"reader": object()}, "reader must implement ShardReader"),
        ({"transform": 3}, "transform must be callable"),
    ],
)
def test_bad_arguments_are_refused(tmp_path: Path, kwargs: dict[str, Any], message: str) -> None:
    args: dict[str, Any] = {
        "shards": write_jsonl(tmp_path, [3]),
        "reader": JsonLinesReader(),
        **kwargs,
    }
    with pytest.raises(ValueError, match=message):
        ShardedDataset(args.pop("shards"), args.pop("reader"), **args)


def test_a_shard_shorter_than_its_index_is_an_error_not_other_samples(tmp_path: Path) -> None:
    """Records missing at read time must not be filled in from the next shard."""
    paths = write_jsonl(tmp_path, [6, 6])
    ds = ShardedDataset(paths, JsonLinesReader(), block_size=8)
    # Rewritten in place with the same size: one record fewer, padded with spaces.
    lines = paths[0].read_text().splitlines(keepends=True)
    paths[0].write_text("".join(lines[:5]) + " " * (len(lines[5]) - 1) + "\n")
    with pytest.raises(ValueError, match=r"ended after 5 of the 6 samples .* delete the index"):
        ds.read_block(0, 0, 8)


def test_a_block_holding_more_records_than_its_index_is_an_error(tmp_path: Path) -> None:
    paths = write_jsonl(tmp_path, [6])
    ds = ShardedDataset(paths, JsonLinesReader(), block_size=4)
    # Rewritten in place with the same size: line 1 becomes two lines.
    lines = paths[0].read_text().splitlines(keepends=True)
    lines[1] = "1" + " " * (len(lines[1]) - 4) + "\n2\n"
    paths[0].write_text("".join(lines))
    with pytest.raises(ValueError, match=r"holds 5 samples where its index counts 4 .* delete"):
        ds.read_block(0, 0, 4)


def test_shards_without_samples_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="must hold 1 to"):
        ShardedDataset(write_jsonl(tmp_path, [0, 0]), JsonLinesReader())


def test_remote_shards_go_through_fsspec(tmp_path: Path) -> None:
    fsspec = pytest.importorskip("fsspec")
    fs = fsspec.filesystem("memory")
    urls = []
    for path in write_jsonl(tmp_path / "local", [5, 9]):
        url = f"memory://adaptdl-test/{path.name}"
        fs.pipe(url, path.read_bytes())
        urls.append(url)
    with pytest.raises(ValueError, match="index_path is needed for remote shards"):
        ShardedDataset(urls, JsonLinesReader())
    ds = ShardedDataset(urls, JsonLinesReader(), index_path=tmp_path / "index.json", block_size=3)
    assert ds._max_open == 8  # remote files hold buffers: few are kept open
    order = BlockOrder(len(ds), 3, seed=1)
    assert [s["i"] for s in ds.take(order, 0, 14)] == order.take(0, 14).tolist()


def test_remote_shards_without_fsspec_name_the_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "fsspec", None)
    with pytest.raises(ImportError, match=r"adaptdl-torch\[fsspec\]"):
        ShardedDataset(["s3://bucket/a.jsonl"], JsonLinesReader(), index_path=tmp_path / "i.json")


def test_parquet_without_pyarrow_names_the_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    path = tmp_path / "part-000.parquet"
    path.write_bytes(b"PAR1")
    with pytest.raises(ImportError, match=r"adaptdl-torch\[parquet\]"):
        ShardedDataset([path], ParquetReader())


def test_a_positioned_reader_needs_read_at(tmp_path: Path) -> None:
    class HalfPositioned(JsonLinesReader):
        def open_state(self, stream: IO[bytes]) -> IO[bytes]:
            return stream

    with pytest.raises(ValueError, match="open_state but no read_at"):
        ShardedDataset(write_jsonl(tmp_path, [3]), HalfPositioned())


# -- AdaptiveDataLoader over shards ------------------------------------------------------


class Stream(IterableDataset[int]):
    def __iter__(self) -> Any:
        return iter(range(3))


def test_another_iterable_dataset_is_refused_naming_the_sharded_api() -> None:
    with pytest.raises(ValueError, match=r"adaptdl\.torch\.shards\.ShardedDataset"):
        AdaptiveDataLoader(Stream(), batch_size=2)


def with_pid(sample: dict[str, Any]) -> tuple[int, int]:
    """Sample ``i`` with the id of the process (a worker's, with workers) that read it."""
    return sample["i"], os.getpid()


@pytest.mark.parametrize(("workers", "persistent"), [(0, False), (2, False), (2, True)])
def test_a_batch_size_change_mid_pass_keeps_the_reader_and_every_sample_once(
    tmp_path: Path, workers: int, persistent: bool
) -> None:
    """A decision inside a pass changes the size in place: same workers, no new pass."""
    n = 120
    paths = write_jsonl(tmp_path, COUNTS)
    ds = ShardedDataset(paths, JsonLinesReader(), block_size=4, transform=with_pid)
    loader = AdaptiveDataLoader(
        ds, batch_size=4, shuffle=True, num_workers=workers, persistent_workers=persistent
    )
    loader.autoscale_batch_size(48, (1, 12))
    job = _context.current_job()
    # A new local size (no accumulation) decided at every optimiser step: the
    # schedule would otherwise wait a second before its first decision.
    decided = itertools.cycle([5, 3, 6, 4])
    job.batch_size_decision = lambda query: (next(decided), 0)
    job.redecide_schedule, job._next_redecide = RedecideSchedule(1e-9, 1e-9), 0.0
    calls = []
    batches = loader._sharded_batches

    def counting(rank: int) -> Any:
        made = batches(rank)

        def call(*args: int) -> Any:
            calls.append(args)
            return made(*args)

        return call

    loader._sharded_batches = counting  # type: ignore[method-assign]
    # (pass, sample ids, reading processes) of each batch, and the iterators seen.
    seen: list[tuple[tuple[int, int], list[int], set[int]]] = []
    iterators = set()
    for epoch in adl.remaining_epochs_until(2):
        for ids, readers in loader:
            helper = current_dataloader()
            assert helper is not None
            p = (epoch, (helper.current_index or 0) // n)
            seen.append((p, ids.tolist(), set(readers.tolist())))
            iterators.add(id(loader._iterator))
            if helper.is_optim_step():
                job.metrics.add_progress(1.0)
    by_pass = itertools.groupby(seen, key=lambda batch: batch[0])
    passes = {p: list(batches) for p, batches in by_pass}
    assert len(passes) == len({p for p, _, _ in seen})  # each pass read in one run
    complete = [b for b in passes.values() if sum(len(ids) for _, ids, _ in b) >= n]
    assert complete, passes
    for batches in complete:
        assert sorted(i for _, ids, _ in batches for i in ids) == list(range(n))
        assert len({len(ids) for _, ids, _ in batches[:-1]}) > 1  # sizes changed in the pass
        # Read by the same processes throughout the pass (one, or each worker).
        assert len(set().union(*(r for _, _, r in batches))) == max(workers, 1)
    # One reader per pass: no pass was started again at the new size.
    assert len(calls) == len(passes), calls
    if persistent:  # and the same workers across passes
        assert len({pid for _, _, r in seen for pid in r}) == 2 and len(iterators) == 1


@pytest.mark.parametrize("shuffle", [False, True])
def test_workers_read_disjoint_batches_in_the_same_order_as_one_process(
    tmp_path: Path, shuffle: bool
) -> None:
    ds = ShardedDataset(write_jsonl(tmp_path, COUNTS), JsonLinesReader(), block_size=4)
    orders = {}
    for workers in (0, 2):
        _context._reset()
        loader = AdaptiveDataLoader(ds, batch_size=7, shuffle=shuffle, num_workers=workers)
        assert len(loader) == 18
        orders[workers] = [consume(loader) for _ in adl.remaining_epochs_until(2)]
    assert orders[0] == orders[2]
    for order in orders[0]:
        assert sorted(order) == list(range(120))
    assert (orders[0][0] == list(range(120))) is not shuffle
    assert (orders[0][0] == orders[0][1]) is not shuffle


def test_tar_shards_through_the_loader_with_workers(tmp_path: Path) -> None:
    ds = ShardedDataset(write_tar(tmp_path, COUNTS), TarReader(), transform=tar_sample)
    loader = AdaptiveDataLoader(ds, batch_size=6, shuffle=True, num_workers=2)
    for _ in adl.remaining_epochs_until(1):
        batches = list(loader)
    seen = [i for b in batches for i in b["i"].tolist()]
    assert sorted(seen) == list(range(120))
    assert all(t == f"text {i}" for b in batches for i, t in zip(b["i"], b["txt"], strict=True))


def test_autoscale_with_accumulation_over_shards(tmp_path: Path) -> None:
    ds = ShardedDataset(write_jsonl(tmp_path, [64]), JsonLinesReader(), block_size=4)
    loader = AdaptiveDataLoader(ds, batch_size=16, shuffle=True)
    loader.autoscale_batch_size(64, (2, 16), gradient_accumulation=True)
    _context.current_job().batch_size_decision = lambda query: (4, 3)
    sizes, seen = [], []
    for _ in adl.remaining_epochs_until(1):
        for batch in loader:
            sizes.append(len(batch["i"]))
            seen += batch["i"].tolist()
            helper = current_dataloader()
            assert helper is not None
            if helper.is_optim_step():
                helper.job.metrics.add_progress(1.0)
    assert set(sizes) == {4} and len(sizes) == 16
    assert sorted(seen) == list(range(64))


@pytest.mark.parametrize("workers", [0, 2])
def test_exactly_once_across_a_restart_at_another_batch_size(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, workers: int
) -> None:
    monkeypatch.setenv("ADAPTDL_CHECKPOINT_PATH", str(tmp_path / "ckpt"))
    paths = write_jsonl(tmp_path / "data", COUNTS)
    seen: dict[int, list[int]] = {}

    def train(stop_after: int | None, batch_size: int) -> None:
        adl.init_process_group("gloo")
        job = _context.current_job()
        ds = ShardedDataset(paths, JsonLinesReader(), block_size=4)
        loader = AdaptiveDataLoader(ds, batch_size=batch_size, shuffle=True, num_workers=workers)
        steps = 0
        for epoch in adl.remaining_epochs_until(3):
            for batch in loader:
                seen.setdefault(epoch, []).extend(batch["i"].tolist())
                steps += 1
                if steps == stop_after:
                    job.request_stop()

    with pytest.raises(Preempted):
        train(stop_after=20, batch_size=9)
    _context._reset()
    train(stop_after=None, batch_size=5)
    for epoch in range(3):
        assert sorted(seen[epoch]) == list(range(120)), epoch
