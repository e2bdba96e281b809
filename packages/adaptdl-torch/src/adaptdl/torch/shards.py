"""Streaming, sharded datasets for `AdaptiveDataLoader`: exactly once across resizes.

A `ShardedDataset` is a list of shard files and a reader that reads one shard
sequentially from a byte position: `JsonLinesReader` (one JSON value a line) and
`TarReader` (WebDataset-style tar shards: members grouped into samples by key)
are provided. Sample counts, and the byte position of every block start (a block
is ``block_size`` consecutive samples, the unit of seeking), are counted once and
cached next to the shards: a JSON index and a binary seek file of one
little-endian uint64 per block.

`AdaptiveDataLoader` reads it micro-batch by micro-batch in the order that
core's `StreamPlan` decides from (seed, epoch) and the loop's position: blocks
shuffled, samples shuffled inside each block, each replica a contiguous run of
positions, each micro-batch read whole by one DataLoader worker. A reader reads
each block's bytes at once and keeps the last block it read, so its memory is one
block whatever the corpus size. Local shards are read through read-only memory
maps (a slice per block) when they all stay open at once, else with a ``pread``
per block; mapped pages are the page cache's, shared and reclaimable. A shard
truncated or rewritten with other content while a job reads it is detected and
refused (a ValueError, never a read past a map's end). Remote shards (``s3://``,
``gs://``, ...) are opened through fsspec when it is installed (``pip install
'adaptdl-torch[fsspec]'``) and read with a seek and a read per block.
"""

from __future__ import annotations

import bisect
import hashlib
import io
import json
import logging
import mmap
import os
import resource
import struct
import sys
from collections.abc import Callable, Iterator, Sequence
from operator import itemgetter
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from adaptdl.core.order.shards import (
    DEFAULT_BLOCK_SIZE,
    BlockOrder,
    ShardIndex,
    check_block_size,
)
from adaptdl.core.persist.localfs import exclusive, replace_durably
from adaptdl.torch.parquet import ParquetReader
from adaptdl.torch.shardreaders import (
    JsonLinesReader,
    ShardReader,
    TarReader,
    fsspec_module,
    is_remote,
    open_shard,
)
from torch.utils.data import IterableDataset, get_worker_info

if TYPE_CHECKING:
    from adaptdl.torch.shardstream import ShardedStream

__all__ = [
    "DEFAULT_BLOCK_SIZE",
    "JsonLinesReader",
    "ParquetReader",
    "ShardReader",
    "ShardedDataset",
    "ShardedStream",
    "TarReader",
]

LOG = logging.getLogger("adaptdl.torch.shards")

INDEX_VERSION = 1
# Open shards kept per process: blocks come from shards in shuffled order, so with
# more shards than this most blocks would reopen their file. A local shard costs a
# descriptor (a quarter of the soft limit at most is used); a remote one, or a
# positioned reader's state, holds buffers, so fewer of those are kept.
_OPEN_FILES = 8
_OPEN_DESCRIPTORS = 256
_U64 = struct.Struct("<Q")


def _descriptor_limit() -> int:
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return soft if soft != resource.RLIM_INFINITY else 1 << 20


def _map_local(path: str) -> mmap.mmap | bytes:
    """A read-only map of a local shard (``b""`` for an empty file, which has no map).

    A block is then one slice of the map: no system call per block, which costs
    more than the copy on a virtual machine. The pages are the page cache's, shared
    and reclaimable, not memory of this process.
    """
    fd = os.open(path, os.O_RDONLY)
    try:
        if os.fstat(fd).st_size == 0:
            return b""
        return mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
    finally:
        os.close(fd)  # the map holds a descriptor of its own


def _close(handle: Any) -> None:
    """Close an open shard: a map, a descriptor, a file object or a reader's state."""
    if type(handle) is int:
        os.close(handle)
        return
    close = getattr(handle, "close", None)
    if close is not None:
        close()


