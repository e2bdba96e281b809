"""Seeded bijections on ``[0, n)`` with random access and O(1) memory.

A :class:`Permutation` is a keyed, unbalanced Feistel network on a domain of
``left_size * 2**right_bits`` elements just above ``n`` (the left half is added
modulo ``left_size``, the right half xored), restricted to ``[0, n)`` by cycle
walking. Its round keys come from ``hashlib.shake_256`` of a fixed text encoding
of ``(n, seed, epoch, pass_)`` and its round function is pure 64-bit integer
arithmetic, done alike by Python ints (one element) and numpy uint64 arrays
(many), so the same arguments give the same order on every platform, numpy
release and Python version.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Iterator
from typing import Any

import attrs
import numpy as np
import numpy.typing as npt

from adaptdl.core.validate import (
    ArgumentTypeError,
    check_bool,
    check_epoch,
    check_int,
    check_seed,
)

__all__ = ["MAX_N", "Identity", "Permutation", "check_n", "make_permutation", "round_keys"]

#: Largest supported length: positions and values must fit int64 with room to spare.
MAX_N = 2**62

# Rounds of the network, by n. Small domains have tiny halves, which take more
# rounds to mix: a chi-square test of the joint law of (perm[0], perm[1]) over 10**5
# seeds rejected 8 rounds at n = 12 (p ~ 1e-8), and over 6 * 10**4 seeds it leaned
# against 12 rounds at n = 4 (p ~ 0.01). Extra rounds cost nothing that matters on
# small n; large halves mix well in 8, where each extra round costs ~3 ns an element.
_ROUNDS_BY_SIZE = ((1 << 8, 24), (1 << 16, 12))
_ROUNDS_LARGE = 8
_MASK64 = (1 << 64) - 1
# Odd 64-bit multipliers of the round mixer (those of the splitmix64 finaliser).
_M1 = 0xBF58476D1CE4E5B9
_M2 = 0x94D049BB133111EB
# Bumping the version changes every order; it exists so that a future change of the
# network is an explicit, visible break rather than a silent one.
_KEY_VERSION = "adaptdl.core.permutation/v1"  # part of every key: never rename
# Up to this many elements, the pure-Python network beats numpy's per-call overhead.
_SCALAR_MAX = 16
# Elements per block of the vectorised network: its four working arrays (1 MiB) stay
# in a 1 MiB L2 cache, and numpy's ~80 calls per block are amortised. Measured on
# an EPYC: 2**13 took ~1.7x and 2**16 ~1.5x the time per element of 2**15.
_BLOCK = 1 << 15
# First chunk of an iterator is short so the first element comes quickly; later
# chunks grow to amortise the per-chunk cost.
_FIRST_CHUNK = 1
_MAX_CHUNK = 1 << 16

_U64_M1 = np.uint64(_M1)
_U64_M2 = np.uint64(_M2)
_U64_32 = np.uint64(32)


def check_n(value: Any) -> int:
    """A permutation's length: an int in [1, :data:`MAX_N`] (an attrs converter)."""
    return check_int("n", value, min=1, max=MAX_N)


def _check_pass(value: Any) -> int:
    return check_int("pass_", value, min=0)


def _check_position(position: Any, n: int) -> int:
    """``position`` as an index into ``[0, n)`` (negative counts from the end), or raise."""
    i = check_int("position", position)
    if i < 0:
        i += n
    if not 0 <= i < n:
        raise IndexError(f"position must be in [{-n}, {n}), got {position}")
    return i


def round_keys(n: int, seed: int, epoch: int, pass_: int) -> tuple[int, ...]:
    """The 64-bit round keys of the network for ``(n, seed, epoch, pass_)``.

    Derived from SHAKE-256 of a fixed ASCII encoding, so they depend on nothing but
    the four integers; there are 24 for ``n < 2**8``, 12 for ``n < 2**16`` and 8 beyond.
    """
    rounds = next((r for limit, r in _ROUNDS_BY_SIZE if n < limit), _ROUNDS_LARGE)
    message = f"{_KEY_VERSION};n={n};seed={seed};epoch={epoch};pass={pass_}".encode("ascii")
    digest = hashlib.shake_256(message).digest(8 * rounds)
    return tuple(int.from_bytes(digest[8 * i : 8 * i + 8], "little") for i in range(rounds))


def _as_positions(positions: npt.ArrayLike, n: int) -> npt.NDArray[Any]:
    """Check that ``positions`` is an integer array with every entry in ``[0, n)``."""
    array = np.asarray(positions)
    if array.dtype.kind not in "iu":
        raise ArgumentTypeError(f"positions must be an integer array, got dtype {array.dtype}")
    if array.size:
        lo, hi = int(array.min()), int(array.max())
        if lo < 0 or hi >= n:
            bad = lo if lo < 0 else hi
            raise IndexError(f"positions must be in [0, {n}), got {bad}")
    return array


