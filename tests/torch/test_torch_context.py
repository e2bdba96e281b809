"""init_process_group, the default job, SIGTERM, scaling rules and the Accumulator."""

from __future__ import annotations

import math
import os
import signal
from pathlib import Path

import pytest
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import TensorDataset

import adaptdl.torch as adl
import torch
from adaptdl.core.loop.boundary import Preempted
from adaptdl.core.persist.checkpoint import CheckpointError
from adaptdl.core.stats import scaling
from adaptdl.core.stats.gns import GradientNoiseScale
from adaptdl.core.stats.step import decide
from adaptdl.torch import _context, scaling_rules


def test_plain_python_runs_as_one_replica_with_a_gloo_group() -> None:
    adl.init_process_group()
    assert adl.is_initialized() and dist.is_initialized()
    assert dist.get_world_size() == 1 and dist.get_backend() == "gloo"
    job = _context.current_job()
    assert job.topology.num_replicas == 1 and job.store is None


def test_current_job_initialises_lazily_for_one_replica() -> None:
    assert not adl.is_initialized()
    adl.AdaptiveDataLoader(TensorDataset(torch.arange(4)), batch_size=2)
    assert adl.is_initialized()


def test_init_twice_is_an_error() -> None:
    adl.init_process_group()
    with pytest.raises(RuntimeError, match="already called"):
        adl.init_process_group()


def test_unknown_backend_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="backend must be"):
        adl.init_process_group("carrier-pigeon")


def test_several_replicas_without_rendezvous_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(RuntimeError, match="torchrun"):
        adl.init_process_group()
    with pytest.raises(RuntimeError, match="init_process_group"):
        _context.current_job()


def test_unwritable_checkpoint_directory_fails_at_init(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("ADAPTDL_CHECKPOINT_PATH", str(blocker / "ckpt"))
    with pytest.raises(CheckpointError):
        adl.init_process_group()


def test_sigterm_only_requests_a_stop_and_the_next_step_checkpoints(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ADAPTDL_CHECKPOINT_PATH", str(tmp_path))
    adl.init_process_group()
    job = _context.current_job()
    loader = adl.AdaptiveDataLoader(TensorDataset(torch.arange(20)), batch_size=2)
    with pytest.raises(Preempted) as stopped:
        for _ in adl.remaining_epochs_until(1):
            for _ in loader:
                if not job.stop_requested:
                    os.kill(os.getpid(), signal.SIGTERM)
                    assert job.stop_requested  # the handler ran; nothing else happened
    assert stopped.value.code == 143
    assert len(list(tmp_path.glob("ckpt-*"))) == 1


def test_reset_restores_the_previous_sigterm_handler() -> None:
    before = signal.getsignal(signal.SIGTERM)
    adl.init_process_group()
    assert signal.getsignal(signal.SIGTERM) is not before
    _context._reset()
    assert signal.getsignal(signal.SIGTERM) is before and not dist.is_initialized()


def test_epoch_functions_follow_the_job() -> None:
    assert adl.finished_epochs() == 0 and adl.current_epoch() is None
    for epoch in adl.remaining_epochs_until(2):
        assert adl.current_epoch() == epoch
    assert adl.finished_epochs() == 2
    assert list(adl.remaining_epochs_until(3)) == [2]
    with pytest.raises(ValueError, match="epoch"):
        adl.remaining_epochs_until(-1)


# -- scaling rules -----------------------------------------------------------------------


def _gns() -> GradientNoiseScale:
    gns = GradientNoiseScale(init_batch_size=8)
    gns.update([4.0], [1.0], count=4, batch_size=8)
    return gns


@settings(max_examples=50, deadline=None)
@given(batch_size=st.integers(2, 512))
def test_rules_give_the_core_factor(batch_size: int) -> None:
    # The one way to a step's factor: core's decision under the rule's `step_rule`.
    gns = _gns()
    scale = batch_size / gns.init_batch_size
    gain = gns.gain(scale)

    def factor(rule: scaling_rules.ScalingRuleBase) -> float:
        core_rule = rule.step_rule(gns.init_batch_size, scale)
        return decide(gns, 5.0, batch_size, core_rule).lr_factors[0]

    assert factor(scaling_rules.AdaScale()) == pytest.approx(gain)
    assert factor(scaling_rules.AdamScale()) == pytest.approx(math.sqrt(gain))
    assert factor(scaling_rules.LinearScale()) == pytest.approx(scale)
    assert factor(scaling_rules.SqrtScale()) == pytest.approx(math.sqrt(scale))
    legw = scaling_rules.LEGWScale(base_warmup_epochs=1, data_size=64)
    expected = scaling.LEGWScale(1, 64, 8).lr_factor(gain, scale, 5.0)
    assert factor(legw) == pytest.approx(expected)


def test_a_rule_has_no_second_way_to_a_factor() -> None:
    # The original's extension point stays (`scale_lr`); a factor of the rule's own
    # beside core's decision (it had one, unused) does not.
    assert callable(scaling_rules.ScalingRuleBase.scale_lr)
    assert not hasattr(scaling_rules.ScalingRuleBase, "lr_factor")


@pytest.mark.parametrize(("epochs", "size"), [(-1, 10), (1, 0), ("x", 10)])
def test_legw_rejects_bad_arguments(epochs: object, size: object) -> None:
    with pytest.raises(ValueError):
        scaling_rules.LEGWScale(epochs, size)  # type: ignore[arg-type]


# -- Accumulator ---------------------------------------------------------------------


def test_accumulator_sums_and_survives_a_restart(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ADAPTDL_CHECKPOINT_PATH", str(tmp_path))

    def run(stop: bool) -> dict[str, int]:
        adl.init_process_group()
        acc = adl.Accumulator(seen=0)
        loader = adl.AdaptiveDataLoader(TensorDataset(torch.arange(10)), batch_size=2)
        for _ in adl.remaining_epochs_until(1):
            for (batch,) in loader:
                acc["seen"] += len(batch)
                if stop and batch[0] == 4:
                    _context.current_job().request_stop()
        with acc.synchronized():
            return dict(acc)

    with pytest.raises(Preempted):
        run(stop=True)
    _context._reset()
    assert run(stop=False) == {"seen": 10}


def test_a_finished_epoch_loop_leaves_no_reduction_in_flight(fresh_torch_job):
    """remaining_epochs_until drains the last boundary's reduction when it ends normally."""
    import adaptdl.torch as adl
    from adaptdl.torch._context import current_job

    loader = adl.AdaptiveDataLoader(list(range(12)), batch_size=4)
    for _ in adl.remaining_epochs_until(2):
        for _batch in loader:
            pass
    assert current_job()._boundary_future is None


def test_a_failed_restore_lets_go_of_the_checkpoint_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A retry in the same process must not wait on its own lock."""
    from adaptdl.core.persist.localfs import LocalStorage

    monkeypatch.setenv("ADAPTDL_CHECKPOINT_PATH", str(tmp_path))

    def broken(*args: object, **kwargs: object) -> None:
        raise CheckpointError("a restore that fails")

    monkeypatch.setattr(_context, "Job", broken)
    with pytest.raises(CheckpointError, match="a restore that fails"):
        adl.init_process_group("gloo")
    assert _context._locked is None
    other = LocalStorage(tmp_path)
    other.lock(wait=0.0)  # free at once: nobody holds it
    other.unlock()
