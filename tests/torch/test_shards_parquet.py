"""Parquet shards (ParquetReader, through pyarrow) read by ShardedDataset and the loader.

pyarrow is an optional extra: these tests are skipped without it (``nox -s streaming``
installs it).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import adaptdl.torch as adl
from adaptdl.core.loop.boundary import Preempted
from adaptdl.core.order.shards import BlockOrder
from adaptdl.torch import _context
from adaptdl.torch.data import AdaptiveDataLoader
from adaptdl.torch.shards import ParquetReader, ShardedDataset

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

COUNTS = [7, 30, 1, 0, 45, 37]  # 120 rows, an empty shard, one of a single row


def write_parquet(directory: Path, counts: list[int], row_group_size: int) -> list[Path]:
    """Rows {"i", "x", "name"} numbered across shards, in row groups of ``row_group_size``."""
    directory.mkdir(parents=True, exist_ok=True)
    paths, i = [], 0
    for s, count in enumerate(counts):
        ids = list(range(i, i + count))
        table = pa.table(
            {
                "i": pa.array(ids, type=pa.int64()),
                "x": pa.array([float(k) / 2 for k in ids], type=pa.float64()),
                "name": pa.array([f"row {k}" for k in ids], type=pa.string()),
            }
        )
        path = directory / f"part-{s:03d}.parquet"
        pq.write_table(table, path, row_group_size=row_group_size)
        paths.append(path)
        i += count
    return paths


class DecodeLog:
    """Records every row group pyarrow decodes: (which open file, row group)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.groups: list[tuple[int, int]] = []
        read = pq.ParquetFile.read_row_group

        def recording(file: Any, group: int, *args: Any, **kwargs: Any) -> Any:
            self.groups.append((id(file), group))
            return read(file, group, *args, **kwargs)

        monkeypatch.setattr(pq.ParquetFile, "read_row_group", recording)


# (rows per shard, rows per row group, block size, seed, where the read starts)
layouts = st.tuples(
    st.lists(st.integers(0, 60), min_size=1, max_size=6).filter(lambda c: sum(c) > 0),
    st.integers(1, 25),
    st.integers(1, 20),
    st.integers(0, 100),
    st.floats(0, 1),
)


@settings(max_examples=20, deadline=None)
@given(layout=layouts)
def test_take_reads_the_rows_of_the_order(
    tmp_path_factory: pytest.TempPathFactory, layout: tuple[list[int], int, int, int, float]
) -> None:
    counts, row_group_size, block_size, seed, lo_frac = layout
    paths = write_parquet(tmp_path_factory.mktemp("pq"), counts, row_group_size)
    ds = ShardedDataset(paths, ParquetReader(), block_size=block_size)
    assert list(ds.index.counts) == counts
    n = len(ds)
    order = BlockOrder(n, block_size, seed=seed)
    lo = int(lo_frac * n)
    samples = ds.take(order, lo, n)
    assert [s["i"] for s in samples] == order.take(lo, n).tolist()
    assert all(s == {"i": s["i"], "x": s["i"] / 2, "name": f"row {s['i']}"} for s in samples)
    assert len(ds._handles) <= 8


def test_a_sequential_pass_decodes_each_row_group_once_from_its_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    paths = write_parquet(tmp_path, COUNTS, row_group_size=8)
    ds = ShardedDataset(paths, ParquetReader(columns=["i"]), block_size=5)
    log = DecodeLog(monkeypatch)
    assert list(ds) == [{"i": i} for i in range(120)]
    # Row groups are the sequential unit: each decoded whole, once, though blocks of
    # 5 rows cut across them.
    groups = Counter(log.groups)
    assert set(groups.values()) == {1}
    assert len(groups) == sum(-(-c // 8) for c in COUNTS)


def test_parquet_through_the_loader_exactly_once_across_a_restart(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ADAPTDL_CHECKPOINT_PATH", str(tmp_path / "ckpt"))
    paths = write_parquet(tmp_path / "data", COUNTS, row_group_size=6)
    seen: dict[int, list[int]] = {}

    def train(stop_after: int | None, batch_size: int, workers: int) -> None:
        adl.init_process_group("gloo")
        job = _context.current_job()
        ds = ShardedDataset(paths, ParquetReader(columns=["i", "x"]), block_size=4)
        loader = AdaptiveDataLoader(ds, batch_size=batch_size, shuffle=True, num_workers=workers)
        steps = 0
        for epoch in adl.remaining_epochs_until(2):
            for batch in loader:
                assert batch["x"].tolist() == [i / 2 for i in batch["i"].tolist()]
                seen.setdefault(epoch, []).extend(batch["i"].tolist())
                steps += 1
                if steps == stop_after:
                    job.request_stop()

    with pytest.raises(Preempted):
        train(stop_after=9, batch_size=8, workers=2)
    _context._reset()
    train(stop_after=None, batch_size=5, workers=0)
    for epoch in range(2):
        assert sorted(seen[epoch]) == list(range(120)), epoch


def test_bad_columns_are_refused() -> None:
    with pytest.raises(ValueError, match="columns must be a sequence of column names"):
        ParquetReader(columns="i")
