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
