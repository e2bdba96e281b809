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
    order of a keyed Feistel permutation (:mod:`adaptdl.core.order.permutation`, keyed
    by ``(seed, epoch, pass)``), the short last block (if ``n % B``) last, and
    shuffles the samples inside each block: pass position ``p`` is slot
    ``b = p // B``, place ``u = p % B``, block ``blocks[b]``, and in-block offset
    ``inner[(u + rotation(block)) % B]`` where ``inner`` is one permutation of
    ``[0, B)`` per pass and the rotation a keyed hash of the block (the short last
    block has its own permutation and no rotation).
    Position to sample is O(1) time and memory (O(log shards) to name the shard);
    nothing proportional to ``n`` is ever built. The permuted block order gives
    the shard mixing; a block's samples land in one micro-batch or a few
    consecutive ones. Without ``shuffle`` the order is the index order.

Which positions a replica reads
    Core's loader counts ``index``: every pass position below it is consumed.
    A micro-batch at ``index`` covers the next ``m = min(R * L, n - start)``
    positions (``R`` replicas, local batch ``L``); here, unlike the strided
    :class:`adaptdl.core.order.sampling.Shard`, each replica takes a contiguous run of
    them (:func:`replica_chunk`), so that it reads about ``L / B + 1`` blocks of
    which it uses all but the ends. The consumed positions after the micro-batch
    are still exactly ``[0, index + m)`` whatever ``R`` and ``L`` were before:
    the prefix invariant. A replica whose run is one short of the others takes one
    padding sample (a duplicate, explicitly flagged) so that all stay in step.

One replica's pass
    :class:`StreamPlan` puts the two together for an adapter: from ``(seed,
    epoch)`` and the loop's ``index`` it gives the pass's order, the replica's
    chunk of each micro-batch (whose local batch size may change between
    micro-batches, the same on every replica) and how many there are.

Read amplification (samples read over samples used) with a one-block cache per
reader is about ``1 + (B - 1) / L`` (the two partly used blocks at the ends of a
run), and never more than the number of readers; see README "Streaming data".
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import attrs
import numpy as np
import numpy.typing as npt

# The order is keyed like a permutation, so its keys are checked by the same rules.
from adaptdl.core.order.permutation import (
    MAX_N,
    Identity,
    Permutation,
    _check_pass,
    check_n,
    make_permutation,
    round_keys,
)
from adaptdl.core.validate import (
    ArgumentTypeError,
    check_bool,
    check_epoch,
    check_int,
    check_seed,
)

__all__ = [
    "DEFAULT_BLOCK_SIZE",
    "BlockOrder",
    "BlockRun",
    "Chunk",
    "ShardIndex",
    "StreamPlan",
    "check_block_size",
    "replica_chunk",
]

#: Samples per block: small against usual local batch sizes (32 and up), so that the
#: read amplification ``1 + (B - 1) / L`` stays under ~1.5, and large enough that a
#: seek per block costs little next to reading and decoding its samples.
DEFAULT_BLOCK_SIZE = 16
# Largest block: the in-block permutation is materialised (B ints) once per pass.
MAX_BLOCK_SIZE = 1 << 20
# Key of the block rotations: round keys of a separate "epoch" stream, so that the
# rotations and the block order are independent draws.
_ROTATION_SALT = 0x5A17
# Slots of the block order drawn at once (a page of ints, cached by the order).
_PAGE = 1024
# Largest block whose in-block permutation is also kept as a list (2 * B ints).
_LIST_BLOCK = 4096


_MIX_1, _MIX_2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


def _mix(values: npt.NDArray[np.int64], key: int) -> npt.NDArray[np.uint64]:
    """A keyed 64-bit mix (splitmix64's finaliser) of each value.

    uint64 arithmetic wraps modulo 2**64, so this is the integer formula
    ``h = (v ^ key) * M1; h ^= h >> 31; h = h * M2; h ^ (h >> 29)`` mod 2**64.
    """
    h: npt.NDArray[np.uint64] = values.astype(np.uint64) ^ np.uint64(key)
    h *= np.uint64(_MIX_1)
    h ^= h >> np.uint64(31)
    h *= np.uint64(_MIX_2)
    h ^= h >> np.uint64(29)
    return h


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

    @property
    def offsets(self) -> tuple[int, ...]:
        """``offsets[s]``: the global id of shard ``s``'s first sample; ``offsets[-1]``: total."""
        return self._offsets

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


