"""Readers of one shard file for `adaptdl.torch.shards.ShardedDataset`.

`JsonLinesReader` (one JSON value a line) and `TarReader` (WebDataset-style tar
shards) read byte spans; `adaptdl.torch.parquet.ParquetReader` reads by row
position. `open_shard` opens a local path, or a URL through fsspec.
"""

from __future__ import annotations

import io
import json
import tarfile
from collections.abc import Iterator
from itertools import filterfalse
from typing import IO, Any, Protocol

__all__ = [
    "JsonLinesReader",
    "ShardReader",
    "TarReader",
    "fsspec_module",
    "is_remote",
    "open_shard",
]


class ShardReader(Protocol):
    """Reads the samples of one shard file sequentially.

    ``scan`` yields the byte position of every sample of a whole shard (once, to
    count and index it); ``records`` yields the raw records of a stream that starts
    at a position ``scan`` yielded (or at 0) and ends at another (or at the shard's
    end); ``decode`` turns a raw record into a sample (only for the samples a
    micro-batch uses).

    A reader may also define ``split(data: bytes) -> list`` (the records of such a
    span of bytes, all at once): the dataset then calls it instead of ``records``,
    which saves a stream and a generator step per record.

    A format that cannot be cut at byte positions (Parquet: see
    `adaptdl.torch.parquet.ParquetReader`) is read by position instead: its
    ``scan`` yields positions of its own (row numbers), ``open_state(stream)``
    returns a per-shard state (with ``close()``) and ``read_at(state, position,
    count)`` the ``count`` records from a position ``scan`` yielded (or 0).
    """

    def scan(self, stream: IO[bytes]) -> Iterator[int]: ...

    def records(self, stream: IO[bytes]) -> Iterator[Any]: ...

    def decode(self, record: Any) -> Any: ...


class JsonLinesReader:
    """JSON lines: one JSON value per non-blank line, decoded with ``json.loads``.

    Records are the lines as str (UTF-8), which ``json.loads`` takes without
    detecting an encoding first.
    """

    def scan(self, stream: IO[bytes]) -> Iterator[int]:
        position = stream.tell()
        for line in stream:
            if line.strip():
                yield position
            position += len(line)

    def records(self, stream: IO[bytes]) -> Iterator[str]:
        return iter(self.split(stream.read()))

    def split(self, data: bytes) -> list[str]:
        # A BytesIO finds line ends with memchr, several times faster than str.split
        # (which compares character by character). Blank lines are dropped in C by
        # isspace, which stops at a line's first character (strip copies the line).
        return list(map(bytes.decode, filterfalse(bytes.isspace, io.BytesIO(data))))

    # json.loads itself, not a method calling it: one Python frame less per sample.
    decode = staticmethod(json.loads)


def _split_key(name: str) -> tuple[str, str]:
    """WebDataset's rule: the key is the path up to the first dot of the file name."""
    directory, _, base = name.rpartition("/")
    stem, dot, ext = base.partition(".")
    key = f"{directory}/{stem}" if directory else stem
    return key, ext if dot else ""


class TarReader:
    """WebDataset-style tar shards: consecutive members with one key form a sample.

    A sample is a dict ``{"__key__": key, ext: bytes, ...}`` (``images/0001.jpg`` and
    ``images/0001.cls`` give key ``images/0001`` with ``jpg`` and ``cls``); decode
    the bytes with the dataset's ``transform``.
    """

    def _members(self, stream: IO[bytes]) -> Iterator[tarfile.TarInfo]:
        archive = tarfile.open(fileobj=stream, mode="r:")  # noqa: SIM115 - streamed
        while (member := archive.next()) is not None:
            archive.members.clear()  # type: ignore[attr-defined]  # tarfile keeps all it read
            if member.isfile():
                yield member

    def scan(self, stream: IO[bytes]) -> Iterator[int]:
        previous = None
        for member in self._members(stream):
            key, _ = _split_key(member.name)
            if key != previous:
                yield member.offset
                previous = key

    def records(self, stream: IO[bytes]) -> Iterator[dict[str, Any]]:
        archive = tarfile.open(fileobj=stream, mode="r:")  # noqa: SIM115 - streamed
        sample: dict[str, Any] | None = None
        while (member := archive.next()) is not None:
            archive.members.clear()  # type: ignore[attr-defined]
            if not member.isfile():
                continue
            key, ext = _split_key(member.name)
            if sample is not None and sample["__key__"] != key:
                yield sample
                sample = None
            if sample is None:
                sample = {"__key__": key}
            data = archive.extractfile(member)
            assert data is not None  # a regular file always has data
            sample[ext] = data.read()
        if sample is not None:
            yield sample

    def decode(self, record: dict[str, Any]) -> dict[str, Any]:
        return record


def is_remote(path: str) -> bool:
    """Whether ``path`` is a URL that fsspec opens (not a local path or file://)."""
    return "://" in path and not path.startswith("file://")


def fsspec_module() -> Any:
    """The fsspec module; ImportError naming the extra when it is not installed."""
    try:
        import fsspec
    except ImportError as exc:
        raise ImportError(
            "reading remote shards needs fsspec: pip install 'adaptdl-torch[fsspec]'"
        ) from exc
    return fsspec


def open_shard(path: str) -> IO[bytes]:
    """Open a shard for binary reading: a local path, or a URL through fsspec."""
    if is_remote(path):
        return fsspec_module().open(path, "rb").open()  # type: ignore[no-any-return]
    return open(path.removeprefix("file://"), "rb")
