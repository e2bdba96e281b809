"""Which samples of a pass belong to which replica, from a global index.

A pass is one walk over a permutation of the dataset. The global ``index`` counts
the samples that all replicas together consumed since the start of the epoch, so
the current pass is ``index // n`` and it resumes at position ``index % n``.
Replica ``rank`` of ``num_replicas`` takes the pass positions
``start + rank + k * num_replicas`` for ``k = 0, 1, ...``: after every replica has
consumed ``k`` samples, exactly the positions ``[start, start + num_replicas * k)``
are consumed, whatever world sizes came before. That is the prefix invariant which
lets a job resume, or change its world size, at any batch boundary.

Every replica gets the same number of samples, so that they stay in step; a
replica whose last position falls past the end of the pass takes one padding
sample instead, position ``pos % n`` of the same permutation (a real index, and a
duplicate). Padding is explicit: :attr:`Shard.padding` and :meth:`Shard.is_padding`.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import attrs
import numpy as np
import numpy.typing as npt

from adaptdl.core.order.permutation import Identity, Permutation, check_n, make_permutation
from adaptdl.core.validate import check_bool, check_epoch, check_int, check_seed

__all__ = ["Shard"]

# Iteration draws indices in numpy chunks. Each chunk costs the permutation's fixed
# ~80 numpy calls (a few hundred microseconds) besides its per-index work, so a loader
# draws whole blocks of the permutation: the first index of a pass comes after about
# a millisecond, and a pass of 20,000 samples is one chunk instead of fifteen.
_FIRST_CHUNK = 1 << 15
_MAX_CHUNK = 1 << 16


def _check_shuffle(value: Any) -> bool:
    return check_bool("shuffle", value)


@attrs.frozen
class Shard:
    """The samples of replica ``rank`` from global ``index`` to the end of its pass.

    Local sample ``k`` (``0 <= k < count``) is pass position
    ``start + rank + k * num_replicas``, wrapped modulo ``n`` when it is padding;
    its dataset index is that position of the pass's permutation.
    """

    n: int = attrs.field(converter=check_n)
    index: int
    num_replicas: int
    rank: int
    seed: int = attrs.field(default=0, converter=check_seed)
    epoch: int = attrs.field(default=0, converter=check_epoch)
    shuffle: bool = attrs.field(default=True, converter=_check_shuffle)
    _permutation: Permutation | Identity = attrs.field(init=False, repr=False, eq=False)

    def __attrs_post_init__(self) -> None:
        for name, least in (("index", 0), ("num_replicas", 1), ("rank", 0)):
            object.__setattr__(self, name, check_int(name, getattr(self, name), min=least))
        if self.rank >= self.num_replicas:
            raise ValueError(
                f"rank must be in [0, {self.num_replicas - 1}] for num_replicas="
                f"{self.num_replicas}, got {self.rank}"
            )
        permutation = make_permutation(
            self.n, seed=self.seed, epoch=self.epoch, pass_=self.pass_, shuffle=self.shuffle
        )
        object.__setattr__(self, "_permutation", permutation)

    @property
    def pass_(self) -> int:
        """The pass that ``index`` falls in."""
        return self.index // self.n

    @property
    def start(self) -> int:
        """The pass position that ``index`` resumes at, in ``[0, n)``."""
        return self.index % self.n

    @property
    def permutation(self) -> Permutation | Identity:
        """The order of this pass (the identity when not shuffling)."""
        return self._permutation

    @property
    def count(self) -> int:
        """Local samples to the end of the pass, padding included; the same on every rank."""
        return -(-(self.n - self.start) // self.num_replicas)

    @property
    def padding(self) -> int:
        """This replica's padding samples: 1 if its last position is past the pass, else 0."""
        return int(self.start + self.rank + (self.count - 1) * self.num_replicas >= self.n)

    @property
    def total_padding(self) -> int:
        """Padding samples over all replicas: ``num_replicas * count - (n - start)``."""
        return self.num_replicas * self.count - (self.n - self.start)

    def __len__(self) -> int:
        return self.count

    def _raw_positions(self, lo: int, hi: int | None) -> npt.NDArray[np.int64]:
        """Unwrapped pass positions of local samples ``[lo, hi)`` (padding is ``>= n``)."""
        count = self.count
        lo = check_int("lo", lo, min=0, max=count)
        hi = count if hi is None else check_int("hi", hi, min=lo, max=count)
        raw = np.arange(lo, hi, dtype=np.int64)
        raw *= self.num_replicas
        raw += self.start + self.rank
        return raw

    def positions(self, lo: int = 0, hi: int | None = None) -> npt.NDArray[np.int64]:
        """Pass positions of local samples ``[lo, hi)``, padding wrapped into ``[0, n)``.

        ``0 <= lo <= hi <= count``; ``hi`` defaults to ``count``.
        """
        raw = self._raw_positions(lo, hi)
        if self.padding and raw.size and raw[-1] >= self.n:
            # Only the last local sample can be padding, and only it needs wrapping.
            raw[-1] %= self.n
        return raw

    def indices(self, lo: int = 0, hi: int | None = None) -> npt.NDArray[np.int64]:
        """Dataset indices of local samples ``[lo, hi)``: the permutation at :meth:`positions`."""
        return self._permutation.take(self.positions(lo, hi))

    def is_padding(self, lo: int = 0, hi: int | None = None) -> npt.NDArray[np.bool_]:
        """Whether each local sample of ``[lo, hi)`` is padding (a duplicate)."""
        return self._raw_positions(lo, hi) >= self.n

    def __iter__(self) -> Iterator[int]:
        """Local dataset indices as Python ints, drawn in numpy chunks."""
        # chain hands out the items of each chunk's list at C speed; only the chunk
        # generator runs Python code, once a chunk.
        return itertools.chain.from_iterable(self._chunk_lists())

    def _chunk_lists(self) -> Iterator[list[int]]:
        count, lo, size = self.count, 0, _FIRST_CHUNK
        while lo < count:
            hi = min(count, lo + size)
            yield self.indices(lo, hi).tolist()
            lo, size = hi, min(2 * size, _MAX_CHUNK)
