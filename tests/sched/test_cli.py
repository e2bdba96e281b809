"""``adaptdl``'s bad input: one line naming the problem, exit status 2, nothing started."""

from __future__ import annotations

import pytest

from adaptdl.sched.cli import main


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["submit", "--min-replicas", "3", "--max-replicas", "2", "--", "true"],
            "min_replicas=3 is above max_replicas=2",
        ),
        (["submit", "--name", "x"], "no command"),
        (["submit", "--"], "no command"),
        (["submit", "--name", "Not_A_Name", "--", "true"], "job name 'Not_A_Name'"),
        (["submit", "--env", "NOVALUE", "--", "true"], "--env 'NOVALUE': expected K=V"),
        (["submit", "--cpus-per-replica", "0", "--", "true"], "cpus_per_replica"),
        (["submit", "--max-replicas", "two", "--", "true"], "invalid int value: 'two'"),
        (["scheduler", "start", "--policy", "optimus"], "--policy 'optimus'"),
        (["scheduler", "start", "--interval", "0"], "--interval 0.0: must be above 0"),
        (["wait"], "the following arguments are required: names"),
        (["frobnicate"], "invalid choice: 'frobnicate'"),
    ],
)
def test_bad_input_is_one_line_and_status_2(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.count("\n") == 1 and err.startswith("adaptdl: error: ")
    assert message in err
