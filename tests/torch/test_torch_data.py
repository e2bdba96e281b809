"""AdaptiveDataLoader, ElasticSampler and the loop API in one process."""

from __future__ import annotations

import gc
import os
import random
import weakref
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import Dataset, IterableDataset, TensorDataset

import adaptdl.torch as adl
import torch
from adaptdl.core.decide.batchsize import RedecideSchedule
from adaptdl.core.loop.boundary import Preempted
from adaptdl.core.order.sampling import Shard
from adaptdl.core.order.seed import SHUFFLE_SEED
from adaptdl.torch import _context
from adaptdl.torch._inherited import WINDOW
from adaptdl.torch.data import (
    AdaptiveDataLoader,
    AdaptiveDataLoaderHelper,
    AdaptiveDataLoaderMixin,
    ElasticSampler,
    current_dataloader,
)


def indexed(n: int) -> TensorDataset:
    return TensorDataset(torch.arange(n), torch.randn(n, 3))


def consume(loader: AdaptiveDataLoader) -> list[int]:
    seen: list[int] = []
    for batch in loader:
        seen += batch[0].tolist()
    return seen


class SeedReport(Dataset[Any]):
    """Returns, per sample, the seeds the worker's random generators were given."""

    def __len__(self) -> int:
        return 12

    def __getitem__(self, i: int) -> tuple[int, int, int, float]:
        info = torch.utils.data.get_worker_info()
        return i, torch.initial_seed(), info.id if info else -1, float(np.random.rand())


class Stream(IterableDataset[int]):
    def __iter__(self) -> Any:
        return iter(range(3))


# -- ElasticSampler ----------------------------------------------------------------------


@settings(max_examples=50, deadline=None)
@given(n=st.integers(1, 300), epoch=st.integers(0, 5), frac=st.floats(0, 1), shuffle=st.booleans())
def test_sampler_yields_the_core_shard_from_the_set_index(
    n: int, epoch: int, frac: float, shuffle: bool
) -> None:
    index = int(frac * (n - 1))
    sampler = ElasticSampler(indexed(n), shuffle=shuffle)
    sampler.set_epoch(epoch, index)
    shard = Shard(n, index, 1, 0, seed=SHUFFLE_SEED, epoch=epoch, shuffle=shuffle)
    assert list(sampler) == list(shard)
    assert len(sampler) == shard.count


def test_sampler_orders_differ_between_epochs_and_not_without_shuffle() -> None:
    sampler = ElasticSampler(indexed(50))
    orders = []
    for epoch in range(2):
        sampler.set_epoch(epoch)
        orders.append(list(sampler))
    assert orders[0] != orders[1] and sorted(orders[0]) == list(range(50))
    plain = ElasticSampler(indexed(50), shuffle=False)
    plain.set_epoch(3, 10)
    assert list(plain) == list(range(10, 50))


@pytest.mark.parametrize(("epoch", "index"), [(-1, 0), (0, -1), (1.5, 0), (0, True)])
def test_sampler_rejects_bad_epoch_or_index(epoch: Any, index: Any) -> None:
    with pytest.raises(ValueError, match="must be an int >= 0"):
        ElasticSampler(indexed(5)).set_epoch(epoch, index)


def test_sampler_rejects_non_bool_shuffle() -> None:
    with pytest.raises(ValueError, match="shuffle must be a bool"):
        ElasticSampler(indexed(5), shuffle=1)  # type: ignore[arg-type]


# -- errors ----------------------------------------------------------------------------


@pytest.mark.parametrize("kwarg", ["sampler", "batch_sampler"])
def test_custom_sampler_is_refused(kwarg: str) -> None:
    with pytest.raises(ValueError, match=f"custom {kwarg}"):
        AdaptiveDataLoader(indexed(4), batch_size=2, **{kwarg: [0, 1]})


def test_iterable_dataset_is_refused() -> None:
    with pytest.raises(ValueError, match="map-style"):
        AdaptiveDataLoader(Stream(), batch_size=2)


@pytest.mark.parametrize("bad", [0, -1, 2.0, True])
def test_bad_batch_size_is_refused(bad: Any) -> None:
    with pytest.raises(ValueError, match="batch_size"):
        AdaptiveDataLoader(indexed(4), batch_size=bad)


