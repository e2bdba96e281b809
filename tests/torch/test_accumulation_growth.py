"""A job whose local bounds hold one size grows its total batch by accumulation (#38
item 4), end to end: real torchrun replicas training `accumulation_job.py`.

Its optimiser step sleeps 20 ms (a large model's optimiser step costs the same
whatever the batch). Before any accumulation is measured the decision tries one
accumulated step; once its steps are in the fit (``alpha_o`` identified), the fit
grows the total further by accumulation, at the bounds' one local size.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from adaptdl.torch.launch import torchrun_command

SCRIPT = Path(__file__).with_name("accumulation_job.py")


@pytest.mark.e2e
@pytest.mark.parametrize("replicas", [1, 2])
def test_a_one_size_job_with_a_costly_optimiser_step_grows_by_accumulation(
    tmp_path: Path, replicas: int
) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "ACCUM_MAX_STEPS": "400"}
    command = torchrun_command(SCRIPT, replicas, args=[str(tmp_path)])
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(replicas)]
    assert all(res["changes"] == results[0]["changes"] for res in results)  # one decision
    first, *later = results[0]["changes"]
    assert first[1:] == [32, 0, 32 * replicas]  # the initial split
    for _, local, accum, total in later:
        assert local == 32 and total == 32 * replicas * (accum + 1)  # the bounds hold
        assert total >= 32 * replicas  # never below the initial total
    # The try: one accumulation step first, then more once the fit has measured it.
    assert later and later[0][2] == 1, results[0]
    assert later[-1][2] > 1 and results[0]["steps"] < 400, results[0]
    # The optimiser step's own cost, identified (on two replicas by the optimiser
    # step's time less its sync wait): about the sleep, whatever the machine's load.
    perf = results[0]["perf_params"]
    assert perf["alpha_o"] >= 0.015, perf
