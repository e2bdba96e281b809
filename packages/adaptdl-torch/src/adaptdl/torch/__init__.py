"""AdaptDL for PyTorch: elastic, adaptive data-parallel training launched by torchrun.

Replace ``DataLoader`` with `AdaptiveDataLoader` and ``DistributedDataParallel``
with `AdaptiveDataParallel`, loop over ``remaining_epochs_until(N)``, and launch
with ``torchrun``: the job may be stopped (SIGTERM) and restarted on any number of
replicas without losing or repeating data. Every decision is made by
``adaptdl.core``; this package is the glue to ``torch``.
"""

from adaptdl.torch._context import init_process_group, is_initialized
from adaptdl.torch.accumulator import Accumulator
from adaptdl.torch.data import AdaptiveDataLoader, current_dataloader
from adaptdl.torch.epoch import current_epoch, finished_epochs, remaining_epochs_until
from adaptdl.torch.parallel import AdaptiveDataParallel
from adaptdl.torch.progress import global_step

__all__ = [
    "Accumulator",
    "AdaptiveDataLoader",
    "AdaptiveDataParallel",
    "current_dataloader",
    "current_epoch",
    "finished_epochs",
    "global_step",
    "init_process_group",
    "is_initialized",
    "remaining_epochs_until",
]