def test_two_loops_at_once_is_an_error() -> None:
    a = AdaptiveDataLoader(indexed(4), batch_size=2)
    b = AdaptiveDataLoader(indexed(4), batch_size=2)
    for _ in adl.remaining_epochs_until(1):
        outer = iter(a)
        next(outer)
        with pytest.raises(RuntimeError, match="only one dataloader loop"):
            next(iter(b))
        outer.close()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((4,), "max_batch_size"),
        ((16, (0, 8)), "min must be None or an int >= 1"),
        ((16, (9, 8)), "min <= max"),
        ((16, (10, 12)), "min must be <= batch_size"),
        ((16, (1, 4)), "max must be >= batch_size"),
        ((16, (1, 2, 3)), "pair"),
    ],
)
def test_invalid_autoscale_bounds_are_value_errors(args: tuple[Any, ...], message: str) -> None:
    loader = AdaptiveDataLoader(indexed(4), batch_size=8)
    with pytest.raises(ValueError, match=message):
        loader.autoscale_batch_size(*args)


# -- loops -------------------------------------------------------------------------------


@pytest.mark.parametrize("shuffle", [False, True])
def test_each_epoch_yields_every_sample_once(shuffle: bool) -> None:
    loader = AdaptiveDataLoader(indexed(23), batch_size=4, shuffle=shuffle)
    orders = [consume(loader) for _ in adl.remaining_epochs_until(2)]
    for order in orders:
        assert sorted(order) == list(range(23))
    assert (orders[0] == list(range(23))) is not shuffle
    assert adl.finished_epochs() == 2


@pytest.mark.parametrize(("drop_last", "expected"), [(False, 6), (True, 5)])
def test_len_counts_the_batches_of_a_pass(drop_last: bool, expected: int) -> None:
    loader = AdaptiveDataLoader(indexed(23), batch_size=4, drop_last=drop_last)
    assert len(loader) == expected
    for _ in adl.remaining_epochs_until(1):
        assert len(list(loader)) == expected  # a drop_last pass ends the loop too


def test_workers_yield_the_same_samples_and_get_distinct_deterministic_seeds() -> None:
    def run() -> list[tuple[int, int, int, float]]:
        loader = AdaptiveDataLoader(SeedReport(), batch_size=3, shuffle=True, num_workers=2)
        rows: list[tuple[int, int, int, float]] = []
        for _ in adl.remaining_epochs_until(2):
            for i, seed, worker, draw in loader:
                rows += zip(i.tolist(), seed.tolist(), worker.tolist(), draw.tolist(), strict=True)
        return rows

    first = run()
    _context._reset()
    second = run()
    assert first == second  # deterministic, numpy included
    assert sorted(r[0] for r in first[:12]) == list(range(12))
    seeds = {(r[1], r[2]) for r in first}
    by_seed = {s for s, _ in seeds}
    assert len(by_seed) == len(seeds) == 4  # 2 workers x 2 epochs, all distinct
    assert all(w in (0, 1) for _, w in seeds)


def test_current_dataloader_and_properties_inside_a_loop(writer: Any) -> None:
    loader = AdaptiveDataLoader(indexed(8), batch_size=4)
    assert current_dataloader() is None and adl.current_epoch() is None
    for epoch in adl.remaining_epochs_until(1):
        assert adl.current_epoch() == epoch == 0
        for _ in loader:
            helper = current_dataloader()
            assert isinstance(helper, AdaptiveDataLoaderHelper)
            assert helper is loader._elastic
            assert helper.current_index in (0, 4)
    assert current_dataloader() is None
    assert loader.current_local_bsz == 4 and loader.accumulation_steps == 0
    assert loader.current_batch_size == 4 and not loader.training
    loader.train()
    assert loader.training
    loader.to_tensorboard(writer, 7, "train")
    assert writer.scalars["train/Data/total_batch_size"] == (4.0, 7)
    assert writer.scalars["train/Data/accumulation_steps"] == (0.0, 7)


def test_to_tensorboard_with_a_real_summary_writer(tmp_path: Path) -> None:
    tensorboard = pytest.importorskip("torch.utils.tensorboard")
    loader = AdaptiveDataLoader(indexed(8), batch_size=4)
    with tensorboard.SummaryWriter(str(tmp_path)) as w:
        loader.to_tensorboard(w, 0)
    assert any(tmp_path.iterdir())


def test_autoscale_with_accumulation_splits_into_micro_batches() -> None:
    loader = AdaptiveDataLoader(indexed(64), batch_size=16)
    loader.autoscale_batch_size(64, (2, 16), gradient_accumulation=True)
    # What the goodput engine may decide once it has a model: micro-batches of 4.
    _context.current_job().batch_size_decision = lambda query: (4, 3)
    assert loader.training
    sizes = []
    for _ in adl.remaining_epochs_until(1):
        for batch in loader:
            sizes.append(len(batch[0]))
            helper = current_dataloader()
            assert helper is not None
            assert helper.is_optim_step() == (len(sizes) % 4 == 0)
            # Progress stops an adaptive loop: add one unit per optimiser step.
            if helper.is_optim_step():
                helper.job.metrics.add_progress(1.0)
    assert loader.current_local_bsz == 4 and loader.accumulation_steps == 3
    assert set(sizes) == {4} and len(sizes) == 16


