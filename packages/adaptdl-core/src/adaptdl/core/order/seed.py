"""Seeds every replica derives alike, on every platform, restart and Python version."""

from __future__ import annotations

import hashlib

__all__ = ["SHUFFLE_SEED", "derive_seed"]

SHUFFLE_SEED = 0
"""The seed of every epoch's permutation: the same on every replica and restart.

Each epoch still gets its own permutation (the epoch number is part of the key),
and every replica must agree on it without talking, so it is a constant, not a
random draw.
"""


def derive_seed(*parts: int) -> int:
    """A 63-bit seed from integers, the same on every platform (no ``hash()``)."""
    text = ":".join(str(int(p)) for p in parts).encode("ascii")
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") >> 1
