"""adaptdl.torch._metrics as programs read it; adaptdl.torch.iterator without torchtext."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from torch.utils.data import TensorDataset

import adaptdl.torch as adl
import torch
from adaptdl.torch import _context, _metrics
from adaptdl.torch.iterator import BPTTWindows


def test_before_training_there_are_no_gradient_statistics() -> None:
    state = _metrics._metrics_state()
    assert state.grad_params is None
    assert state.progress == 0.0 == _metrics.get_progress()
    assert state.perf_params is None and _metrics.get_goodput_fn() is None
    assert state.init_batch_size is None and state.max_batch_size is None
    assert state.local_bsz_bounds is None and state.gradient_accumulation is False


def test_after_training_the_view_reads_the_jobs_metrics() -> None:
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(64, 3), torch.randn(64, 1))
    loader = adl.AdaptiveDataLoader(data, batch_size=8)
    loader.autoscale_batch_size(32, local_bsz_bounds=(4, 16), gradient_accumulation=True)
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    dp = adl.AdaptiveDataParallel(model, optimizer)
    for _ in adl.remaining_epochs_until(1):
        for x, y in loader:
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(dp(x), y).backward()
            optimizer.step()
    state = _metrics._metrics_state()
    job = _context.current_job()
    params = job.metrics.grad_params()
    assert params is not None
    assert state.grad_params == (params.sqr, params.var)
    assert state.grad_params[0] >= 0 and state.grad_params[1] >= 0
    assert state.progress == job.metrics.progress == _metrics.get_progress() > 0
    assert (state.init_batch_size, state.max_batch_size) == (8, 32)
    assert state.local_bsz_bounds == (4, 16) and state.gradient_accumulation is True


def test_the_original_bptt_iterator_is_an_import_error_naming_its_replacement() -> None:
    with pytest.raises(ImportError, match="BPTTWindows"):
        from adaptdl.torch.iterator import AdaptiveBPTTIterator  # noqa: F401
    with pytest.raises(AttributeError):
        _ = adl.iterator.no_such_name  # type: ignore[attr-defined]


@given(n=st.integers(2, 200), bptt=st.integers(1, 40))
def test_windows_tile_the_sequence_with_targets_one_token_ahead(n: int, bptt: int) -> None:
    tokens = torch.arange(n)
    if n < bptt + 1:
        with pytest.raises(ValueError, match="no window fits"):
            BPTTWindows(tokens, bptt)
        return
    windows = BPTTWindows(tokens, bptt)
    assert len(windows) == (n - 1) // bptt
    for i in range(len(windows)):
        x, y = windows[i]
        assert x.tolist() == list(range(i * bptt, (i + 1) * bptt))
        assert y.tolist() == [t + 1 for t in x.tolist()]
    with pytest.raises(IndexError):
        windows[len(windows)]


@pytest.mark.parametrize(
    ("tokens", "bptt", "match"),
    [
        (torch.zeros(3, 3), 1, "1-D tensor"),
        ([1, 2, 3], 1, "1-D tensor"),
        (torch.arange(10), 0, "bptt_len must be an int >= 1"),
        (torch.arange(10), True, "bptt_len must be an int >= 1"),
    ],
)
def test_bad_windows_are_refused(tokens: object, bptt: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        BPTTWindows(tokens, bptt)  # type: ignore[arg-type]


def test_windows_feed_an_adaptive_loader() -> None:
    loader = adl.AdaptiveDataLoader(BPTTWindows(torch.arange(101), 10), batch_size=4)
    seen = []
    for _ in adl.remaining_epochs_until(1):
        for x, y in loader:
            assert x.shape[1] == 10 and torch.equal(y, x + 1)
            seen += x[:, 0].tolist()
    assert sorted(seen) == list(range(0, 100, 10))