def check_block_size(value: Any) -> int:
    """A block size: an int in [1, MAX_BLOCK_SIZE] (an attrs converter)."""
    return check_int("block_size", value, min=1, max=MAX_BLOCK_SIZE)


def _check_shuffle(value: Any) -> bool:
    return check_bool("shuffle", value)


_EMPTY: npt.NDArray[np.int64] = np.zeros(0, dtype=np.int64)
_EMPTY.flags.writeable = False


def _materialise(size: int, shuffle: bool, key: dict[str, int]) -> npt.NDArray[np.int64]:
    """One in-block permutation as an array (``size <= MAX_BLOCK_SIZE`` ints)."""
    perm = make_permutation(size, shuffle=shuffle, **key)
    out = perm.take(np.arange(size, dtype=np.int64))
    out.flags.writeable = False
    return out


class BlockRun(NamedTuple):
    """Pass positions that fall in one block: read ``block``, take ``offsets`` of it.

    ``offsets`` are in-block offsets (global id ``start + offset``) in the order of
    the positions; ``start``/``stop`` are the block's global ids. (A named tuple:
    one is made per block read, on the hot path.)
    """

    block: int
    start: int
    stop: int
    offsets: list[int]


# BlockRun(...) runs a Python-level __new__; tuple.__new__ builds the same in C.
_new_run = functools.partial(tuple.__new__, BlockRun)


