"""Parquet shards for `adaptdl.torch.shards.ShardedDataset`, read through pyarrow.

A sample is a row, as a dict of its columns (``columns`` selects them). Parquet is
not a stream of records that can be split at byte positions: its sequential unit
is the row group (each column chunk of a row group is read and decoded whole). So
`ParquetReader` is a positioned reader: a sample's position is its row number in
the file, and reading ``count`` rows from a position decodes the row groups they
lie in, from their starts, keeping the last decoded row group for the next block.

Reads per block: a block inside one row group decodes that row group (unless it
is the one kept); in a shuffled pass, blocks come from row groups in random order,
so write shards whose row groups hold about ``block_size`` rows (or choose a
``block_size`` of about the row-group size) to keep the decoding close to 1x.
Memory: one decoded row group per reader process, whatever the corpus size.

Needs pyarrow: ``pip install 'adaptdl-torch[parquet]'``.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterator, Sequence
from typing import IO, Any

__all__ = ["ParquetReader"]


def _parquet() -> Any:
    try:
        import pyarrow.parquet as pq
    except ImportError as exc:
        raise ImportError(
            "reading Parquet shards needs pyarrow: pip install 'adaptdl-torch[parquet]'"
        ) from exc
    return pq


class _ParquetShard:
    """One open Parquet file: its row groups' first rows, and the stream it reads."""

    def __init__(self, stream: IO[bytes]) -> None:
        self.stream = stream
        self.file = _parquet().ParquetFile(stream)
        meta = self.file.metadata
        sizes = [meta.row_group(g).num_rows for g in range(meta.num_row_groups)]
        self.starts = [0, *itertools.accumulate(sizes)]

    def close(self) -> None:
        self.stream.close()


class ParquetReader:
    """Parquet shards: a sample is one row, as a dict ``{column: value}``.

    ``columns`` names the columns to read (all when None). See the module's
    docstring for how row groups are read.
    """

    def __init__(self, columns: Sequence[str] | None = None) -> None:
        if columns is not None and (
            isinstance(columns, (str, bytes)) or not all(isinstance(c, str) and c for c in columns)
        ):
            raise ValueError(
                f"columns must be a sequence of column names or None, got {columns!r}"
            )
        self.columns = None if columns is None else list(columns)
        # (the shard it came from, row group, decoded table): the last row group read.
        self._kept: tuple[_ParquetShard, int, Any] | None = None

    def __getstate__(self) -> dict[str, Any]:
        # DataLoader workers get a copy without the decoded row group.
        return {**self.__dict__, "_kept": None}

    def scan(self, stream: IO[bytes]) -> Iterator[int]:
        """Row numbers ``0 .. rows - 1``: counted from the footer, no data read."""
        return iter(range(_parquet().ParquetFile(stream).metadata.num_rows))

    def open_state(self, stream: IO[bytes]) -> _ParquetShard:
        """The per-shard state `read_at` reads from (closing it closes ``stream``)."""
        return _ParquetShard(stream)

    def read_at(self, shard: _ParquetShard, position: int, count: int) -> list[dict[str, Any]]:
        """``count`` rows from row ``position`` (fewer if the file ends first)."""
        rows: list[dict[str, Any]] = []
        group = bisect.bisect_right(shard.starts, position) - 1
        while len(rows) < count and 0 <= group < len(shard.starts) - 1:
            table = self._row_group(shard, group)
            lo = position - shard.starts[group]
            take = min(table.num_rows - lo, count - len(rows))
            rows += table.slice(lo, take).to_pylist()
            position += take
            group += 1
        return rows

    def _row_group(self, shard: _ParquetShard, group: int) -> Any:
        kept = self._kept
        if kept is not None and kept[0] is shard and kept[1] == group:
            return kept[2]
        table = shard.file.read_row_group(group, columns=self.columns)
        self._kept = (shard, group, table)
        return table

    def records(self, stream: IO[bytes]) -> Iterator[dict[str, Any]]:
        """Every row of the file ``stream`` holds, in order (the dataset uses `read_at`)."""
        shard = _ParquetShard(stream)
        for group in range(len(shard.starts) - 1):
            yield from self._row_group(shard, group).to_pylist()

    def decode(self, record: dict[str, Any]) -> dict[str, Any]:
        return record
