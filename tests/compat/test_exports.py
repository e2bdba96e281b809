"""Every name the original's adaptdl.torch exported, and the modules it imported, exist here."""

from __future__ import annotations

import subprocess
import sys

import adaptdl.torch as adl

# The original's adaptdl.torch.__all__.
ORIGINAL_TORCH_ALL = [
    "init_process_group",
    "current_epoch",
    "finished_epochs",
    "remaining_epochs_until",
    "current_dataloader",
    "AdaptiveDataLoader",
    "ElasticSampler",
    "AdaptiveDataParallel",
    "Accumulator",
]


def test_every_name_of_the_originals_all_is_exported() -> None:
    for name in ORIGINAL_TORCH_ALL:
        assert name in adl.__all__, name
        assert getattr(adl, name) is not None
    assert adl.ElasticSampler is adl.data.ElasticSampler


def test_importing_adaptdl_torch_makes_the_top_level_modules_attributes() -> None:
    # The original's examples do `import adaptdl; import adaptdl.torch` and then call
    # adaptdl.env.replica_rank() and friends without importing adaptdl.env.
    code = (
        "import adaptdl, adaptdl.torch\n"
        "print(adaptdl.env.replica_rank(), adaptdl.checkpoint.State.__name__,"
        " adaptdl.collective.allreduce.__name__)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["0", "State", "allreduce"]