def test_mixin_gives_a_custom_loader_the_helper() -> None:
    class Custom(AdaptiveDataLoaderMixin):
        pass

    custom = Custom(8)
    custom.autoscale_batch_size(32, (1, 16))
    assert custom.training and custom._elastic.max_batch_size == 32


def test_exactly_once_across_a_restart_in_one_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ADAPTDL_CHECKPOINT_PATH", str(tmp_path / "ckpt"))
    seen: dict[int, list[int]] = {}

    def train(stop_after: int | None) -> None:
        adl.init_process_group("gloo")
        job = _context.current_job()
        loader = AdaptiveDataLoader(indexed(30), batch_size=4, shuffle=True, num_workers=1)
        steps = 0
        for epoch in adl.remaining_epochs_until(3):
            for batch in loader:
                seen.setdefault(epoch, []).extend(batch[0].tolist())
                steps += 1
                if steps == stop_after:
                    job.request_stop()  # what the SIGTERM handler does

    with pytest.raises(Preempted) as stopped:
        train(stop_after=10)
    assert stopped.value.code == 143
    _context._reset()
    train(stop_after=None)
    for epoch in range(3):
        assert sorted(seen[epoch]) == list(range(30)), epoch


def test_random_state_in_workers_does_not_leak_into_the_main_process() -> None:
    random.seed(3)
    expected = random.random()
    random.seed(3)
    loader = AdaptiveDataLoader(SeedReport(), batch_size=4, num_workers=1)
    for _ in adl.remaining_epochs_until(1):
        consume(loader)
    assert random.random() == expected


def test_helper_gives_fine_grained_control_of_a_custom_loop() -> None:
    helper = AdaptiveDataLoaderHelper(batch_size=4)
    steps = []
    for _ in adl.remaining_epochs_until(1):
        with helper.context():
            assert not helper.skipdone()
            assert current_dataloader() is helper
            helper.end_index = 12
            while helper.current_index < helper.end_index:
                with helper.profile(commit=False):
                    steps.append(helper.current_index)
                helper.current_index += 4
    assert steps == [0, 4, 8]
    assert helper.current_index is None and helper.end_index == 12


