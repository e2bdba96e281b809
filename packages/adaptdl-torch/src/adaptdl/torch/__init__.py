"""AdaptDL for PyTorch: elastic, adaptive data-parallel training launched by torchrun.

Replace ``DataLoader`` with `AdaptiveDataLoader` and ``DistributedDataParallel``
with `AdaptiveDataParallel` (or shard the model with FSDP2's ``fully_shard`` and
adapt it with `AdaptiveFSDP`), loop over ``remaining_epochs_until(N)``, and launch
with ``torchrun``: the job may be stopped (SIGTERM) and restarted on any number of
replicas without losing or repeating data. Every decision is made by
``adaptdl.core``; this package is the glue to ``torch``.
"""

from typing import TYPE_CHECKING, Any

from adaptdl.torch._context import current_job, init_process_group, is_initialized
from adaptdl.torch.accumulator import Accumulator
from adaptdl.torch.data import (
    AdaptiveDataLoader,
    AdaptiveDataLoaderMixin,
    ElasticSampler,
    current_dataloader,
)
from adaptdl.torch.epoch import current_epoch, finished_epochs, remaining_epochs_until
from adaptdl.torch.parallel import AdaptiveDataParallel
from adaptdl.torch.progress import global_step
from adaptdl.torch.state import register_state

if TYPE_CHECKING:
    from adaptdl.torch.fsdp import AdaptiveFSDP

__all__ = [
    "Accumulator",
    "AdaptiveDataLoader",
    "AdaptiveDataLoaderMixin",
    "AdaptiveDataParallel",
    "AdaptiveFSDP",
    "ElasticSampler",
    "current_dataloader",
    "current_epoch",
    "current_job",
    "finished_epochs",
    "global_step",
    "init_process_group",
    "is_initialized",
    "register_state",
    "remaining_epochs_until",
]

# Programs written for the original do ``import adaptdl.torch`` and then use
# ``adaptdl.env``, ``adaptdl.checkpoint`` and ``adaptdl.collective`` without importing
# them: the original's package imported them, so ours does too.
import adaptdl.checkpoint
import adaptdl.collective
import adaptdl.env  # noqa: F401


def __getattr__(name: str) -> Any:
    # AdaptiveFSDP on first use: its module imports torch's distributed checkpoint and
    # DTensor, which double the import's time, and a DDP program (every replica of
    # every launch) uses neither.
    if name == "AdaptiveFSDP":
        from adaptdl.torch.fsdp import AdaptiveFSDP

        return AdaptiveFSDP
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
