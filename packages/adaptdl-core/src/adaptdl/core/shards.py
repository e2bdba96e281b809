"""The pass order of a sharded, streamed dataset, and each replica's part of it.

A sharded dataset is a list of shards (files read sequentially) with known
sample counts: a :class:`ShardIndex`. Its samples have global ids ``g`` in
``[0, n)``, shard after shard in index order.

Blocks and the pass order
    The global ids are cut into blocks of ``block_size`` (``B``) consecutive ids:
    block ``j`` holds ``[j * B, min((j + 1) * B, n))``. A block is the unit of
    seeking: a reader seeks once to the block's start and reads on sequentially
    (across a shard boundary if the block spans one). A pass of
    :class:`BlockOrder` lays the blocks out one after another, full blocks in the
    order of a keyed Feistel permutation (:mod:`adaptdl.core.permutation`, keyed
    by ``(seed, epoch, pass)``), the short last block (if ``n % B``) last, and
    shuffles the samples inside each block: pass position ``p`` is slot
    ``b = p // B``, place ``u = p % B``, block ``blocks[b]``, and in-block offset
    ``inner[(u + rotation(block)) % len(block)]`` where ``inner`` is one
    permutation of ``[0, B)`` per pass and the rotation a keyed value per block.
    Position to sample is O(1) time and memory (O(log shards) to name the shard);
    nothing proportional to ``n`` is ever built. The permuted block order gives
    the shard mixing; a block's samples land in one micro-batch or a few
    consecutive ones. Without ``shuffle`` the order is the index order.

Which positions a replica reads
    Core's loader counts ``index``: every pass position below it is consumed.
    A micro-batch at ``index`` covers the next ``m = min(R * L, n - start)``
    positions (``R`` replicas, local batch ``L``); here, unlike the strided
    :class:`adaptdl.core.sampling.Shard`, each replica takes a contiguous run of
    them (:func:`replica_chunk`), so that it reads about ``L / B + 1`` blocks of
    which it uses all but the ends. The consumed positions after the micro-batch
    are still exactly ``[0, index + m)`` whatever ``R`` and ``L`` were before:
    the prefix invariant. A replica whose run is one short of the others takes one
    padding sample (a duplicate, explicitly flagged) so that all stay in step.

Read amplification (samples read over samples used) with a one-block cache per
reader is about ``1 + (B - 1) / L`` (the two partly used blocks at the ends of a
run), and never more than the number of readers; see README "Streaming data".
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import attrs
import numpy as np
import numpy.typing as npt

from adaptdl.core._validate import ArgumentTypeError, check_int
from adaptdl.core.permutation import MAX_N, Identity, Permutation, make_permutation

__all__ = [
    "DEFAULT_BLOCK_SIZE",
    "BlockOrder",
    "BlockRun",
    "Chunk",
    "ShardIndex",
    "micro_batches",
    "replica_chunk",
]

#: Samples per block: small against usual local batch sizes (32 and up), so that the
#: read amplification ``1 + (B - 1) / L`` stays under ~1.5, and large enough that a
#: seek per block costs little next to reading and decoding its samples.
DEFAULT_BLOCK_SIZE = 16
# Largest block: the in-block permutation is materialised (B ints) once per pass.
MAX_BLOCK_SIZE = 1 << 20
# Keys of the block rotations: a separate "epoch" stream of the same Feistel network,
# so that rotations and the block order are independent draws.
_ROTATION_SALT = 0x5A17


def _check_names(value: Any) -> tuple[str, ...]:
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise ArgumentTypeError(f"names must be a sequence of str, got {type(value).__name__}")
    for i, name in enumerate(value):
        if not isinstance(name, str) or not name:
            raise ArgumentTypeError(f"names[{i}] must be a non-empty str, got {name!r}")
    return tuple(value)


def _check_counts(value: Any) -> tuple[int, ...]:
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise ArgumentTypeError(f"counts must be a sequence of int, got {type(value).__name__}")
    return tuple(check_int(f"counts[{i}]", c, min=0) for i, c in enumerate(value))


@attrs.frozen
class ShardIndex:
    """Shards (by name, e.g. a path) and their sample counts, in the order of global ids.

    Shard ``s`` holds the global ids ``[offsets[s], offsets[s + 1])``. Empty shards
    are allowed; the whole index must hold at least one sample. Serialised by
    :meth:`to_json` as ``{"shards": [{"name": ..., "count": ...}, ...]}``.
    """

    names: tuple[str, ...] = attrs.field(converter=_check_names)
    counts: tuple[int, ...] = attrs.field(converter=_check_counts)
    _offsets: tuple[int, ...] = attrs.field(init=False, repr=False, eq=False)

    def __attrs_post_init__(self) -> None:
        if len(self.names) != len(self.counts):
            raise ValueError(
                f"names and counts must have the same length, got {len(self.names)} names "
                f"and {len(self.counts)} counts"
            )
        if not self.names:
            raise ValueError("a shard index needs at least one shard, got none")
        offsets = (0, *itertools.accumulate(self.counts))
        if offsets[-1] < 1 or offsets[-1] > MAX_N:
            raise ValueError(
                f"the shards must hold 1 to {MAX_N} samples in all, got {offsets[-1]}"
            )
        object.__setattr__(self, "_offsets", offsets)

    @property
    def total(self) -> int:
        """Samples in all shards."""
        return self._offsets[-1]

    @property
    def num_shards(self) -> int:
        return len(self.names)

    def offset(self, shard: int) -> int:
        """The global id of shard ``shard``'s first sample."""
        return self._offsets[check_int("shard", shard, min=0, max=self.num_shards - 1)]

    def locate(self, sample: int) -> tuple[int, int]:
        """``(shard, offset in shard)`` of global id ``sample`` (never an empty shard)."""
        g = check_int("sample", sample, min=0, max=self.total - 1)
        shard = bisect.bisect_right(self._offsets, g) - 1
        return shard, g - self._offsets[shard]

    def to_json(self) -> dict[str, Any]:
        return {
            "shards": [
                {"name": name, "count": count}
                for name, count in zip(self.names, self.counts, strict=True)
            ]
        }

    @classmethod
    def from_json(cls, data: Any) -> ShardIndex:
        """The index that :meth:`to_json` wrote; ValueError naming what is malformed."""
        if not isinstance(data, Mapping) or not isinstance(data.get("shards"), list):
            raise ValueError(
                f"a shard index must be an object with a 'shards' list, got {str(data)[:200]}"
            )
        names, counts = [], []
        for i, entry in enumerate(data["shards"]):
            if not isinstance(entry, Mapping) or "name" not in entry or "count" not in entry:
                raise ValueError(
                    f"shards[{i}] must be an object with 'name' and 'count', got {entry!r}"
                )
            names.append(entry["name"])
            counts.append(entry["count"])
        return cls(names, counts)