def _chunks(length: int) -> Iterator[tuple[int, int]]:
    """Half-open ranges covering ``[0, length)``, short at first and growing."""
    lo, size = 0, _FIRST_CHUNK
    while lo < length:
        hi = min(length, lo + size)
        yield lo, hi
        lo, size = hi, min(2 * size, _MAX_CHUNK)


@attrs.frozen
class Permutation:
    """A pseudo-random bijection on ``[0, n)`` determined by ``(n, seed, epoch, pass_)``.

    ``perm[i]`` is the value at position ``i``; negative positions count from the
    end as for a list. :meth:`take` maps a whole integer array at once (positions
    must lie in ``[0, n)`` there). Memory is O(1) whatever ``n``: nothing is
    materialised.
    """

    n: int = attrs.field(converter=check_n)
    seed: int = attrs.field(default=0, converter=check_seed)
    epoch: int = attrs.field(default=0, converter=check_epoch)
    pass_: int = attrs.field(default=0, converter=_check_pass)
    _keys: tuple[int, ...] = attrs.field(init=False, repr=False, eq=False)
    _left_size: int = attrs.field(init=False, repr=False, eq=False)
    _right_bits: int = attrs.field(init=False, repr=False, eq=False)
    _reduce_shift: int = attrs.field(init=False, repr=False, eq=False)

    def __attrs_post_init__(self) -> None:
        # The domain is left_size * 2**right_bits: a right half of about half the bits
        # of n, and a left half just big enough to cover n. The domain then exceeds n
        # by less than 2**right_bits (about sqrt(n)), so cycle walking almost never
        # runs; a power-of-two domain would leave up to half of it outside [0, n).
        right_bits = (self.n - 1).bit_length() // 2
        object.__setattr__(self, "_keys", round_keys(self.n, self.seed, self.epoch, self.pass_))
        object.__setattr__(self, "_left_size", -(-self.n >> right_bits))
        object.__setattr__(self, "_right_bits", right_bits)
        # F(right) mod left_size is taken as (h >> c) * left_size >> (64 - c) with
        # c = bit_length(left_size): a multiply instead of a (much slower) division,
        # exact in uint64 because h >> c has 64 - c bits. Its bias is below
        # 2**(2c - 64) (< 2**-22 for every n up to 2**40).
        object.__setattr__(self, "_reduce_shift", self._left_size.bit_length())

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, position: int) -> int:
        i = _check_position(position, self.n)
        return 0 if self.n == 1 else self._permute_scalar(i)

    def take(self, positions: npt.ArrayLike) -> npt.NDArray[np.int64]:
        """Values at ``positions`` (integers in ``[0, n)``), as int64 of the same shape."""
        array = _as_positions(positions, self.n)
        out = np.empty(array.shape, dtype=np.int64)
        if self.n == 1 or array.size == 0:
            out.fill(0)
            return out
        if array.size <= _SCALAR_MAX:
            out.reshape(-1)[:] = [self._permute_scalar(int(i)) for i in array.reshape(-1)]
            return out
        flat_in = array.reshape(-1)
        flat_out = out.reshape(-1)
        work = _Workspace(min(_BLOCK, flat_in.size))
        for lo in range(0, flat_in.size, _BLOCK):
            hi = min(lo + _BLOCK, flat_in.size)
            flat_out[lo:hi] = self._encrypt_block(flat_in[lo:hi], work)
        return out

    def __iter__(self) -> Iterator[int]:
        """The values in position order, as Python ints, computed in numpy chunks."""
        chunks = (
            self.take(np.arange(lo, hi, dtype=np.int64)).tolist() for lo, hi in _chunks(self.n)
        )
        return itertools.chain.from_iterable(chunks)

    def _permute_scalar(self, position: int) -> int:
        """The value at ``position`` (in ``[0, n)``, ``n > 1``), by cycle walking."""
        x = self._network_scalar(position)
        while x >= self.n:
            x = self._network_scalar(x)
        return x

    def _network_scalar(self, x: int) -> int:
        """One pass of the Feistel network on a single domain element."""
        right_bits, left_size = self._right_bits, self._left_size
        left = x >> right_bits
        right = x & ((1 << right_bits) - 1)
        for r, key in enumerate(self._keys):
            if r % 2 == 0:
                h = (_mix_scalar(right, key) >> self._reduce_shift) * left_size
                left = (left + (h >> (64 - self._reduce_shift))) % left_size
            elif right_bits:
                right ^= _mix_scalar(left, key) >> (64 - right_bits)
        return (left << right_bits) | right

    def _encrypt_block(self, block: npt.NDArray[Any], work: _Workspace) -> npt.NDArray[np.uint64]:
        """The permutation of ``block`` (one block of positions), by cycle walking."""
        size = block.size
        x = work.x[:size]
        x[...] = block
        self._network(x, work.left[:size], work.right[:size], work.scratch[:size])
        n = np.uint64(self.n)
        # Walk only the elements still outside [0, n). Fewer than 2**right_bits of the
        # domain lie there (a fraction below ~2/sqrt(n)), so this loop rarely runs.
        pending = np.flatnonzero(x >= n)
        while pending.size:
            y = x[pending]
            self._network(y, np.empty_like(y), np.empty_like(y), np.empty_like(y))
            x[pending] = y
            pending = pending[y >= n]
        return x

    def _network(
        self,
        x: npt.NDArray[np.uint64],
        left: npt.NDArray[np.uint64],
        right: npt.NDArray[np.uint64],
        scratch: npt.NDArray[np.uint64],
    ) -> None:
        """One pass of the Feistel network over ``x``, in place (the rest is scratch)."""
        right_bits = np.uint64(self._right_bits)
        np.right_shift(x, right_bits, out=left)
        np.bitwise_and(x, np.uint64((1 << self._right_bits) - 1), out=right)
        # x is free until the halves are joined again: it is the second scratch array.
        t1, t2 = scratch, x
        left_size = np.uint64(self._left_size)
        reduce_shift = np.uint64(self._reduce_shift)
        reduce_back = np.uint64(64 - self._reduce_shift)
        right_shift = np.uint64(64 - self._right_bits)
        for r, key in enumerate(self._keys):
            if r % 2 == 0:
                # left = (left + F(right) mod left_size) mod left_size. Both terms are
                # below left_size, so the second reduction is one conditional
                # subtraction: if the sum is below left_size, sum - left_size wraps
                # round to a larger uint64 and the minimum keeps the sum.
                _mix(right, np.uint64(key), t1, t2)
                np.right_shift(t1, reduce_shift, out=t1)
                np.multiply(t1, left_size, out=t1)
                np.right_shift(t1, reduce_back, out=t1)
                np.add(left, t1, out=left)
                np.subtract(left, left_size, out=t1)
                np.minimum(left, t1, out=left)
            elif self._right_bits:
                _mix(left, np.uint64(key), t1, t2)
                np.right_shift(t1, right_shift, out=t1)
                np.bitwise_xor(right, t1, out=right)
        np.left_shift(left, right_bits, out=x)
        np.bitwise_or(x, right, out=x)


