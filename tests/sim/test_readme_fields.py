"""The simulator README's field tables match what the code accepts and prints."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import attrs
import pytest

from adaptdl.sim.apps import builtin_applications
from adaptdl.sim.cli import main
from adaptdl.sim.replay import Scenario, TimelineEvent

README = Path(__file__).resolve().parents[2] / "packages" / "adaptdl-sim" / "README.md"


def _tables() -> dict[str, list[list[str]]]:
    """Rows (cells) of every table that follows a ``<!-- fields: NAME -->`` marker."""
    tables: dict[str, list[list[str]]] = {}
    current: str | None = None
    for line in README.read_text(encoding="utf-8").splitlines():
        marker = re.fullmatch(r"<!-- fields: (\S+) -->", line.strip())
        if marker:
            current = marker.group(1)
            assert current not in tables, f"two tables named {current}"
            tables[current] = []
        elif current is not None and line.startswith("|"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if re.fullmatch(r"`\w+`", cells[0]):
                tables[current].append(cells)
        elif current is not None and tables[current]:
            current = None  # the table ended
    return tables


TABLES = _tables()


def documented(table: str) -> list[str]:
    names = [row[0].strip("`") for row in TABLES[table]]
    assert len(names) == len(set(names)), f"{table} lists a field twice"
    return names


def _default(cell: str) -> Any:
    return attrs.NOTHING if cell == "required" else json.loads(cell.strip("`"))


@pytest.mark.parametrize(
    ("table", "cls"), [("scenario", Scenario), ("scenario.timeline[]", TimelineEvent)]
)
def test_scenario_fields_and_defaults_are_documented(table: str, cls: type) -> None:
    fields = attrs.fields(cls)
    assert documented(table) == [f.name for f in fields]
    for row, f in zip(TABLES[table], fields, strict=True):
        default = f.default if f.default is attrs.NOTHING else json.loads(json.dumps(f.default))
        assert _default(row[2]) == default, f"{table}.{f.name}: README says {row[2]}"


def test_documented_applications_are_the_known_ones() -> None:
    row = next(r for r in TABLES["scenario"] if r[0] == "`application`")
    assert set(re.findall(r"`([\w-]+)`", row[3])) == {*builtin_applications(), "replay-small"}


def test_the_readme_example_is_a_valid_scenario(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    text = README.read_text(encoding="utf-8")
    example = re.search(r"```json\n(.*?)```", text, re.S)
    assert example is not None
    path = tmp_path / "example.json"
    path.write_text(example.group(1))
    assert main(["replay", str(path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert documented("replay") == list(out)
    assert documented("replay.epochs[]") == list(out["epochs"][0])
    assert documented("replay.timeline[]") == list(out["timeline"][0])


def test_cluster_and_compare_json_fields_are_documented(
    capsys: pytest.CaptureFixture[str],
) -> None:
    small = ["--jobs", "3", "--nodes", "2", "--json"]
    assert main(["cluster", "--policy", "fifo", *small]) == 0
    cluster = json.loads(capsys.readouterr().out)
    assert documented("cluster") == list(cluster)
    assert documented("cluster.jobs[]") == list(cluster["jobs"][0])
    assert main(["compare", "--policies", "fifo", *small]) == 0
    compare = json.loads(capsys.readouterr().out)
    assert documented("compare") == list(compare)
    assert documented("compare.mean.*") == list(compare["mean"]["fifo"])
    one = compare["workloads"]["synthetic"]["fifo"]
    # compare holds the cluster object without the per-job history.
    assert list(one) == list(cluster)
    assert list(one["jobs"][0]) == [f for f in documented("cluster.jobs[]") if f != "history"]
    assert one["utilization"] is None