def _check_block_size(value: Any) -> int:
    return check_int("block_size", value, min=1, max=MAX_BLOCK_SIZE)


def _check_n(value: Any) -> int:
    return check_int("n", value, min=1, max=MAX_N)


def _check_seed(value: Any) -> int:
    return check_int("seed", value, min=0)


def _check_epoch(value: Any) -> int:
    return check_int("epoch", value, min=0)


def _check_pass(value: Any) -> int:
    return check_int("pass_", value, min=0)


def _check_bool(value: Any) -> bool:
    if not isinstance(value, bool):
        raise ArgumentTypeError(f"shuffle must be a bool, got {value!r} ({type(value).__name__})")
    return value


_EMPTY: npt.NDArray[np.int64] = np.zeros(0, dtype=np.int64)
_EMPTY.flags.writeable = False


def _materialise(size: int, shuffle: bool, key: dict[str, int]) -> npt.NDArray[np.int64]:
    """One in-block permutation as an array (``size <= MAX_BLOCK_SIZE`` ints)."""
    perm = make_permutation(size, shuffle=shuffle, **key)
    out = perm.take(np.arange(size, dtype=np.int64))
    out.flags.writeable = False
    return out


@attrs.frozen
class BlockRun:
    """Pass positions that fall in one block: read ``block``, take ``offsets`` of it.

    ``offsets`` are in-block offsets (global id ``start + offset``) in the order of
    the positions; ``start``/``stop`` are the block's global ids.
    """

    block: int
    start: int
    stop: int
    offsets: tuple[int, ...]


