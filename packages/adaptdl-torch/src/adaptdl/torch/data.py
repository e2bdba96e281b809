"""Restart-safe, adaptive data loading: the seed's ``adaptdl.torch.data`` API.

The loop logic (where a pass starts, the local batch size, accumulation, when an
adaptive loop stops, stopping at a step boundary on SIGTERM) is core's
`LoaderHelper`; which indices each replica reads is core's `Shard`. This module
wires them into a real ``torch.utils.data.DataLoader``.
"""

from __future__ import annotations

import functools
import itertools
import logging
import random
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

import torch
from adaptdl.core.loop.loader import LoaderHelper
from adaptdl.core.loop.passbatches import IssuedSizes
from adaptdl.core.order.sampling import Shard
from adaptdl.core.order.seed import SHUFFLE_SEED, derive_seed
from adaptdl.torch._context import current_job
from adaptdl.torch._inherited import WINDOW
from adaptdl.torch._signals import shield_worker
from adaptdl.torch.progress import JobScalars
from adaptdl.torch.shards import ShardedStream
from torch.utils.data import DataLoader, Dataset, IterableDataset, Sampler

__all__ = [
    "AdaptiveDataLoader",
    "AdaptiveDataLoaderHelper",
    "AdaptiveDataLoaderMixin",
    "ElasticSampler",
    "current_dataloader",
]

LOG = logging.getLogger("adaptdl.torch.data")


def current_dataloader() -> LoaderHelper | None:
    """The loader whose loop is running now (its `AdaptiveDataLoaderHelper`), or None."""
    return current_job().current_loader


class _Count:
    """An int attribute >= ``least``, checked when assigned (ValueError otherwise)."""

    def __init__(self, least: int, doc: str) -> None:
        self.least = least
        self.__doc__ = doc

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        return self if obj is None else obj.__dict__[self.name]

    def __set__(self, obj: Any, value: Any) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < self.least:
            raise ValueError(f"{self.name} must be an int >= {self.least}, got {value!r}")
        obj.__dict__[self.name] = value


