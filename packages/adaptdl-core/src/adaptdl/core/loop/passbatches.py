"""The batches of one pass, as an adapter hands them to a loop, and their sizes.

A loop asks its adapter for the batches of a pass (`BatchesFn`). An adapter whose
batches are drawn ahead of the loop (DataLoader workers fetch several while the
loop trains on one) may let their size change in place, without starting its
readers anew: it hands back `ResizableBatches`, whose `IssuedSizes` gives each
batch its size as it is issued. A new size applies from a batch number that every
replica agrees on, so that all replicas switch at the same batch whatever each
drew ahead; batches arrive in the order they were issued, so the loop, which
made the decision, knows the size of each batch it receives from its number
alone and reads nothing per batch.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Protocol, TypeVar, runtime_checkable

from adaptdl.core.validate import check_int

__all__ = ["BatchesFn", "IssuedSizes", "ResizableBatches"]

T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)

BatchesFn = Callable[[int, int, int], Iterable[T]]
"""(epoch, index, local_bsz) -> the batches of one pass, starting at that index."""


class IssuedSizes:
    """The local batch size of each batch as it is issued, and the resizes to come.

    The adapter calls `issue` for each batch it issues (in issue order, the order
    in which batches arrive); the loop calls `resize` to change the size of the
    batches issued from a given batch number on.
    """

    __slots__ = ("_resizes", "issued", "size")

    def __init__(self, size: int = 1) -> None:
        self.size = check_int("size", size, min=1)  # of the batches issued now
        self.issued = 0  # batches issued since `start`
        self._resizes: deque[tuple[int, int]] = deque()  # (from batch number, size), in order

    def start(self, size: int) -> None:
        """A pass starts: nothing issued, batches of ``size`` from the first."""
        self.size = check_int("size", size, min=1)
        self.issued = 0
        self._resizes.clear()

    def issue(self) -> int:
        """The size of the batch being issued now (batch number `issued`)."""
        resizes = self._resizes
        while resizes and resizes[0][0] <= self.issued:
            self.size = resizes.popleft()[1]
        self.issued += 1
        return self.size

    def resize(self, size: int, at: int) -> None:
        """Issue batches of ``size`` from batch number ``at`` (0: the pass's first) on.

        ``at`` must not be below `issued` (issued batches keep their size) nor below
        the batch number of an earlier resize still to come: each replica applies
        every resize at its batch number, however far ahead it has issued.
        """
        size = check_int("size", size, min=1)
        least = max(self.issued, self._resizes[-1][0] if self._resizes else 0)
        at = check_int("at", at, min=least)
        self._resizes.append((at, size))


@runtime_checkable
class ResizableBatches(Protocol[T_co]):
    """The batches of one pass whose size the loop may change between batches."""

    @property
    def sizes(self) -> IssuedSizes: ...

    def __iter__(self) -> Iterator[T_co]: ...