def _size(path: str) -> int:
    if is_remote(path):
        fs, _, (target,) = fsspec_module().get_fs_token_paths(path)
        return int(fs.size(target))
    return os.stat(path.removeprefix("file://")).st_size


class ShardedDataset(IterableDataset[Any]):
    """Samples streamed from shard files, for `AdaptiveDataLoader`.

    ``shards`` are paths (or fsspec URLs) in a fixed order; ``reader`` reads one
    shard (`JsonLinesReader`, `TarReader` or your own `ShardReader`);
    ``transform`` is applied to each decoded sample. ``block_size`` samples form a
    block, the unit of seeking and of the in-block shuffle: it is part of the
    order, so keep it fixed for a job. The index is read from ``index_path``
    (default: ``adaptdl-index-<digest of shards and block size>.json`` beside the
    first shard, local shards only) and built by one sequential read of every
    shard when missing or stale (shard list, block size or a shard's byte size
    changed).

    Iterated directly it yields every sample once in index order (blocks shared
    round-robin between DataLoader workers); `AdaptiveDataLoader` reads it in the
    shuffled, restart-safe order instead.
    """

    def __init__(
        self,
        shards: Sequence[str | os.PathLike[str]],
        reader: ShardReader,
        *,
        block_size: int = DEFAULT_BLOCK_SIZE,
        index_path: str | os.PathLike[str] | None = None,
        transform: Callable[[Any], Any] | None = None,
    ) -> None:
        if isinstance(shards, (str, bytes, os.PathLike)) or not isinstance(shards, Sequence):
            raise ValueError(f"shards must be a sequence of paths, got {shards!r}")
        if not shards:
            raise ValueError("shards must name at least one shard, got an empty sequence")
        names = [os.fspath(s) for s in shards]
        for i, name in enumerate(names):
            if not isinstance(name, str) or not name:
                raise ValueError(f"shards[{i}] must be a non-empty path, got {name!r}")
        for method in ("scan", "records", "decode"):
            if not callable(getattr(reader, method, None)):
                raise ValueError(
                    f"reader must implement ShardReader ({method} is missing), got {reader!r}"
                )
        # core's rule, before an index is built for it (a plain int: it goes into JSON)
        block_size = check_block_size(block_size)
        if transform is not None and not callable(transform):
            raise ValueError(f"transform must be callable or None, got {transform!r}")
        self.reader = reader
        # A reader's optional split(data) -> records, looked up once (see ShardReader).
        self._split: Callable[[bytes], list[Any]] | None = getattr(reader, "split", None)
        # A positioned reader's read_at(state, position, count) (see ShardReader).
        self._read_at: Callable[[Any, int, int], list[Any]] | None = None
        if callable(getattr(reader, "open_state", None)):
            self._read_at = getattr(reader, "read_at", None)
            if not callable(self._read_at):
                raise ValueError(
                    f"reader has open_state but no read_at (a positioned ShardReader "
                    f"needs both), got {reader!r}"
                )
        self.block_size = block_size
        self.transform = transform
        if index_path is None:
            self.index_path = _default_index(names, block_size)
        else:
            self.index_path = Path(index_path)
        self.index = self._load_or_build(names)
        # The index's numbers as plain tuples, looked up once per block read.
        self._offsets, self._counts = self.index.offsets, self.index.counts
        self._max_open = _OPEN_FILES
        local = self._read_at is None and not any(is_remote(n) for n in names)
        if local:
            self._max_open = max(_OPEN_FILES, min(_OPEN_DESCRIPTORS, _descriptor_limit() // 4))
        # Local shards are mapped when all stay open; with more, shuffled blocks mostly
        # miss the cache, and a map made and unmade per block costs ~7x a pread.
        self._mapped = local and len(names) <= self._max_open
        self._reset_caches()

    # -- the index ----------------------------------------------------------------------
    @property
    def seek_path(self) -> Path:
        return self.index_path.with_suffix(".seek")

    @property
    def lock_path(self) -> Path:
        """The file whose lock the process building the index holds (kept, never removed)."""
        return self.index_path.with_suffix(".lock")

    def _load_or_build(self, names: list[str]) -> ShardIndex:
        """The cached index if it is current, else the one this or another process builds.

        Every replica (and every DataLoader worker) may construct the dataset, before
        or after the process group exists, so no collective is used: the first
        process to lock :attr:`lock_path` builds, the others wait for its lock and
        then read what it wrote. A builder that dies releases the lock with its
        process, and the next one builds. The lock only saves the repeated scans:
        the index and seek files are each replaced atomically, so even two builders
        (a file system without locks) leave a consistent index.
        """
        sizes = [_size(n) for n in names]
        self._sizes = tuple(sizes)  # where each shard's last span ends
        expected = {"version": INDEX_VERSION, "block_size": self.block_size, "sizes": sizes}
        index, why = self._load_cached(names, expected)
        if index is not None:
            return index
        what = f"the shard index {self.index_path}"

        def waiting() -> None:
            LOG.info("waiting for another process to build %s (it holds %s)", what, self.lock_path)

        with exclusive(self.lock_path, on_wait=waiting):
            # Whoever held the lock before may have just built it.
            index, why = self._load_cached(names, expected)
            if index is not None:
                return index
            if why:
                LOG.warning("shard index %s is %s: rebuilding it", self.index_path, why)
            return self._build(names, expected)

    def _load_cached(
        self, names: list[str], expected: dict[str, Any]
    ) -> tuple[ShardIndex | None, str]:
        """(the cached index, "") if it is current, else (None, why not; "" if missing)."""
        try:
            data = json.loads(self.index_path.read_text(encoding="utf-8"))
            index = ShardIndex.from_json(data)
            current = {k: data.get(k) for k in expected}
            blocks = -(-index.total // self.block_size)
            if (
                list(index.names) == names
                and current == expected
                and self.seek_path.stat().st_size == 8 * blocks
            ):
                return index, ""
            return None, "stale"
        except FileNotFoundError:
            return None, ""
        except ValueError as exc:
            return None, f"unreadable ({exc})"

    def _build(self, names: list[str], header: dict[str, Any]) -> ShardIndex:
        """Count every shard by one sequential read; record each block start's byte position."""
        counts: list[int] = []
        seeks = bytearray()
        total = 0
        for name in names:
            count = 0
            with open_shard(name) as stream:
                for position in self.reader.scan(stream):
                    if (total + count) % self.block_size == 0:
                        seeks += _U64.pack(position)
                    count += 1
            counts.append(count)
            total += count
        index = ShardIndex(names, counts)  # refuses an index without samples
        self.index_path.parent.mkdir(parents=True, exist_ok=True)
        replace_durably(self.seek_path, bytes(seeks))
        text = json.dumps({**header, **index.to_json()}, indent=1)
        replace_durably(self.index_path, text.encode("utf-8"))
        LOG.info("indexed %d samples in %d shards into %s", total, len(names), self.index_path)
        return index

    # -- reading --------------------------------------------------------------------------
    def __len__(self) -> int:
        return self.index.total

    def _reset_caches(self) -> None:
        # Open shards by index: a map of a local file, the file object fsspec opened,
        # or a positioned reader's state; at most _max_open, the oldest closed first.
        self._handles: dict[int, Any] = {}
        self._seek_map: mmap.mmap | None = None
        self._seeks: Any = None  # the seek file's numbers, indexable: block -> byte position
        self._block: tuple[int, list[Any]] | None = None
        #: Per process: blocks and records read, samples decoded (read amplification).
        self.stats = {"blocks": 0, "records": 0, "decoded": 0}

    def __getstate__(self) -> dict[str, Any]:
        # DataLoader workers get a copy without open files or a cached block.
        state = self.__dict__.copy()
        state.update(_handles={}, _seek_map=None, _seeks=None, _block=None)
        return state

    def close(self) -> None:
        """Close the files this process holds open (reopened on demand)."""
        for handle in self._handles.values():
            _close(handle)
        if isinstance(self._seeks, memoryview):
            self._seeks.release()  # before the map it views
        if self._seek_map is not None:
            self._seek_map.close()
        self._reset_caches()

    def _handle(self, shard: int) -> Any:
        handle = self._handles.get(shard)
        if handle is None:
            if len(self._handles) >= self._max_open:
                oldest = next(iter(self._handles))
                _close(self._handles.pop(oldest))
            name = self.index.names[shard]
            if self._read_at is not None:
                handle = self.reader.open_state(open_shard(name))  # type: ignore[attr-defined]
            elif is_remote(name):
                handle = open_shard(name)
            elif self._mapped:
                handle = _map_local(name.removeprefix("file://"))
                length = len(handle)
                if length < self._sizes[shard]:  # reads past its end would be SIGBUS
                    _close(handle)
                    self._truncated(shard, length)
            else:
                handle = os.open(name.removeprefix("file://"), os.O_RDONLY)
            self._handles[shard] = handle
        return handle

    def _read_span(self, shard: int, begin: int, end: int) -> bytes:
        """Bytes ``[begin, end)`` of a shard (fewer where it ends before ``end``).

        Raises ValueError for a mapped shard now shorter than ``end`` (a truncated
        file: reading its map past the end would kill the process with SIGBUS).
        """
        handle = self._handles.get(shard)
        if handle is None:
            handle = self._handle(shard)
        if type(handle) is mmap.mmap:
            if end > handle.size():  # one fstat; a shorter pread needs no check
                self._truncated(shard, handle.size())
            return handle[begin:end]
        if type(handle) is int:
            return os.pread(handle, end - begin, begin)
        handle.seek(begin)
        return handle.read(end - begin)  # type: ignore[no-any-return]

    def _seek_table(self) -> Any:
        if self._seeks is None:
            # Mapped, not loaded: the seek file has a number per block of the corpus.
            with open(self.seek_path, "rb") as f:
                self._seek_map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            if sys.byteorder == "little":
                self._seeks = memoryview(self._seek_map).cast("Q")  # the cheapest look-up
            else:
                self._seeks = np.frombuffer(self._seek_map, dtype="<u8")
        return self._seeks

    def _seek_position(self, block: int) -> int:
        """The byte position of block ``block``'s first sample in its shard."""
        return int(self._seek_table()[block])

    def read_block(self, block: int, start: int, stop: int) -> list[Any]:
        """Raw records of global ids ``[start, stop)`` (block ``block``), read sequentially.

        Each shard's part of the block is one read of its exact bytes: from the
        block's start (or the shard's) to the next block's start (or the shard's end).
        """
        cached = self._block
        if cached is not None and cached[0] == block:
            return cached[1]
        return self._read(block, start, stop)

    def _read(self, block: int, start: int, stop: int) -> list[Any]:
        """`read_block` without its cache: reads, and caches what it read."""
        # The hot path of every reader, once per block: its look-ups are kept local.
        offsets = self._offsets
        shard = bisect.bisect_right(offsets, start) - 1
        offset = start - offsets[shard]
        size, rest = stop - start, self._counts[shard] - offset
        if size > rest or self._read_at is not None:
            records = self._read_across(block, shard, offset, size)
        else:  # the usual case: a block inside one shard, one span of its bytes
            seeks = self._seeks if self._seeks is not None else self._seek_table()
            end = seeks[block + 1] if size < rest else self._sizes[shard]
            data = self._read_span(shard, seeks[block], end)
            records = self._split(data) if self._split is not None else self._records(data)
            if len(records) != size:
                self._mismatch(shard, offset, size, records, size == rest)
        self._block = (block, records)
        stats = self.stats
        stats["blocks"] += 1
        stats["records"] += size
        return records

    def _read_across(self, block: int, shard: int, offset: int, size: int) -> list[Any]:
        """Each shard's part of a block, the next shard's from its start (position 0).

        For a block that spans shard boundaries, and for a positioned reader.
        """
        counts, records = self.index.counts, list[Any]()
        begin = self._seek_position(block)
        while True:
            want = min(size - len(records), counts[shard] - offset)
            if want > 0:
                to_end = offset + want == counts[shard]
                if self._read_at is not None:
                    got = self._read_at(self._handle(shard), begin, want)
                else:
                    end = self._sizes[shard] if to_end else self._seek_position(block + 1)
                    got = self._records(self._read_span(shard, begin, end))
                if len(got) != want:
                    # Filling up from the next shard would put samples at wrong ids.
                    self._mismatch(shard, offset, want, got, to_end)
                records += got
                if len(records) == size:
                    return records
            shard, offset, begin = shard + 1, 0, 0

    def _records(self, data: bytes) -> list[Any]:
        if self._split is not None:
            return self._split(data)
        return list(self.reader.records(io.BytesIO(data)))

    def _truncated(self, shard: int, length: int) -> None:
        raise ValueError(
            f"shard {self.index.names[shard]!r} is {length} bytes where its index counts "
            f"{self._sizes[shard]} (truncated while read?); delete the index "
            f"{os.fspath(self.index_path)!r} to count the shards again"
        )

    def _mismatch(self, shard: int, offset: int, want: int, got: list[Any], to_end: bool) -> None:
        name, count = self.index.names[shard], self.index.counts[shard]
        if to_end and len(got) < want:
            what = f"ended after {offset + len(got)} of the {count} samples its index counts"
        else:
            what = (
                f"holds {len(got)} samples where its index counts {want} (from sample "
                f"{offset} of {count})"
            )
        raise ValueError(
            f"shard {name!r} {what} (rewritten in place?); delete the index "
            f"{os.fspath(self.index_path)!r} to count the shards again"
        )

    def take(self, order: BlockOrder, lo: int, hi: int) -> list[Any]:
        """The samples at pass positions ``[lo, hi)`` of ``order``, block by block.

        Only the records taken are decoded (and transformed).
        """
        records: list[Any] = []
        for block, start, stop, offsets in order.runs(lo, hi):
            cached = self._block
            if cached is not None and cached[0] == block:
                block_records = cached[1]
            else:
                block_records = self._read(block, start, stop)
            if len(offsets) > 1:
                records += itemgetter(*offsets)(block_records)  # one C call for the run
            else:
                records += map(block_records.__getitem__, offsets)
        self.stats["decoded"] += len(records)
        out = list(map(self.reader.decode, records))
        if self.transform is not None:
            out = list(map(self.transform, out))
        return out

    def __iter__(self) -> Iterator[Any]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        order = BlockOrder(self.index.total, self.block_size, shuffle=False)
        for slot in range(worker, order.num_blocks, workers):
            lo = slot * self.block_size
            yield from self.take(order, lo, min(order.n, lo + self.block_size))


def _default_index(names: list[str], block_size: int) -> Path:
    if is_remote(names[0]):
        raise ValueError(
            f"index_path is needed for remote shards (first shard {names[0]!r}): "
            "name a local file for the cached index"
        )
    # The block size is part of the name: datasets over the same shards with other
    # block sizes keep their own index instead of rebuilding each other's.
    key = "\n".join([*names, f"block_size={block_size}"]).encode("utf-8")
    digest = hashlib.blake2b(key, digest_size=6).hexdigest()
    return Path(names[0].removeprefix("file://")).resolve().parent / f"adaptdl-index-{digest}.json"


def __getattr__(name: str) -> Any:
    # ShardedStream lives in shardstream, which imports this module: looked up lazily.
    if name == "ShardedStream":
        from adaptdl.torch.shardstream import ShardedStream

        return ShardedStream
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