@attrs.frozen
class BlockOrder:
    """The order of one pass over ``n`` samples in blocks of ``block_size``.

    ``order[p]`` is the global id at pass position ``p``; :meth:`runs` groups a range
    of positions by block, which is how a reader consumes them.
    """

    n: int = attrs.field(converter=check_n)
    block_size: int = attrs.field(default=DEFAULT_BLOCK_SIZE, converter=check_block_size)
    seed: int = attrs.field(default=0, converter=check_seed)
    epoch: int = attrs.field(default=0, converter=check_epoch)
    pass_: int = attrs.field(default=0, converter=_check_pass)
    shuffle: bool = attrs.field(default=True, converter=_check_shuffle)
    _blocks: Permutation | Identity | None = attrs.field(init=False, repr=False, eq=False)
    _rotation_key: int = attrs.field(init=False, repr=False, eq=False)
    # The in-block permutation twice over, so that a rotated run of it is one slice.
    _inner: npt.NDArray[np.int64] = attrs.field(init=False, repr=False, eq=False)
    _inner_last: npt.NDArray[np.int64] = attrs.field(init=False, repr=False, eq=False)
    # The same as a list for blocks up to _LIST_BLOCK: slicing a list is cheaper than
    # slicing an array and converting the slice, once per block read.
    _inner_list: list[int] | None = attrs.field(init=False, repr=False, eq=False)
    # [first slot, blocks, rotations of the slots from it]: drawn a page at a time.
    _page: list[Any] = attrs.field(init=False, repr=False, eq=False)

    def __attrs_post_init__(self) -> None:
        full = self.num_full_blocks
        key = {"seed": self.seed, "epoch": self.epoch, "pass_": self.pass_}
        blocks = make_permutation(full, shuffle=self.shuffle, **key) if full else None
        rotation_key = 0
        if self.shuffle:
            rotation_key = round_keys(full, self.seed, self.epoch + _ROTATION_SALT, self.pass_)[0]
        b, last = self.block_size, self.n - full * self.block_size
        inner = _materialise(b, self.shuffle, key) if full else _EMPTY
        inner_last = _materialise(last, self.shuffle, key) if last else _EMPTY
        object.__setattr__(self, "_blocks", blocks)
        object.__setattr__(self, "_rotation_key", rotation_key)
        object.__setattr__(self, "_inner", np.concatenate([inner, inner]))
        small = self._inner.tolist() if b <= _LIST_BLOCK else None
        object.__setattr__(self, "_inner_list", small)
        object.__setattr__(self, "_inner_last", inner_last)
        object.__setattr__(self, "_page", [-1, [], []])

    @property
    def num_full_blocks(self) -> int:
        return self.n // self.block_size

    @property
    def num_blocks(self) -> int:
        return -(-self.n // self.block_size)

    def block_at(self, slot: int) -> int:
        """The block laid out in slot ``slot`` (positions ``[slot * B, (slot + 1) * B)``)."""
        return self._block_at(check_int("slot", slot, min=0, max=self.num_blocks - 1))

    def _block_at(self, slot: int) -> int:
        if slot >= self.num_full_blocks:
            return slot  # the short last block stays last
        return int(self._page_at(slot)[1][slot - self._page[0]])

    def _page_at(self, slot: int) -> list[Any]:
        """``[first slot, blocks, rotations]`` of the page of full-block slots holding ``slot``.

        The block order is drawn a page of slots at a time, vectorised: readers walk
        slots forwards, and a page is a bounded number of ints.
        """
        page = self._page
        if not 0 <= slot - page[0] < len(page[1]):
            assert self._blocks is not None
            first = slot - slot % _PAGE
            span = np.arange(first, min(self.num_full_blocks, first + _PAGE), dtype=np.int64)
            blocks = self._blocks.take(span)
            if self._rotation_key:
                shifts = _mix(blocks, self._rotation_key) % np.uint64(self.block_size)
                rotations = shifts.astype(np.int64).tolist()
            else:
                rotations = [0] * len(span)
            page[:] = [first, blocks.tolist(), rotations]
        return page

    def block_span(self, block: int) -> tuple[int, int]:
        """The global ids ``[start, stop)`` of block ``block``."""
        block = check_int("block", block, min=0, max=self.num_blocks - 1)
        start = block * self.block_size
        return start, min(self.n, start + self.block_size)

    def rotation(self, block: int) -> int:
        """How far ``block``'s places are rotated through the in-block permutation."""
        if not self._rotation_key or block >= self.num_full_blocks:
            return 0
        mixed = _mix(np.array([block], dtype=np.int64), self._rotation_key)
        return int(mixed[0] % np.uint64(self.block_size))

    def runs(self, lo: int, hi: int) -> Iterator[BlockRun]:
        """Positions ``[lo, hi)`` (``0 <= lo <= hi <= n``) grouped by block, in order."""
        lo = check_int("lo", lo, min=0, max=self.n)
        hi = check_int("hi", hi, min=lo, max=self.n)
        # The per-block work of every reader: kept to list look-ups and slices.
        b, n, full = self.block_size, self.n, self.num_full_blocks
        inner, page = self._inner_list, self._page
        for slot in range(lo // b, -(-hi // b)):
            base = slot * b
            first = lo - base if lo > base else 0
            last = hi - base if hi < base + b else b
            if slot < full:
                i = slot - page[0]
                if not 0 <= i < len(page[1]):
                    page = self._page_at(slot)
                    i = slot - page[0]
                block, shift = page[1][i], page[2][i]
                if inner is not None:
                    offsets = inner[first + shift : last + shift]
                else:
                    offsets = self._inner[first + shift : last + shift].tolist()
            else:
                block, offsets = slot, self._inner_last[first:last].tolist()
            start = block * b
            yield _new_run((block, start, min(n, start + b), offsets))

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


class Chunk(NamedTuple):
    """One replica's part of the micro-batch at global ``index``.

    Pass positions ``[lo, hi)`` are its real samples; when ``pad`` is not None it
    also takes pass position ``pad`` once more as padding (a duplicate), so that
    every replica yields ``size`` samples. ``step`` is what the micro-batch adds to
    the global index (all replicas together). (A named tuple: one is made per
    micro-batch on every reader's path.)
    """

    lo: int
    hi: int
    pad: int | None
    size: int
    step: int


_new_chunk = functools.partial(tuple.__new__, Chunk)


def replica_chunk(n: int, index: int, num_replicas: int, rank: int, local_bsz: int) -> Chunk:
    """Replica ``rank``'s contiguous run of the micro-batch that starts at ``index``.

    The micro-batch covers ``m = min(num_replicas * local_bsz, n - index % n)``
    positions from ``start = index % n``; they are split in contiguous runs, the
    first ``m % num_replicas`` replicas taking one more, the others a padding
    sample instead (the position after their run, modulo ``n``).
    """
    return _chunk(*_check_chunk_args(n, index, num_replicas, rank, local_bsz))


def _check_chunk_args(
    n: int, index: int, num_replicas: int, rank: int, local_bsz: int
) -> tuple[int, int, int, int, int]:
    replicas = check_int("num_replicas", num_replicas, min=1)
    return (
        check_n(n),
        check_int("index", index, min=0),
        replicas,
        check_int("rank", rank, min=0, max=replicas - 1),
        check_int("local_bsz", local_bsz, min=1),
    )


def _chunk(n: int, index: int, replicas: int, rank: int, local_bsz: int) -> Chunk:
    start = index % n
    m = min(replicas * local_bsz, n - start)
    base, extra = divmod(m, replicas)
    lo = start + rank * base + min(rank, extra)
    hi = lo + base + (rank < extra)
    size = base + (extra > 0)
    pad = hi % n if hi - lo < size else None
    return _new_chunk((lo, hi, pad, size, m))


def _chunks(
    n: int, index: int, replicas: int, rank: int, sizes: Callable[[], int], drop_last: bool
) -> Iterator[Chunk]:
    """The chunks from ``index`` to the pass end, each of the local size ``sizes()`` gives."""
    end = (index // n + 1) * n
    while index < end:
        size = sizes()
        if type(size) is not int or size < 1:  # a size <= 0 would never reach the end
            size = check_int("sizes()", size, min=1)
        chunk = _chunk(n, index, replicas, rank, size)
        if drop_last and chunk.step < replicas * size:
            return  # a short last micro-batch is dropped on every replica alike
        yield chunk
        index += chunk.step


def _check_drop_last(value: Any) -> bool:
    return check_bool("drop_last", value)


def _check_sizes(value: Any) -> Callable[[], int]:
    if not callable(value):
        raise ArgumentTypeError(f"sizes must be callable (() -> int), got {value!r}")
    return value  # type: ignore[no-any-return]


@attrs.frozen
class StreamPlan:
    """How replica ``rank`` reads one pass of a sharded dataset of ``n`` samples from ``index``.

    The pass is ``index // n``; its order (:meth:`order`) is keyed by ``(seed, epoch,
    pass)``. :meth:`chunks` gives the replica's part of each micro-batch from
    ``index`` on (:func:`replica_chunk`): all replicas together consume the positions
    ``[index, index + step)`` of each, so the consumed positions stay a prefix of the
    pass whatever sizes and replica counts came before. With ``drop_last`` a last
    micro-batch shorter than ``num_replicas * local_bsz`` is not read.
    """

    n: int = attrs.field(converter=check_n)
    block_size: int = attrs.field(converter=check_block_size)
    seed: int = attrs.field(converter=check_seed)
    epoch: int = attrs.field(converter=check_epoch)
    index: int
    num_replicas: int
    rank: int
    local_bsz: int
    shuffle: bool = attrs.field(default=True, converter=_check_shuffle)
    drop_last: bool = attrs.field(default=False, converter=_check_drop_last)

    def __attrs_post_init__(self) -> None:
        # replica_chunk's checks, once; they also make numpy ints plain ints.
        _, index, replicas, rank, local_bsz = _check_chunk_args(
            self.n, self.index, self.num_replicas, self.rank, self.local_bsz
        )
        for name, value in (
            ("index", index),
            ("num_replicas", replicas),
            ("rank", rank),
            ("local_bsz", local_bsz),
        ):
            object.__setattr__(self, name, value)  # frozen: set once, here

    @property
    def pass_(self) -> int:
        """Which pass ``index`` lies in."""
        return self.index // self.n

    def order(self) -> BlockOrder:
        """The order of the pass: blocks and the samples inside them, from (seed, epoch, pass)."""
        return BlockOrder(
            self.n,
            self.block_size,
            seed=self.seed,
            epoch=self.epoch,
            pass_=self.pass_,
            shuffle=self.shuffle,
        )

    def chunks(self, sizes: Callable[[], int] | None = None) -> Iterator[Chunk]:
        """This replica's chunk of each micro-batch from ``index`` to the pass end.

        ``sizes``, when given, is called once per micro-batch, as its chunk is made,
        for its local batch size (so the size may change between micro-batches: each
        replica must be given the same sizes); without it every micro-batch has
        ``local_bsz``.
        """
        size = itertools.repeat(self.local_bsz).__next__ if sizes is None else _check_sizes(sizes)
        return _chunks(self.n, self.index, self.num_replicas, self.rank, size, self.drop_last)

    def num_batches(self) -> int:
        """Micro-batches :meth:`chunks` yields at the fixed size ``local_bsz``."""
        rest, step = self.n - self.index % self.n, self.num_replicas * self.local_bsz
        return rest // step if self.drop_last else -(-rest // step)