def _mix_scalar(half: int, key: int) -> int:
    """The keyed 64-bit mixer of the round function, on Python ints."""
    h = ((half ^ key) * _M1) & _MASK64
    h ^= h >> 32
    return (h * _M2) & _MASK64


def _mix(
    half: npt.NDArray[np.uint64],
    key: np.uint64,
    out: npt.NDArray[np.uint64],
    scratch: npt.NDArray[np.uint64],
) -> None:
    """``out = mix(half, key)``: the vectorised twin of :func:`_mix_scalar`."""
    np.bitwise_xor(half, key, out=out)
    np.multiply(out, _U64_M1, out=out)
    np.right_shift(out, _U64_32, out=scratch)
    np.bitwise_xor(out, scratch, out=out)
    np.multiply(out, _U64_M2, out=out)


class _Workspace:
    """Scratch arrays for one :meth:`Permutation.take` call (never shared)."""

    def __init__(self, size: int) -> None:
        self.x = np.empty(size, dtype=np.uint64)
        self.left = np.empty(size, dtype=np.uint64)
        self.right = np.empty(size, dtype=np.uint64)
        self.scratch = np.empty(size, dtype=np.uint64)


@attrs.frozen
class Identity:
    """The identity on ``[0, n)`` with the interface of :class:`Permutation` (no shuffle)."""

    n: int = attrs.field(converter=check_n)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, position: int) -> int:
        return _check_position(position, self.n)

    def take(self, positions: npt.ArrayLike) -> npt.NDArray[np.int64]:
        """``positions`` themselves (integers in ``[0, n)``), as int64 of the same shape."""
        return _as_positions(positions, self.n).astype(np.int64, copy=True)

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.n))


def make_permutation(
    n: int, *, seed: int = 0, epoch: int = 0, pass_: int = 0, shuffle: bool = True
) -> Permutation | Identity:
    """The order of pass ``pass_`` of ``epoch``: shuffled by ``seed``, or the identity."""
    if check_bool("shuffle", shuffle):
        return Permutation(n, seed=seed, epoch=epoch, pass_=pass_)
    # Validate the unused arguments too, so that a bad seed fails whether or not
    # this run happens to shuffle.
    check_seed(seed)
    check_epoch(epoch)
    _check_pass(pass_)
    return Identity(n)
