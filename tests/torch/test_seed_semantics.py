"""The seed's semantics, each fault reproduced in one process: restarts, accumulators, models.

A restart is simulated as the tests of test_torch_data do: the program runs until
``request_stop`` (what SIGTERM does) makes it checkpoint and raise `Preempted`, the
default job is reset, and the same program runs again from the top.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from torch.utils.data import TensorDataset

import adaptdl.torch as adl
import torch
from adaptdl.core.loop.boundary import Preempted
from adaptdl.core.persist.checkpoint import CheckpointStore
from adaptdl.core.persist.localfs import LocalStorage
from adaptdl.torch import _context
from adaptdl.torch.data import AdaptiveDataLoader, ElasticSampler

N = 12


def indexed(n: int = N) -> TensorDataset:
    return TensorDataset(torch.arange(n), torch.randn(n, 3, generator=torch.Generator()))


def restarted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, program: Callable[[int | None], Any]
) -> Any:
    """What ``program(None)`` returns when rerun after ``program(1)`` was stopped.

    ``program(stop)`` asks for a stop where the program says when ``stop`` is set.
    """
    _context._reset()
    monkeypatch.setenv("ADAPTDL_CHECKPOINT_PATH", str(tmp_path / "ckpt"))
    with pytest.raises(Preempted):
        program(1)
    _context._reset()
    return program(None)


def uninterrupted(program: Callable[[int | None], Any]) -> Any:
    _context._reset()
    return program(None)


# --------------------------------------------------------------------------- accumulators


def _validation_program(stop_epoch: int) -> Callable[[int | None], list[float]]:
    """Train then validate each epoch with a per-epoch Accumulator, as the seed tutorial."""

    def program(stop: int | None) -> list[float]:
        adl.init_process_group("gloo")
        job = _context.current_job()
        train = AdaptiveDataLoader(indexed(), batch_size=4)
        valid = AdaptiveDataLoader(indexed(), batch_size=4)
        totals: list[float] = []
        for epoch in adl.remaining_epochs_until(3):
            for _ in train:
                if stop is not None and epoch == stop_epoch:
                    job.request_stop()
            stats = adl.Accumulator()
            for batch in valid:
                stats["seen"] += len(batch[0])
            with stats.synchronized():
                totals.append(stats["seen"])
        return totals

    return program


def test_a_per_epoch_accumulator_starts_afresh_after_a_restart(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Fault: named by global creation order, the accumulator of the epoch that
    # resumed took the checkpointed totals of epoch 0's: its validation total doubled.
    resumed = restarted(tmp_path, monkeypatch, _validation_program(stop_epoch=1))
    assert resumed == [N, N]  # epochs 1 and 2, each once over the validation set


def test_finished_epochs_accumulators_leave_the_checkpoints(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ADAPTDL_CHECKPOINT_PATH", str(tmp_path / "ckpt"))
    with pytest.raises(Preempted):
        _validation_program(stop_epoch=2)(1)
    saved = CheckpointStore(LocalStorage(tmp_path / "ckpt")).load()
    assert saved is not None
    assert [n for n in saved.entries if "accumulator" in n] == []  # epochs 0, 1 finished
    _context._reset()
    assert _validation_program(stop_epoch=2)(None) == [N]
    # The final checkpoint (training finished) holds no epoch's accumulator either.
    names = [s.name for s in _context.current_job().states() if "accumulator" in s.name]
    assert names == []
    final = CheckpointStore(LocalStorage(tmp_path / "ckpt")).load()
    assert final is not None and final.label != saved.label
    assert [n for n in final.entries if "accumulator" in n] == []


def test_contributions_replayed_outside_loops_count_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Fault: the job never marked the replay, so code re-run before the interrupted
    # loop added its contributions a second time.
    def program(stop: int | None) -> dict[str, Any]:
        adl.init_process_group("gloo")
        job = _context.current_job()
        loader = AdaptiveDataLoader(indexed(), batch_size=4)
        stats = adl.Accumulator()
        for epoch in adl.remaining_epochs_until(2):
            stats["epochs started"] += 1
            stats += {"outside": 2, "twice": 1}
            stats -= {"twice": -1}
            for _ in loader:
                stats["batches"] += 1
                if stop is not None and epoch == 1:
                    job.request_stop()
        with stats.synchronized():
            return dict(stats)

    expected = {"epochs started": 2, "outside": 4, "twice": 4, "batches": 6}
    assert uninterrupted(program) == expected
    resumed = restarted(tmp_path, monkeypatch, program)
    assert resumed == expected


def test_accumulator_reads_outside_synchronized_see_an_empty_mapping() -> None:
    stats = adl.Accumulator({"x": 1})
    stats["x"] += 1
    assert len(stats) == 0 and "x" not in stats and dict(stats) == {} and stats.get("x") is None
    with stats.synchronized():
        assert dict(stats) == {"x": 2}


def test_an_accumulator_made_inside_a_loop_is_refused() -> None:
    loader = AdaptiveDataLoader(indexed(), batch_size=4)
    for _ in adl.remaining_epochs_until(1):
        for _ in loader:
            with pytest.raises(RuntimeError, match="before the loop"):
                adl.Accumulator()


# --------------------------------------------------------------------------- loops


def test_a_test_pass_after_the_epoch_loop_resumes_exactly_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Fault: iterating after the epoch loop (the seed's transformer example) raised.
    def program(stop: int | None) -> list[list[int]]:
        adl.init_process_group("gloo")
        job = _context.current_job()
        train = AdaptiveDataLoader(indexed(), batch_size=4, shuffle=True)
        test = AdaptiveDataLoader(indexed(), batch_size=2, shuffle=True)
        seen: list[list[int]] = []
        for _ in adl.remaining_epochs_until(2):
            for _ in train:
                pass
            for _batch in test:  # validation inside the epochs, then a test pass after
                pass
        for batch in test:
            seen.append(batch[0].tolist())
            if stop is not None and len(seen) == 2:
                job.request_stop()
        return seen

    whole = uninterrupted(program)
    assert sorted(i for b in whole for i in b) == list(range(N))
    resumed = restarted(tmp_path, monkeypatch, program)
    assert resumed == whole[3:]


def test_init_process_group_after_a_loader_is_accepted() -> None:
    # Fault: the loader initialised the job and the tutorial's explicit call raised.
    loader = AdaptiveDataLoader(indexed(), batch_size=4)
    loader.autoscale_batch_size(8, local_bsz_bounds=(2, 8))
    adl.init_process_group("gloo")
    assert adl.is_initialized()
    with pytest.raises(RuntimeError, match="already called"):
        adl.init_process_group("gloo")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"backend": "nccl"}, "backend='nccl'"),
        ({"backend": "gloo", "init_method": "tcp://127.0.0.1:1"}, "init_method"),
    ],
)
def test_init_process_group_after_a_loader_refuses_other_settings(
    kwargs: dict[str, Any], match: str
) -> None:
    AdaptiveDataLoader(indexed(), batch_size=4)
    with pytest.raises(RuntimeError, match=match) as info:
        adl.init_process_group(**kwargs)
    assert "before making adaptdl.torch objects" in str(info.value)


def test_sampler_num_replicas_and_rank_take_effect_when_assigned() -> None:
    # Fault: the sampler had no such attributes; assigning them did nothing.
    sampler = ElasticSampler(indexed(10), shuffle=False)
    assert (sampler.num_replicas, sampler.rank) == (1, 0)
    sampler.num_replicas, sampler.rank = 3, 1
    assert list(sampler) == [1, 4, 7, 0] and len(sampler) == 4  # one padding sample
    sampler.rank = 3
    with pytest.raises(ValueError, match=r"rank must be in \[0, 2\]"):
        list(sampler)
    with pytest.raises(ValueError, match="num_replicas must be an int >= 1"):
        sampler.num_replicas = 0
    assert list(ElasticSampler(indexed(4), shuffle=False, num_replicas=2, rank=1)) == [1, 3]


def test_a_loader_whose_sampler_was_reassigned_refuses_to_iterate() -> None:
    loader = AdaptiveDataLoader(indexed(), batch_size=4)
    loader.sampler.num_replicas = 2  # type: ignore[attr-defined]
    for _ in adl.remaining_epochs_until(1):
        with pytest.raises(ValueError, match="reads the job's share"):
            next(iter(loader))


# --------------------------------------------------------------------------- models


def _model(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Linear(3, 1)
    return model, torch.optim.SGD(model.parameters(), lr=0.01)


def test_mp_scaler_given_a_name_positionally_is_a_type_error() -> None:
    # Fault: the seed's DCGAN passes its name fourth, where mp_scaler goes; it failed
    # deep inside with an AttributeError.
    model, optimizer = _model()
    with pytest.raises(TypeError, match=r"mp_scaler must be a torch\.amp\.GradScaler") as info:
        adl.AdaptiveDataParallel(model, optimizer, None, "netD")
    assert "name='netD'" in str(info.value)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    adl.AdaptiveDataParallel(model, optimizer, None, scaler, name="netD")


def test_two_models_make_one_step_of_progress_per_batch() -> None:
    # Fault: a GAN's two models both added to the job's progress, so each adaptive
    # epoch ended after half the data.
    dataset = indexed(32)
    loader = AdaptiveDataLoader(dataset, batch_size=4)
    loader.autoscale_batch_size(4, local_bsz_bounds=(4, 4))
    gen, gen_opt = _model(1)
    disc, disc_opt = _model(2)
    netg = adl.AdaptiveDataParallel(gen, gen_opt, name="netG")
    netd = adl.AdaptiveDataParallel(disc, disc_opt, name="netD")
    seen: list[int] = []
    for _ in adl.remaining_epochs_until(1):
        for index, x in loader:
            seen += index.tolist()
            for net, opt in ((netd, disc_opt), (netg, gen_opt)):
                opt.zero_grad()
                net(x).square().mean().backward()
                opt.step()
    assert sorted(seen) == list(range(32))
    assert netd.progress == pytest.approx(8.0) and netg.gain == 1.0


# --------------------------------------------------------------------------- interop


def test_loader_state_dict_resumes_the_next_iteration_exactly_once() -> None:
    loader = AdaptiveDataLoader(indexed(), batch_size=4, shuffle=True)
    before: list[int] = []
    state: dict[str, Any] = {}
    for _ in adl.remaining_epochs_until(1):
        for batch in loader:
            before += batch[0].tolist()
            state = json.loads(json.dumps(loader.state_dict()))  # JSON-safe
            if len(before) == 8:
                break
    # Another process holding only that dict, e.g. restored by torch.distributed.checkpoint.
    _context._reset()
    again = AdaptiveDataLoader(indexed(), batch_size=4, shuffle=True)
    again.load_state_dict(state)
    after = [i for batch in again for i in batch[0].tolist()]  # outside epoch loops, too
    assert sorted(before + after) == list(range(N)) and len(after) == 4
    assert again.state_dict()["index"] == 0
    with pytest.raises(ValueError, match="made by state_dict"):
        again.load_state_dict({"index": 1})


class Counter:
    """A user object with the state_dict protocol."""

    def __init__(self) -> None:
        self.count = 0
        self.extra: Any = None

    def state_dict(self) -> dict[str, Any]:
        return {
            "count": self.count,
            "weights": torch.full((2,), float(self.count)),
            "x": self.extra,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.count = state["count"]
        assert torch.equal(state["weights"], torch.full((2,), float(self.count)))


def test_a_registered_object_is_saved_and_restored_with_the_job(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def program(stop: int | None) -> int:
        adl.init_process_group("gloo")
        job = _context.current_job()
        counter = Counter()
        adl.register_state("my-counter", counter)
        loader = AdaptiveDataLoader(indexed(), batch_size=4)
        for _ in adl.remaining_epochs_until(2):
            for _ in loader:
                counter.count += 1
                if stop is not None and counter.count == 4:
                    job.request_stop()
        return counter.count

    resumed = restarted(tmp_path, monkeypatch, program)
    assert resumed == 6
    with pytest.raises(ValueError, match="already registered"):
        adl.register_state("my-counter", Counter())
    with pytest.raises(TypeError, match="load_state_dict"):
        adl.register_state("other", object())  # type: ignore[arg-type]


def test_a_registered_state_that_would_need_pickle_fails_when_saved(tmp_path: Path) -> None:
    counter = Counter()
    counter.extra = {"fn": print}
    adl.register_state("bad", counter)
    with pytest.raises(TypeError, match=r"bad: state.state_dict\(\)\['x'\]\['fn'\] holds"):
        _context.current_job().checkpoint()


def test_random_states_resume_where_the_stopped_run_left_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def program(stop: int | None) -> list[tuple[float, float, float]]:
        adl.init_process_group("gloo")
        job = _context.current_job()
        torch.manual_seed(0)  # the program's own seeding, replayed after a restart
        np.random.seed(0)
        random.seed(0)
        loader = AdaptiveDataLoader(indexed(), batch_size=4)
        draws: list[tuple[float, float, float]] = []
        for _ in adl.remaining_epochs_until(2):
            torch.rand(1)  # replayed code may draw: the restore comes after it
            for _ in loader:
                draws.append((torch.rand(1).item(), np.random.rand(), random.random()))
                if stop is not None and len(draws) == 4:
                    job.request_stop()
        return draws

    whole = uninterrupted(program)
    resumed = restarted(tmp_path, monkeypatch, program)
    assert resumed == whole[5:]


def test_init_process_group_takes_the_seeds_positional_parameters() -> None:
    # Fault: init_method was keyword-only and world_size/rank did not exist, so the
    # seed's init_process_group("gloo", None, 1, 0) raised TypeError.
    with pytest.raises(ValueError, match=r"world_size=2.*says 1"):
        adl.init_process_group("gloo", None, 2, 0)
    assert not adl.is_initialized()
    adl.init_process_group("gloo", None, 1, 0)
    assert adl.is_initialized()


def test_init_process_group_after_a_loader_checks_world_size_and_rank() -> None:
    AdaptiveDataLoader(indexed(), batch_size=4)
    with pytest.raises(ValueError, match=r"rank=1\).*says 0"):
        adl.init_process_group("gloo", rank=1)
    adl.init_process_group("gloo", world_size=1, rank=0)