@attrs.frozen
class BlockOrder:
    """The order of one pass over ``n`` samples in blocks of ``block_size``.

    ``order[p]`` is the global id at pass position ``p``; :meth:`runs` groups a range
    of positions by block, which is how a reader consumes them.
    """

    n: int = attrs.field(converter=_check_n)
    block_size: int = attrs.field(default=DEFAULT_BLOCK_SIZE, converter=_check_block_size)
    seed: int = attrs.field(default=0, converter=_check_seed)
    epoch: int = attrs.field(default=0, converter=_check_epoch)
    pass_: int = attrs.field(default=0, converter=_check_pass)
    shuffle: bool = attrs.field(default=True, converter=_check_bool)
    _blocks: Permutation | Identity | None = attrs.field(init=False, repr=False, eq=False)
    _rotations: Permutation | None = attrs.field(init=False, repr=False, eq=False)
    _inner: npt.NDArray[np.int64] = attrs.field(init=False, repr=False, eq=False)
    _inner_last: npt.NDArray[np.int64] = attrs.field(init=False, repr=False, eq=False)

    def __attrs_post_init__(self) -> None:
        full = self.num_full_blocks
        key = {"seed": self.seed, "epoch": self.epoch, "pass_": self.pass_}
        blocks = make_permutation(full, shuffle=self.shuffle, **key) if full else None
        rotations = None
        if self.shuffle and full:
            rotations = Permutation(
                full, seed=self.seed, epoch=self.epoch + _ROTATION_SALT, pass_=self.pass_
            )
        b, last = self.block_size, self.n - full * self.block_size
        inner = _materialise(b, self.shuffle, key) if full else _EMPTY
        inner_last = _materialise(last, self.shuffle, key) if last else _EMPTY
        object.__setattr__(self, "_blocks", blocks)
        object.__setattr__(self, "_rotations", rotations)
        object.__setattr__(self, "_inner", inner)
        object.__setattr__(self, "_inner_last", inner_last)

    @property
    def num_full_blocks(self) -> int:
        return self.n // self.block_size

    @property
    def num_blocks(self) -> int:
        return -(-self.n // self.block_size)

    def block_at(self, slot: int) -> int:
        """The block laid out in slot ``slot`` (positions ``[slot * B, (slot + 1) * B)``)."""
        slot = check_int("slot", slot, min=0, max=self.num_blocks - 1)
        if slot >= self.num_full_blocks:
            return slot  # the short last block stays last
        assert self._blocks is not None
        return self._blocks[slot]

    def block_span(self, block: int) -> tuple[int, int]:
        """The global ids ``[start, stop)`` of block ``block``."""
        block = check_int("block", block, min=0, max=self.num_blocks - 1)
        start = block * self.block_size
        return start, min(self.n, start + self.block_size)

    def _offsets(self, block: int, lo: int, hi: int) -> tuple[int, ...]:
        """In-block offsets at places ``[lo, hi)`` of ``block``'s slot."""
        if block >= self.num_full_blocks:
            return tuple(self._inner_last[lo:hi].tolist())
        b = self.block_size
        shift = self._rotations[block] % b if self._rotations is not None else 0
        places = np.arange(lo + shift, hi + shift, dtype=np.int64)
        places %= b
        return tuple(self._inner[places].tolist())

    def runs(self, lo: int, hi: int) -> Iterator[BlockRun]:
        """Positions ``[lo, hi)`` (``0 <= lo <= hi <= n``) grouped by block, in order."""
        lo = check_int("lo", lo, min=0, max=self.n)
        hi = check_int("hi", hi, min=lo, max=self.n)
        b = self.block_size
        for slot in range(lo // b, -(-hi // b)):
            block = self.block_at(slot)
            start, stop = self.block_span(block)
            first, last = max(lo, slot * b) - slot * b, min(hi, (slot + 1) * b) - slot * b
            yield BlockRun(block, start, stop, self._offsets(block, first, last))

    def __getitem__(self, position: int) -> int:
        p = check_int("position", position, min=0, max=self.n - 1)
        (run,) = self.runs(p, p + 1)
        return run.start + run.offsets[0]

    def take(self, lo: int, hi: int) -> npt.NDArray[np.int64]:
        """Global ids at positions ``[lo, hi)``."""
        ids = [run.start + o for run in self.runs(lo, hi) for o in run.offsets]
        return np.asarray(ids, dtype=np.int64)

    def __len__(self) -> int:
        return self.n


@attrs.frozen
class Chunk:
    """One replica's part of the micro-batch at global ``index``.

    Pass positions ``[lo, hi)`` are its real samples; when ``pad`` is not None it
    also takes pass position ``pad`` once more as padding (a duplicate), so that
    every replica yields ``size`` samples. ``step`` is what the micro-batch adds to
    the global index (all replicas together).
    """

    lo: int
    hi: int
    pad: int | None
    size: int
    step: int


def replica_chunk(n: int, index: int, num_replicas: int, rank: int, local_bsz: int) -> Chunk:
    """Replica ``rank``'s contiguous run of the micro-batch that starts at ``index``.

    The micro-batch covers ``m = min(num_replicas * local_bsz, n - index % n)``
    positions from ``start = index % n``; they are split in contiguous runs, the
    first ``m % num_replicas`` replicas taking one more, the others a padding
    sample instead (the position after their run, modulo ``n``).
    """
    n = check_int("n", n, min=1, max=MAX_N)
    index = check_int("index", index, min=0)
    replicas = check_int("num_replicas", num_replicas, min=1)
    rank = check_int("rank", rank, min=0, max=replicas - 1)
    local_bsz = check_int("local_bsz", local_bsz, min=1)
    start = index % n
    m = min(replicas * local_bsz, n - start)
    base, extra = divmod(m, replicas)
    lo = start + rank * base + min(rank, extra)
    hi = lo + base + (rank < extra)
    size = base + (extra > 0)
    pad = hi % n if hi - lo < size else None
    return Chunk(lo, hi, pad, size, m)


def micro_batches(
    n: int, index: int, num_replicas: int, rank: int, local_bsz: int
) -> Iterator[Chunk]:
    """Replica ``rank``'s chunks from global ``index`` to the end of its pass."""
    end = (index // n + 1) * n
    while index < end:
        chunk = replica_chunk(n, index, num_replicas, rank, local_bsz)
        yield chunk
        index += chunk.step
