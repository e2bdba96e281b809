"""What the seed-style programs of the end-to-end tests share: settings and progress records.

Imported by ``seed_tutorial.py`` and ``seed_gan.py`` (torchrun puts their directory
on ``sys.path``). Each replica appends one JSON line per batch to
``$E2E_RECORD_DIR/run<R>-rank<k>.jsonl``, which the harness waits on to stop a run.
"""

from __future__ import annotations

import json
import os
import time

SETTINGS = {"EPOCHS": 3, "N": 96, "RUN": 0, "STEP_SLEEP": 0.0, "DROPOUT": 0.0}
EPOCHS, N, RUN, STEP_SLEEP, DROPOUT = (
    type(default)(os.environ.get(f"E2E_{name}", default)) for name, default in SETTINGS.items()
)
RANK = int(os.environ.get("RANK", "0"))


def record(**entry: object) -> None:
    """Append one progress record of this replica, then sleep ``E2E_STEP_SLEEP`` seconds."""
    path = os.path.join(os.environ["E2E_RECORD_DIR"], f"run{RUN}-rank{RANK}.jsonl")
    with open(path, "a", encoding="utf-8") as out:
        out.write(json.dumps({**entry, "run": RUN, "rank": RANK}) + "\n")
    if STEP_SLEEP:
        time.sleep(STEP_SLEEP)
