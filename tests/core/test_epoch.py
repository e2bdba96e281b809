"""Epoch loops: replay skips finished epochs; nesting is an error."""

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from adaptdl.core.loop.epoch import EpochState


def test_counts_epochs():
    state = EpochState()
    seen = []
    for epoch in state.remaining_epochs_until(3):
        assert state.current_epoch == epoch
        seen.append(epoch)
    assert seen == [0, 1, 2]
    assert state.finished_epochs == 3 and state.current_epoch is None


@given(total=st.integers(0, 30), interrupt=st.integers(0, 30))
def test_replay_skips_finished_epochs(total, interrupt):
    state = EpochState()
    for epoch in state.remaining_epochs_until(total):
        if epoch == interrupt:
            break  # the process dies inside this epoch
    saved = state.to_bytes()
    restored = EpochState()
    restored.from_bytes(saved)
    resumed = list(restored.remaining_epochs_until(total))
    assert resumed == list(range(min(interrupt, total), total))


def test_sequential_loops_replay_in_order():
    state = EpochState()
    list(state.remaining_epochs_until(2))
    for epoch in state.remaining_epochs_until(5):
        if epoch == 3:
            break
    restored = EpochState()
    restored.from_bytes(state.to_bytes())
    assert list(restored.remaining_epochs_until(2)) == []
    assert list(restored.remaining_epochs_until(5)) == [3, 4]


def test_nested_loop_raises():
    state = EpochState()
    for _ in state.remaining_epochs_until(2):
        with pytest.raises(RuntimeError, match="nested"):
            state.remaining_epochs_until(3)
        break


@pytest.mark.parametrize("bad", [-1, 1.5, "3", True])
def test_bad_epoch_count(bad):
    with pytest.raises(ValueError, match="epoch"):
        EpochState().remaining_epochs_until(bad)


def test_state_is_json():
    state = EpochState()
    list(state.remaining_epochs_until(4))
    assert json.loads(state.to_bytes()) == {"finished_epochs": 4}


# -- a framework's trainer (Lightning) that counts epochs too ------------------------------

counts = st.integers(0, 40)


@given(job=counts, framework=counts, restored=st.booleans())
def test_the_framework_count_wins_unless_the_job_restored_its_own(
    job: int, framework: int, restored: bool
) -> None:
    state = EpochState()
    state.finished_epochs = job
    if restored and job > framework:
        # The job's checkpoint holds the framework's state: it cannot count fewer.
        with pytest.raises(RuntimeError, match=f"runs epoch {framework} but .* is {job}"):
            state.settle_framework_count(framework, restored=restored)
        return
    state.settle_framework_count(framework, restored=restored)
    assert state.finished_epochs == (job if restored else framework)
    # Then the job's loop catches up to the framework's epoch, finishing those between.
    start = state.finished_epochs
    loop = state.remaining_epochs_until(framework + 1)
    taken = []
    while state.advances_to(framework):
        taken.append(next(loop))
    assert taken == list(range(start, framework + 1))
    assert state.current_epoch == framework
    assert state.finished_epochs == framework  # every epoch before it finished
    loop.close()


@given(finished=counts, current=st.one_of(st.none(), counts), framework=counts)
def test_the_loop_advances_only_towards_the_frameworks_epoch(
    finished: int, current: int | None, framework: int
) -> None:
    state = EpochState()
    state.finished_epochs = finished
    state.current_epoch = current
    upcoming = finished if current is None else current + 1
    if current == framework:
        assert state.advances_to(framework) is False
    elif upcoming <= framework:
        assert state.advances_to(framework) is True
    else:
        with pytest.raises(RuntimeError, match="disagree"):
            state.advances_to(framework)


def test_the_count_is_settled_outside_the_loop_and_for_real_counts() -> None:
    state = EpochState()
    with pytest.raises(ValueError, match="framework_epoch"):
        state.settle_framework_count(-1, restored=False)
    with pytest.raises(ValueError, match="framework_epoch"):
        state.advances_to(-1)
    loop = state.remaining_epochs_until(3)
    next(loop)
    with pytest.raises(RuntimeError, match="inside the loop of epoch 0"):
        state.settle_framework_count(1, restored=False)
    loop.close()
