"""The trace-replay study's command: replay every application, print the table, write JSON.

    python -m experiments.trace_replay --traces ../shared/pollux/traces --out out/trace_replay
        [--apps cifar10,ncf] [--gpus 1,4,16] [--check]

writes ``trace_replay.json`` (every configuration, both targets) and ``summary.json``
(one row per application and GPU count, issue 36's schema, primary target) to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from experiments.trace_replay.curves import TARGETS, read_curves
from experiments.trace_replay.replay import (
    GPU_COUNTS,
    compare,
    model_check,
    run_adaptive,
    simulate_all_fixed,
)

from adaptdl.sim.traces import TraceApplication, load_traces

REPO = Path(__file__).resolve().parents[2]


def commit() -> str:
    """The repository's commit, with ``+dirty`` when the tree has changes."""

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", *args], cwd=REPO, capture_output=True, text=True, check=False
        ).stdout.strip()

    head = git("rev-parse", "--short", "HEAD") or "unknown"
    return head + ("+dirty" if git("status", "--porcelain", "--untracked-files=no") else "")


def replay_app(app: TraceApplication, gpus: Sequence[int], check: bool) -> dict[str, Any]:
    """One application: per GPU count the adaptive run, then each target's comparison."""
    curves = read_curves(app.folder)
    out: dict[str, Any] = {
        "application": app.name,
        "lower_is_better": curves.lower_is_better,
        "batch_sizes": list(curves.batch_sizes),
        "targets": {kind: curves.target(kind) for kind in TARGETS},
        "by_gpus": [],
    }
    for g in gpus:
        start = time.process_time()
        run = run_adaptive(app, g)
        sims = simulate_all_fixed(app, curves, g) if check else None
        entry: dict[str, Any] = {
            "gpus": g,
            "replay_cpu_seconds": time.process_time() - start,
            **{kind: compare(app, curves, g, curves.target(kind), run, sims) for kind in TARGETS},
        }
        if sims is not None:
            entry["model_check"] = model_check(curves, sims)
        out["by_gpus"].append(entry)
    return out


def summary_rows(results: Sequence[dict[str, Any]], sha: str) -> list[dict[str, Any]]:
    """Issue 36's summary rows (primary target), one per application and GPU count."""
    rows = []
    for app in results:
        for entry in app["by_gpus"]:
            c = entry["common"]
            r = c["best_fixed_over_adaptive"]
            rows.append(
                {
                    "problem": f"pollux/{app['application']} @ {_gpus(entry['gpus'])}",
                    "kind": "trace",
                    "best_fixed_over_adaptive": r,
                    # One measurement per configuration, a deterministic replay: no spread.
                    "interval": None,
                    "per_seed_median": r,
                    "initial_over_adaptive": c["initial_over_adaptive"],
                    "seeds": 1,
                    "commit": sha,
                    "gpus": entry["gpus"],
                    "best_fixed": c["best_fixed"],
                }
            )
    return rows


def _gpus(count: int) -> str:
    return f"{count} GPU" if count == 1 else f"{count} GPUs"


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def table(results: Sequence[dict[str, Any]]) -> str:
    """The markdown table: per application and GPU count, both targets."""
    lines = [
        "| application | GPUs | best fixed (common target) | best fixed / adaptive | "
        "initial / adaptive | adaptive by Pollux's rule | both by Pollux's rule | "
        "both simulated | adaptive's batch sizes | "
        "initial's target: best fixed / adaptive |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for app in results:
        for entry in app["by_gpus"]:
            c, i = entry["common"], entry["initial"]
            sizes = c["adaptive"]["batch_sizes"]
            shown = f"{sizes[0]}..{sizes[-1]}" if len(sizes) > 1 else str(sizes[0])
            best_i = (
                "not reached"
                if i["adaptive"]["seconds"] is None
                else _fmt(i["best_fixed_over_adaptive"])
            )
            lines.append(
                f"| {app['application']} | {entry['gpus']} | {c['best_fixed'] or '-'} | "
                f"{_fmt(c['best_fixed_over_adaptive'])} | {_fmt(c['initial_over_adaptive'])} | "
                f"{_fmt(c['best_fixed_over_adaptive_pollux'])} | "
                f"{_fmt(c['both_by_progress'])} | {_fmt(c['both_simulated'])} | {shown} | "
                f"{best_i} ({i['best_fixed'] or '-'}) |"
            )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    """Replay, print the table, write the JSON files; return the summary rows."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--traces", type=Path, default=REPO.parent / "shared/pollux/traces")
    parser.add_argument("--out", type=Path, default=Path("out/trace_replay"))
    parser.add_argument("--apps", default=None, help="comma-separated (default: all)")
    parser.add_argument("--gpus", default=",".join(map(str, GPU_COUNTS)))
    parser.add_argument(
        "--check",
        action="store_true",
        help="also simulate every fixed size: the model check (simulated / measured "
        "steps) and the diagnostic 'both simulated' (best fixed / adaptive, both timed "
        "by the simulator)",
    )
    args = parser.parse_args(argv)
    try:
        gpus = [int(g) for g in args.gpus.split(",")]
    except ValueError:
        parser.error(f"--gpus must be comma-separated integers, got {args.gpus!r}")
    if any(g < 1 for g in gpus):
        parser.error(f"--gpus must be >= 1, got {args.gpus!r}")
    # Read before the replay: the code that runs is the code at its start.
    sha = commit()
    apps = load_traces(args.traces, None if args.apps is None else args.apps.split(","))
    results = [replay_app(app, gpus, args.check) for app in apps.values()]
    rows = summary_rows(results, sha)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "trace_replay.json").write_text(
        json.dumps({"commit": sha, "results": results}, indent=1)
    )
    (args.out / "summary.json").write_text(json.dumps(rows, indent=1))
    print(table(results))
    print(
        f"\ncommit {sha}; targets per application: "
        + "; ".join(
            f"{a['application']} common {a['targets']['common']:.4g}, initial "
            f"{a['targets']['initial']:.4g}"
            for a in results
        )
    )
    return rows


if __name__ == "__main__":
    main(sys.argv[1:])