class ElasticSampler(Sampler[int]):
    """This replica's indices of a dataset, for a set epoch, from a set global index.

    Every replica derives the same permutation of the epoch (when ``shuffle``) and
    reads its own share of positions ``[index, len(dataset))`` of it, so that after a
    restart at any number of replicas, sampling continues where it left off.

    ``num_replicas`` and ``rank`` (default: the job's) are public attributes, as on
    torch's ``DistributedSampler``: assigning them changes which share is read.
    """

    def __init__(
        self,
        dataset: Dataset[Any],
        shuffle: bool = True,
        num_replicas: int | None = None,
        rank: int | None = None,
    ) -> None:
        if not isinstance(shuffle, bool):
            raise ValueError(f"shuffle must be a bool, got {shuffle!r}")
        self.dataset = dataset
        self.shuffle = shuffle
        self.epoch = 0
        self.index = 0
        if num_replicas is None or rank is None:
            topology = current_job().topology
            num_replicas = topology.num_replicas if num_replicas is None else num_replicas
            rank = topology.rank if rank is None else rank
        self.num_replicas = num_replicas
        self.rank = rank

    num_replicas = _Count(1, "How many replicas share each pass (int >= 1).")
    rank = _Count(0, "Which replica's share this sampler reads (int in [0, num_replicas)).")

    def set_epoch(self, epoch: int, index: int = 0) -> None:
        """Sample epoch ``epoch`` starting at global index ``index`` (e.g. after a restart)."""
        for name, value in (("epoch", epoch), ("index", index)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an int >= 0, got {value!r}")
        self.epoch = epoch
        self.index = index

    def _shard(self) -> Shard:
        if self.rank >= self.num_replicas:
            raise ValueError(
                f"ElasticSampler.rank must be in [0, {self.num_replicas - 1}] for "
                f"num_replicas={self.num_replicas}, got {self.rank}"
            )
        return Shard(
            len(self.dataset),  # type: ignore[arg-type]
            self.index,
            self.num_replicas,
            self.rank,
            seed=SHUFFLE_SEED,
            epoch=self.epoch,
            shuffle=self.shuffle,
        )

    def __iter__(self) -> Iterator[int]:
        """This replica's indices from the set index to the end of the pass."""
        return iter(self._shard())  # Python ints, drawn in numpy chunks

    def __len__(self) -> int:
        """How many indices `__iter__` yields."""
        return len(self._shard())


class _ResizableBatchSampler(Sampler[list[int]]):
    """Batches of a sampler whose size may change between batches, without a new iterator.

    Each batch takes the size `IssuedSizes` gives as it is issued (to a worker,
    with ``num_workers > 0``, ahead of the loop), which also records it for the
    loop to read when the batch arrives.
    """

    def __init__(self, sampler: Sampler[int], sizes: IssuedSizes, drop_last: bool) -> None:
        self.sampler = sampler
        self.sizes = sizes
        self.drop_last = drop_last

    @property
    def batch_size(self) -> int:
        """The size of the batches issued now."""
        return self.sizes.size

    def __iter__(self) -> Iterator[list[int]]:
        indices, issue, islice = iter(self.sampler), self.sizes.issue, itertools.islice
        drop_last = self.drop_last
        while True:
            size = issue()
            batch = [*islice(indices, size)]
            # A batch not made stays counted as issued: the next pass starts anew.
            if not batch or (drop_last and len(batch) < size):
                return
            yield batch

    def __len__(self) -> int:
        count, size = len(self.sampler), self.sizes.size  # type: ignore[arg-type]
        return count // size if self.drop_last else -(-count // size)


class _Pass:
    """One pass of the DataLoader's iterator, with the sizes of the batches it issues.

    Core's `ResizableBatches`: iterating it is iterating the DataLoader's iterator.
    """

    __slots__ = ("iterator", "sizes")

    def __init__(self, iterator: Iterator[Any], sizes: IssuedSizes) -> None:
        self.iterator = iterator
        self.sizes = sizes

    def __iter__(self) -> Iterator[Any]:
        return self.iterator


class AdaptiveDataLoaderHelper(LoaderHelper):
    """Fine-grained control over adaptive training loops (the seed's helper).

    ``batch_size`` is the target total batch size over all replicas. All state
    and decisions are core's `LoaderHelper`; this class binds it to the process's
    job and adds TensorBoard output.
    """

    def __init__(self, batch_size: int = 1) -> None:
        job = current_job()
        super().__init__(job, batch_size)
        self._scalars = JobScalars(job)

    def to_tensorboard(
        self, writer: Any, global_step: int | None = None, tag_prefix: str = ""
    ) -> None:
        """Write the batch sizes and the job's figures (`JobScalars`) to ``writer``.

        ``global_step`` None writes at the job's restart-safe `global_step`.
        """
        step = self._scalars.write(writer, global_step, tag_prefix)
        prefix = f"{tag_prefix}/" if tag_prefix and not tag_prefix.endswith("/") else tag_prefix
        writer.add_scalar(f"{prefix}Data/total_batch_size", self.current_batch_size, step)
        writer.add_scalar(f"{prefix}Data/local_batch_size", self.current_local_bsz, step)
        writer.add_scalar(f"{prefix}Data/accumulation_steps", self.accumulation_steps, step)


def _of_helper(name: str) -> Any:
    """A read-only property: the loader helper's (``self._elastic``) property ``name``."""
    source = getattr(LoaderHelper, name)
    return property(lambda self: getattr(self._elastic, name), doc=source.__doc__)


class AdaptiveDataLoaderMixin:
    """Elastic functionality for a custom DataLoader: a helper in ``self._elastic``."""

    def __init__(self, batch_size: int) -> None:
        self._elastic = AdaptiveDataLoaderHelper(batch_size)

    # The helper's signature and docstring (``inspect.signature`` follows ``__wrapped__``).
    @functools.wraps(LoaderHelper.autoscale_batch_size)
    def autoscale_batch_size(self, *args: Any, **kwargs: Any) -> None:
        self._elastic.autoscale_batch_size(*args, **kwargs)

    def train(self) -> None:
        """Make this the job's (one) training loader."""
        self._elastic.train()

    # Read-only views of the helper's properties of the same names.
    current_local_bsz: int = _of_helper("current_local_bsz")
    accumulation_steps: int = _of_helper("accumulation_steps")
    current_batch_size: int = _of_helper("current_batch_size")
    training: bool = _of_helper("training")

    def to_tensorboard(
        self, writer: Any, global_step: int | None = None, tag_prefix: str = ""
    ) -> None:
        """Write batch-size and job metrics to a ``torch.utils.tensorboard.SummaryWriter``."""
        self._elastic.to_tensorboard(writer, global_step, tag_prefix)

    def state_dict(self) -> dict[str, Any]:
        """The loop position as a JSON-safe dict (torchdata's ``StatefulDataLoader`` protocol).

        Taken between batches it counts the batch just yielded as consumed, so that
        `load_state_dict` before the next iteration resumes with the next one:
        every sample of the pass once. Lets torch.distributed.checkpoint, Lightning
        or Accelerate hold the loader; the job's own checkpoint needs none of it.
        """
        return self._elastic.position()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume the next iteration where `state_dict` (from `state_dict`) stands.

        Raises ValueError for a dict that `state_dict` did not make and
        RuntimeError inside this loader's own loop.
        """
        self._elastic.load_position(state_dict)


def _iterator(loader: DataLoader[Any]) -> Iterator[Any]:
    """``DataLoader.__iter__``, which forks the workers, with the collector off while
    it does (`adaptdl.torch._inherited`: workers never collect what they inherit)."""
    if loader.num_workers == 0:
        return DataLoader.__iter__(loader)
    with WINDOW.forking():
        return DataLoader.__iter__(loader)


class _WorkerInit:
    """Seeds ``random`` and numpy in each worker from torch's per-worker seed.

    Also makes the worker survive the SIGTERMs and SIGINTs sent to its process
    group or to every process (`adaptdl.torch._signals.shield_worker`).
    """

    def __init__(self, user_fn: Callable[[int], None] | None) -> None:
        self.user_fn = user_fn

    def __call__(self, worker_id: int) -> None:
        # torch seeds each worker with base_seed + worker_id; the base seed is drawn
        # from the loader's generator, which the loader seeds deterministically.
        shield_worker()
        seed = torch.initial_seed()
        random.seed(seed)
        np.random.seed(seed % 2**32)
        if self.user_fn is not None:
            self.user_fn(worker_id)


class AdaptiveDataLoader(DataLoader, AdaptiveDataLoaderMixin):  # type: ignore[type-arg]
    """A DataLoader with adaptive batch size and checkpoint-restart elasticity.

    ``batch_size`` is the target total batch size over all replicas. Iterate it
    inside ``for epoch in remaining_epochs_until(N):``; only one loop may run at a
    time. Every DataLoader worker gets a distinct seed that depends only on the
    epoch, the rank, the position in the pass and the worker id.

    A `adaptdl.torch.shards.ShardedDataset` (shard files streamed in order) is read
    micro-batch by micro-batch in core's block order (see that module).

    A batch size decided in the middle of a pass changes in place: the batches the
    workers already fetch keep their size, later ones take the new one, and the
    workers go on (with ``persistent_workers=True`` they also last across passes).

    Raises ValueError if ``sampler`` or ``batch_sampler`` is given, if
    ``in_order=False`` (batches out of order would leave a consumed set that is no
    prefix of the pass), or if the dataset is an ``IterableDataset`` other than a
    ``ShardedDataset``.
    """

    def __init__(
        self,
        dataset: Dataset[Any],
        batch_size: int = 1,
        shuffle: bool = False,
        **kwargs: Any,
    ) -> None:
        for name in ("sampler", "batch_sampler"):
            if kwargs.pop(name, None) is not None:
                raise ValueError(
                    f"AdaptiveDataLoader does not support a custom {name}: it samples with "
                    "an ElasticSampler so that restarts neither lose nor repeat data; "
                    "use shuffle=True/False instead (a Lightning Trainer adds a "
                    "DistributedSampler unless its strategy is "
                    "adaptdl.torch.lightning.AdaptiveStrategy)"
                )
        if kwargs.get("in_order", True) is not True:
            raise ValueError(
                f"AdaptiveDataLoader needs in_order=True, got {kwargs['in_order']!r}: its "
                "position after a restart is the prefix of the pass consumed in order"
            )
        stream = None
        if isinstance(dataset, IterableDataset):
            stream = ShardedStream.for_loader(dataset, shuffle, SHUFFLE_SEED, kwargs)
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
        generator = kwargs.pop("generator", None)
        if generator is None:
            generator = torch.Generator()
        worker_init_fn = _WorkerInit(kwargs.pop("worker_init_fn", None))
        if stream is not None:
            # The sampler issues a chunk per micro-batch and the stream reads it whole,
            # collated: no batching by the DataLoader.
            super().__init__(
                stream,
                batch_size=None,
                sampler=stream.sampler,
                collate_fn=stream.loader_collate(),
                generator=generator,
                worker_init_fn=worker_init_fn,
                **kwargs,
            )
            AdaptiveDataLoaderMixin.__init__(self, batch_size)
            return
        sampler = ElasticSampler(dataset, shuffle=shuffle)
        super().__init__(
            dataset,
            batch_size=batch_size,
            sampler=sampler,
            generator=generator,
            worker_init_fn=worker_init_fn,
            **kwargs,
        )
        # DataLoader takes no batch sampler beside batch_size and drop_last, and
        # refuses attributes set after its __init__: set past its __setattr__, so that
        # batch_size and drop_last keep the values given.
        resizable = _ResizableBatchSampler(sampler, IssuedSizes(batch_size), self.drop_last)
        object.__setattr__(self, "batch_sampler", resizable)
        AdaptiveDataLoaderMixin.__init__(self, batch_size)

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        """Iterate over this replica's batches of the loop (see the seed's semantics).

        Without adaptive batch size, stops after the dataset was processed once in
        total by all replicas; with it, once the statistical progress equals one pass
        at the target batch size. A checkpoint-restart may happen between batches.
        """
        helper = self._elastic
        rank = helper.job.topology.rank
        if isinstance(self.dataset, ShardedStream):
            return helper.iterate(len(self.dataset), self._sharded_batches(rank))
        sampler: ElasticSampler = self.sampler  # type: ignore[assignment]
        topology = helper.job.topology
        if (sampler.num_replicas, sampler.rank) != (topology.num_replicas, topology.rank):
            raise ValueError(
                f"this loader's sampler was set to rank {sampler.rank} of "
                f"{sampler.num_replicas} replicas but the job has rank {topology.rank} of "
                f"{topology.num_replicas}: an AdaptiveDataLoader reads the job's share"
            )

        sizes = self.batch_sampler.sizes  # type: ignore[union-attr]

        def batches(epoch: int, index: int, local_bsz: int) -> _Pass:
            sampler.set_epoch(epoch, index)
            sizes.start(local_bsz)
            if self.generator is not None:
                self.generator.manual_seed(derive_seed(SHUFFLE_SEED, epoch, rank, index))
            return _Pass(_iterator(self), sizes)

        # Outside epoch loops the epoch the program set on the sampler (set_epoch, as
        # for DistributedSampler; 0 by default) keys the order. The loop's own settings
        # are undone after it, so that a replayed program sets the same again. The loop
        # is core's generator itself: a generator of ours around it would cost every batch.
        free_epoch = sampler.epoch
        return helper.iterate(
            len(sampler.dataset),  # type: ignore[arg-type]
            batches,
            free_epoch=free_epoch,
            after=functools.partial(sampler.set_epoch, free_epoch),
        )

    def _sharded_batches(self, rank: int) -> Callable[[int, int, int], _Pass]:
        stream: ShardedStream = self.dataset  # type: ignore[assignment]

        def batches(epoch: int, index: int, local_bsz: int) -> _Pass:
            stream.start(epoch, index, self._elastic.job.topology.num_replicas, rank, local_bsz)
            if self.num_workers == 0 and not self.pin_memory:
                # The stream reads collated micro-batches: without workers or pinning
                # the DataLoader would only hand them on, at a cost per batch.
                return _Pass(stream.batches(), stream.sizes)
            if self.generator is not None:
                self.generator.manual_seed(derive_seed(SHUFFLE_SEED, epoch, rank, index))
            return _Pass(_iterator(self), stream.sizes)

        return batches

    def __len__(self) -> int:
        """Batches this replica yields in a pass from the sampler's index at the current size.

        An adaptive loop may change the batch size at each pass and walk several
        passes, so for it this is an estimate of one pass.
        """
        helper = self._elastic
        replicas = helper.job.topology.num_replicas
        local = helper.current_local_bsz or -(-helper.batch_size // replicas)
        if isinstance(self.dataset, ShardedStream):
            return self.dataset.num_batches(local, replicas, helper.job.topology.rank)
        count = len(self.sampler)  # type: ignore[arg-type]
        return count // local if self.drop_last else -(-count // local)
