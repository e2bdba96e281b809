"""What `AdaptiveDataLoader` reads a `ShardedDataset` through: micro-batches in core's order.

`ShardedStream` is a map-style dataset indexed by the chunks its sampler issues
(core's `StreamPlan`), one per micro-batch; each index reads and collates one
micro-batch. Also importable as ``adaptdl.torch.shards.ShardedStream``.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from typing import Any

import attrs

import torch
from adaptdl.core.loop.passbatches import IssuedSizes
from adaptdl.core.order.shards import Chunk, StreamPlan
from adaptdl.torch.shards import ShardedDataset
from torch.utils.data import Dataset, Sampler

__all__ = ["ShardedStream"]


def _keep(batch: Any) -> Any:
    """The DataLoader's collate step: the stream yields collated micro-batches already."""
    return batch


class ShardedStream(Dataset[Any]):
    """What `AdaptiveDataLoader` hands its DataLoader for a `ShardedDataset`.

    Its :attr:`sampler` issues this replica's chunks of the pass (core's
    `StreamPlan`, from the planned global index), one per micro-batch, each of the
    local batch size that :attr:`sizes` gives as it is issued; indexing the stream
    with one reads and collates that micro-batch. So, as for a map-style dataset,
    the DataLoader's workers read micro-batches in turn, and a batch size changed in
    the middle of a pass applies to the micro-batches issued from then on, without
    new workers.
    """

    def __init__(
        self,
        dataset: ShardedDataset,
        *,
        shuffle: bool,
        seed: int,
        collate_fn: Callable[[list[Any]], Any] | None,
        drop_last: bool,
    ) -> None:
        self.dataset = dataset
        self.shuffle = shuffle
        self.seed = seed
        self.collate_fn = collate_fn or torch.utils.data.default_collate
        self.drop_last = drop_last
        self.sizes = IssuedSizes()
        self.sampler = _ChunkSampler(self)
        self._plan = self._make_plan(0, 0, 1, 0, 1)
        # The plan of the chunks read last, and its order (made once per plan).
        self._read_plan: StreamPlan | None = None
        self._order: Any = None

    @classmethod
    def for_loader(
        cls, dataset: Any, shuffle: bool, seed: int, kwargs: dict[str, Any]
    ) -> ShardedStream:
        """The stream for `AdaptiveDataLoader`; pops the options it takes from ``kwargs``
        (the DataLoader is to read it through the stream's :attr:`sampler`).

        Raises ValueError for an IterableDataset that is not a `ShardedDataset`.
        """
        if not isinstance(dataset, ShardedDataset):
            raise ValueError(
                "AdaptiveDataLoader needs a map-style dataset (with __len__ and "
                "__getitem__) or a sharded one: adaptdl.torch.shards.ShardedDataset(shards, "
                "reader) streams shard files with known sample counts and resumes exactly "
                f"once after restarts at any size; got the IterableDataset {type(dataset)!r}"
            )
        if not isinstance(shuffle, bool):
            raise ValueError(f"shuffle must be a bool, got {shuffle!r}")
        stream = cls(
            dataset,
            shuffle=shuffle,
            seed=seed,
            collate_fn=kwargs.pop("collate_fn", None),
            drop_last=bool(kwargs.pop("drop_last", False)),
        )
        return stream

    @staticmethod
    def loader_collate() -> Callable[[Any], Any]:
        return _keep

    def __len__(self) -> int:
        return len(self.dataset)

    def _make_plan(
        self, epoch: int, index: int, replicas: int, rank: int, local_bsz: int
    ) -> StreamPlan:
        return StreamPlan(
            len(self.dataset),
            self.dataset.block_size,
            self.seed,
            epoch,
            index,
            replicas,
            rank,
            local_bsz,
            shuffle=self.shuffle,
            drop_last=self.drop_last,
        )

    def set_plan(self, epoch: int, index: int, replicas: int, rank: int, local_bsz: int) -> None:
        """Read the pass from global ``index`` (epoch, replicas, rank, local batch size)."""
        self._plan = self._make_plan(epoch, index, replicas, rank, local_bsz)

    def start(self, epoch: int, index: int, replicas: int, rank: int, local_bsz: int) -> None:
        """A pass starts: `set_plan`, and issue micro-batches of ``local_bsz`` from the first."""
        self.set_plan(epoch, index, replicas, rank, local_bsz)
        self.sizes.start(local_bsz)

    def num_batches(
        self, local_bsz: int, replicas: int | None = None, rank: int | None = None
    ) -> int:
        """Micro-batches of ``local_bsz`` from the planned index to the pass end.

        ``replicas`` and ``rank`` default to the plan's; the plan is left as it is.
        """
        plan = self._plan
        return attrs.evolve(
            plan,
            local_bsz=local_bsz,
            num_replicas=plan.num_replicas if replicas is None else replicas,
            rank=plan.rank if rank is None else rank,
        ).num_batches()

    def batches(self) -> Iterator[Any]:
        """The planned pass's micro-batches read in this process (no DataLoader)."""
        return map(self.__getitem__, self.sampler)

    def __getitem__(self, ticket: tuple[StreamPlan, Chunk]) -> Any:
        """The collated micro-batch of a chunk that :attr:`sampler` issued."""
        plan, (lo, hi, pad, _, _) = ticket
        if plan is not self._read_plan:  # a worker gets a copy of the plan with each chunk
            if plan != self._read_plan:
                self._order = plan.order()
            self._read_plan = plan
        take, order = self.dataset.take, self._order
        samples = take(order, lo, hi)
        if pad is not None:
            samples += take(order, pad, pad + 1)
        return self.collate_fn(samples)


class _ChunkSampler(Sampler[Any]):
    """Issues the planned pass's chunks, one per micro-batch, each with its plan."""

    def __init__(self, stream: ShardedStream) -> None:
        self.stream = stream

    def __iter__(self) -> Iterator[tuple[StreamPlan, Chunk]]:
        plan = self.stream._plan
        return zip(itertools.repeat(plan), plan.chunks(self.stream.sizes.issue))

    def __len__(self) -> int:
        """Micro-batches from the planned index at the size issued now (as dense batches)."""
        return self.stream.num_batches(self.stream.sizes.size)
