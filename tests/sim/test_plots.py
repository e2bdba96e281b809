"""Which jobs the per-job figures show."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from adaptdl.sim.metrics import JobResult, SimResult
from adaptdl.sim.plots import top_jobs

END = 1000.0


def _job(i: int, submit: float, length: float | None) -> JobResult:
    finish = None if length is None else submit + length
    return JobResult(f"job-{i}", "app", submit, finish, 0, 0, 0.0, 0.0, ())


def _result(jobs: list[JobResult]) -> SimResult:
    return SimResult("fifo", tuple(jobs), (), 4, END, 1)


def _length(job: JobResult) -> float:
    return (job.finish if job.finish is not None else END) - job.submit


@given(
    st.lists(
        st.tuples(st.floats(0.0, 500.0), st.one_of(st.none(), st.floats(0.0, 500.0))),
        max_size=30,
    ),
    st.integers(1, 12),
)
def test_top_jobs_are_the_longest(specs: list[tuple[float, float | None]], count: int) -> None:
    jobs = [_job(i, submit, length) for i, (submit, length) in enumerate(specs)]
    top = top_jobs(_result(jobs), count)
    assert len(top) == min(count, len(jobs))
    assert len({j.name for j in top}) == len(top)
    lengths = [_length(j) for j in top]
    assert lengths == sorted(lengths, reverse=True)
    rest = [j for j in jobs if j not in top]
    if top and rest:
        assert min(lengths) >= max(_length(j) for j in rest)


def test_an_unfinished_job_counts_as_running_until_the_end() -> None:
    jobs = [_job(0, 0.0, 900.0), _job(1, 50.0, None), _job(2, 0.0, 10.0)]
    assert [j.name for j in top_jobs(_result(jobs), 2)] == ["job-1", "job-0"]


@pytest.mark.parametrize("count", [0, -1, 2.5, True])
def test_top_jobs_rejects_a_bad_count(count: object) -> None:
    with pytest.raises(ValueError, match="count"):
        top_jobs(_result([]), count)  # type: ignore[arg-type]
