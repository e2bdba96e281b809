"""Language-model windows for `AdaptiveDataLoader`, in place of the original's BPTT iterator.

The original ``AdaptiveBPTTIterator`` extended torchtext's legacy ``BPTTIterator``
(fields, ``Batch`` objects), which torchtext removed in 0.12 and no longer
maintains; importing it from here raises ImportError saying what replaces it:
`BPTTWindows`, a map-style dataset of ``(input, target)`` token windows, read by
an `AdaptiveDataLoader` like any other dataset::

    tokens = torch.tensor(vocab(tokenizer(text)))          # one long 1-D sequence
    loader = AdaptiveDataLoader(BPTTWindows(tokens, bptt_len=35), batch_size=20)
    for data, targets in loader:                           # each (batch, bptt_len)
        output = model(data.t())                           # sequence-first, as before

Windows are batch-first (the original's batches were sequence-first: transpose
them); the loader gives adaptive batch sizes and survives restarts as for any
dataset.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import Dataset

__all__ = ["BPTTWindows"]


class BPTTWindows(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Window ``i`` of a 1-D token sequence: ``tokens[i*L : i*L+L]`` and the next tokens.

    ``L`` is ``bptt_len``; the target is the input shifted by one token, so there are
    ``(len(tokens) - 1) // bptt_len`` windows (the tail that fills no window is left out).
    """

    def __init__(self, tokens: torch.Tensor, bptt_len: int) -> None:
        if not isinstance(tokens, torch.Tensor) or tokens.dim() != 1:
            raise ValueError(
                f"tokens must be a 1-D tensor of token ids, got "
                f"{getattr(tokens, 'shape', type(tokens).__name__)}"
            )
        if isinstance(bptt_len, bool) or not isinstance(bptt_len, int) or bptt_len < 1:
            raise ValueError(f"bptt_len must be an int >= 1, got {bptt_len!r}")
        if len(tokens) < bptt_len + 1:
            raise ValueError(
                f"tokens has {len(tokens)} tokens, fewer than bptt_len + 1 = {bptt_len + 1}: "
                "no window fits"
            )
        self.tokens = tokens
        self.bptt_len = bptt_len

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.bptt_len

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= index < len(self):
            raise IndexError(f"window {index} out of range for {len(self)} windows")
        start = index * self.bptt_len
        return (
            self.tokens[start : start + self.bptt_len],
            self.tokens[start + 1 : start + 1 + self.bptt_len],
        )


def __getattr__(name: str) -> Any:
    if name == "AdaptiveBPTTIterator":
        raise ImportError(
            "adaptdl.torch.iterator.AdaptiveBPTTIterator is not available: it was built on "
            "torchtext's legacy BPTTIterator, which torchtext removed in 0.12. Use "
            "adaptdl.torch.AdaptiveDataLoader(adaptdl.torch.iterator.BPTTWindows(tokens, "
            "bptt_len), batch_size=...) instead: it yields (input, target) batches of shape "
            "(batch, bptt_len), batch-first (transpose them for a sequence-first model); "
            "see docs/MIGRATING.md"
        )
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