class WorkerPid(Dataset[Any]):
    """Sample ``i`` with the process id of the worker that read it."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[int, int]:
        return i, os.getpid()


@pytest.mark.parametrize("persistent", [False, True])
def test_a_batch_size_change_mid_pass_keeps_the_workers_and_every_sample_once(
    persistent: bool,
) -> None:
    n = 120
    loader = AdaptiveDataLoader(
        WorkerPid(n), batch_size=4, shuffle=True, num_workers=2, persistent_workers=persistent
    )
    loader.autoscale_batch_size(64, (1, 16))
    job = _context.current_job()
    choices = iter([(4, 0), (6, 0), (3, 0), (5, 0)] * 100)
    job.batch_size_decision = lambda query: next(choices)
    # Re-decide at every optimiser step (the schedule's first decision is 1 s away).
    job.redecide_schedule = RedecideSchedule(first_seconds=1e-9, max_seconds=1e-9)
    job._next_redecide = 0.0
    passes: dict[tuple[int, int], list[int]] = {}
    pids: dict[tuple[int, int], set[int]] = {}
    sizes: dict[tuple[int, int], list[int]] = {}
    iterators = set()
    for epoch in adl.remaining_epochs_until(2):
        for batch in loader:
            helper = current_dataloader()
            assert helper is not None
            p = (epoch, (helper.current_index or 0) // n)
            passes.setdefault(p, []).extend(batch[0].tolist())
            pids.setdefault(p, set()).update(batch[1].tolist())
            sizes.setdefault(p, []).append(len(batch[0]))
            iterators.add(id(loader._iterator) if persistent else None)
            if helper.is_optim_step():
                job.metrics.add_progress(1.0)
    complete = [p for p in passes if len(passes[p]) >= n]
    assert complete, passes
    for p in complete:
        assert sorted(passes[p]) == list(range(n)), p  # every sample once
        assert len(set(sizes[p][:-1])) > 1, sizes[p]  # the size changed inside the pass
        assert len(pids[p]) == 2, pids  # read by the same two workers throughout
    if persistent:  # and by the same two across passes
        assert len(set().union(*pids.values())) == 2 and len(iterators) == 1


def test_in_order_false_is_refused() -> None:
    with pytest.raises(ValueError, match="in_order=True"):
        AdaptiveDataLoader(indexed(8), batch_size=4, num_workers=1, in_order=False)


def _collect_garbage(worker_id: int) -> None:
    """A worker_init_fn that runs a full garbage collection in the worker."""
    gc.collect()


class _Cell:
    """A weakly referable holder, to see when a cycle is freed."""

    group: Any
    self: Any


@pytest.mark.timeout(120)  # the fault may hang, in an unpickling that has no timeout
@pytest.mark.parametrize("set_after", [False, True])
@pytest.mark.parametrize("program_froze", [False, True])
@pytest.mark.parametrize("persistent", [False, True])
def test_workers_never_collect_a_dead_process_group_of_the_training_process(
    persistent: bool, program_froze: bool, set_after: bool
) -> None:
    """A destroyed process group left in a reference cycle is garbage the training
    process has not collected yet. A forked worker that collected it would run its
    destructor, which waits for threads that exist only in the training process: the
    worker would hang holding the GIL (CI once hung 600 s so, in a test after FSDP's)
    or abort. Also where the program froze objects itself, or set the loader's
    worker_init_fn after making it."""
    adl.init_process_group("gloo")
    if program_froze:
        gc.freeze()
    gc.disable()  # no collection here until the end: every worker forks with the garbage
    try:
        cell = _Cell()
        cell.group = torch.distributed.new_group([0], backend="gloo")
        cell.self = cell
        torch.distributed.destroy_process_group(cell.group)
        garbage = weakref.ref(cell)
        del cell
        loader = adl.AdaptiveDataLoader(
            TensorDataset(torch.arange(12)),
            batch_size=4,
            num_workers=2,
            persistent_workers=persistent,
            multiprocessing_context="fork",
            worker_init_fn=None if set_after else _collect_garbage,
        )
        if set_after:
            loader.worker_init_fn = _collect_garbage
        for _ in adl.remaining_epochs_until(2):
            assert sorted(int(i) for (batch,) in loader for i in batch) == list(range(12))
        assert garbage() is not None  # still garbage in this process: the workers had it
        gc.collect()
        assert garbage() is None  # and collected here, where the group's threads are
    finally:
        gc.enable()
        gc.unfreeze()


@pytest.mark.parametrize("collector", ["enabled", "disabled", "frozen"])
def test_forking_the_workers_leaves_the_training_process_collector_as_it_was(
    collector: str,
) -> None:
    """After the workers fork, the training process's collector runs as before (or
    stays off, if the program turned it off), nothing it froze is unfrozen and
    nothing is frozen."""
    loader = adl.AdaptiveDataLoader(TensorDataset(torch.arange(8)), batch_size=4, num_workers=1)
    if collector == "frozen":
        gc.freeze()
    if collector == "disabled":
        gc.disable()
    frozen = gc.get_freeze_count()
    try:
        for _ in adl.remaining_epochs_until(1):
            for _batch in loader:
                assert gc.get_freeze_count() == frozen
                assert gc.isenabled() == (collector != "disabled")
    finally:
        gc.unfreeze()
        gc.enable()
    assert (frozen > 0) == (collector == "frozen")


def _collects_its_own_cycle(worker_id: int) -> None:
    """A worker_init_fn that fails the worker unless inherited objects are frozen and
    the collector runs and frees a cycle the worker made."""
    cell = _Cell()
    cell.self = cell
    made = weakref.ref(cell)
    del cell
    gc.collect()
    if not gc.isenabled() or gc.get_freeze_count() == 0 or made() is not None:
        raise RuntimeError(f"worker collector on {gc.isenabled()}, frozen {gc.get_freeze_count()}")


def test_a_worker_collects_a_cycle_of_its_own() -> None:
    loader = adl.AdaptiveDataLoader(
        TensorDataset(torch.arange(8)),
        batch_size=4,
        num_workers=1,
        multiprocessing_context="fork",
        worker_init_fn=_collects_its_own_cycle,
    )
    for _ in adl.remaining_epochs_until(1):
        assert sum(len(batch) for (batch,) in loader) == 8


@pytest.mark.parametrize("collector_was_on", [True, False])
def test_a_process_forked_in_the_window_freezes_what_it_inherited(collector_was_on: bool) -> None:
    """The collector is off in the window; a child forked there starts with the
    inherited objects frozen and the collector as it was before the window; a child
    forked outside it is left alone. Real forks."""

    def fork_and_check(expect_frozen: bool, expect_on: bool) -> None:
        pid = os.fork()
        if pid == 0:  # the child: report through the exit status only
            frozen = gc.get_freeze_count() > 0
            os._exit(0 if (frozen, gc.isenabled()) == (expect_frozen, expect_on) else 1)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0

    if not collector_was_on:
        gc.disable()
    try:
        with WINDOW.forking():
            assert not gc.isenabled()
            fork_and_check(expect_frozen=True, expect_on=collector_was_on)
        assert gc.isenabled() == collector_was_on
        fork_and_check(expect_frozen=False, expect_on=collector_was_on)
    finally:
        gc.enable()
