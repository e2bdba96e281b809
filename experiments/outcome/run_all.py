"""Run the four outcome experiments, print their tables and write their plots.

    python -m experiments.outcome.run_all --out out/outcome

writes ``gns_accuracy.png``, ``adascale_scale.png``, ``autoscale_vs_fixed.png``,
``time_to_target.png``,
``tables.md`` (the tables, as printed) and ``summary.json`` to ``--out``. Item 4
adds the shapes CNN's adaptive run reporting its training loss with no target
stated (`report_loss`, the horizon), at the same seed, against the fixed sizes.
A target that is missed is reported, with the reason in
``experiments/outcome/RESULTS.md``; ``--strict`` makes it the exit status too.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from experiments.adascale_scale import study as adascale_scale
from experiments.autoscale_vs_fixed import study as autoscale_vs_fixed
from experiments.gns_accuracy import study as gns_accuracy
from experiments.time_to_target import study as time_to_target


class _Tee(io.TextIOBase):
    """Write to several text streams at once."""

    def __init__(self, *streams: Any) -> None:
        self.streams = streams

    def write(self, text: str) -> int:
        for stream in self.streams:
            stream.write(text)
        return len(text)

    def flush(self) -> None:
        for stream in self.streams:
            stream.flush()


def main(argv: Sequence[str] | None = None) -> int:
    """Run everything; return 1 when ``--strict`` and a target is missed, else 0."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("out/outcome"))
    parser.add_argument(
        "--strict", action="store_true", help="exit with status 1 when a target is missed"
    )
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    out = ["--out", str(args.out)]
    captured = io.StringIO()
    summary: dict[str, Any] = {}
    seconds: dict[str, float] = {}
    with contextlib.redirect_stdout(_Tee(sys.stdout, captured)):
        for name, title, run in (
            ("gns_accuracy", "1. Gradient-noise accuracy", gns_accuracy.main),
            ("adascale_scale", "2. AdaScale at scale", adascale_scale.main),
            ("autoscale_vs_fixed", "3. Adaptive batch size vs fixed", autoscale_vs_fixed.main),
            (
                "time_to_target",
                "4. Time to target over seeds: CNN and transformer",
                time_to_target.main,
            ),
        ):
            print(f"\n## {title}\n")
            start = time.perf_counter()
            # Item 4 at one seed and without fixed 32, 512 and 1024 keeps the whole
            # under 20 minutes on 2 cores: none was the best size of either problem on
            # any seed (RESULTS.md, item 4: 32 and 512 in its seventh and eighth
            # follow-ups too), and on dyck 1024 ran to the cap, the longest run.
            quick4 = ["--seeds", "1", "--sizes", "16,64,128,256"]
            summary[name] = run([*out, *quick4] if name == "time_to_target" else out)
            seconds[name] = time.perf_counter() - start
            print(f"\n({name}: {seconds[name]:.0f} s)")
        print("\n## 4, reporting the training loss: shapes, no target stated\n")
        start = time.perf_counter()
        summary["report_loss"] = report_loss_run(args.out / "report_loss", summary)
        seconds["report_loss"] = time.perf_counter() - start
        print(f"\n(report_loss: {seconds['report_loss']:.0f} s)")
        targets = check_targets(summary)
        print("\n## Targets\n")
        for label, met in targets.items():
            print(f"- {label}: {'met' if met else 'NOT met'}")
        if not all(targets.values()):
            print(
                "\nWhy a target is missed, and what would meet it: experiments/outcome/RESULTS.md"
            )
        print(f"\nTotal: {sum(seconds.values()):.0f} s")
    (args.out / "tables.md").write_text(captured.getvalue())
    (args.out / "summary.json").write_text(
        json.dumps({"summary": summary, "seconds": seconds, "targets": targets}, indent=1)
    )
    return 1 if args.strict and not all(targets.values()) else 0


def report_loss_run(out: Path, summary: dict[str, Any]) -> dict[str, Any]:
    """Shapes' adaptive run reporting its loss (`report_loss`, no target: the horizon)
    at item 4's seed; its CPU seconds to the target and the best fixed size's over
    them (``ratio_best``, None where either missed)."""
    argv = ["--out", str(out), "--problems", "shapes", "--kinds", "adaptive", "--seeds", "1"]
    time_to_target.main([*argv, "--floor-target-loss", "horizon"])
    run = json.loads((out / "time_to_target.json").read_text())[0]
    cpu = run["reached"]["cpu_seconds"] if run["reached"] is not None else None
    shapes = summary["time_to_target"].get("shapes", {})
    label = shapes.get("best_fixed")
    best = next((r for r in shapes.get("rows", []) if r["label"] == label), None)
    ratio = None if cpu is None or best is None else best["cpu_median"] / cpu
    shown = "missed" if ratio is None else f"{ratio:.2f}"
    print(f"adaptive, report_loss: {cpu} CPU s to the target; best fixed ({label}) / it: {shown}")
    return {"cpu_seconds": cpu, "best_fixed": label, "ratio_best": ratio}


#: The issue's floor on a problem's length: its target takes at least this long (CPU
#: seconds, median over the seeds run: one in `main`, so the 3-seed verdict is
#: RESULTS.md's) at the initial batch size, so that the warm-up at small sizes does not
#: dominate the comparison.
MIN_INITIAL_SECONDS = 60.0


def check_targets(summary: dict[str, Any]) -> dict[str, bool]:
    """The issue's targets, each as a label and whether it is met."""
    gns = summary["gns_accuracy"]["summaries"]
    targets = {}
    for s in gns[:2]:
        targets[f"GNS {s['mode']}: |G|^2 and tr(Sigma) within 10% after warm-up"] = all(
            s[f"{q}_{ref}_max"] < 0.10 for q in ("sqr", "var") for ref in ("lag", "now")
        )
    rows = {(r["rule"], r["scale"]): r for r in summary["adascale_scale"]}
    big = rows["adascale", 16]
    targets[
        "AdaScale at scale 16 within 2% of scale 1 (loss no worse than +2%, accuracy "
        "within 2 points)"
    ] = big["loss_gap"] <= 0.02 and abs(big["acc_gap"]) <= 0.02
    ratio = summary["autoscale_vs_fixed"]["ratio"]
    targets["adaptive batch size reaches the target accuracy no later than the best fixed"] = (
        ratio is not None and ratio >= 1.0
    )
    for problem, s in summary.get("time_to_target", {}).items():
        best, initial = s["cpu_ratio_best"], s["cpu_ratio_initial"]
        start = next((row for row in s["rows"] if row["label"] == "fixed 16"), None)
        floor = f"{problem}: the initial size takes at least {MIN_INITIAL_SECONDS:.0f} CPU s"
        targets[f"{floor} (median over the seeds run)"] = (
            start is not None
            and start["reached"] == start["runs"]
            and start["cpu_median"] >= MIN_INITIAL_SECONDS
        )
        targets[f"{problem}: adaptive no slower than the best fixed (median CPU time)"] = (
            best is not None and best >= 1.0
        )
        targets[f"{problem}: adaptive at most half the initial size's time (median CPU time)"] = (
            initial is not None and initial >= 2.0
        )
    if "report_loss" in summary:
        ratio = summary["report_loss"]["ratio_best"]
        targets[
            "shapes: adaptive reporting its training loss (no target) no slower than the "
            "best fixed"
        ] = ratio is not None and ratio >= 1.0
    return targets


if __name__ == "__main__":
    sys.exit(main())
