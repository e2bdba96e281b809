"""The workloads: shapes for a small CNN, a bracket language and Python source for transformers.

Nothing is downloaded: shapes and dyck are drawn from seeded numpy Generators, the
source text is read from the interpreter's own standard library.

* `shapes`: 16 x 16 grey images of one of eight shapes (filled and hollow square,
  disc, ring, plus, cross, triangle, diamond) at a random position, size and contrast,
  on a random low-frequency texture with strong pixel noise. Telling a ring from a
  disc, or a plus from a cross, at contrast below the noise takes real convolutional
  features; no classifier reaches 100%.
* `python_source` (the held-out `charlm` of issue 36's study): windows of real text,
  the Python standard library's own source as the running interpreter holds it,
  encoded one token per character (newline, printable ASCII, one "other").
* `dyck`: sequences of a Dyck language with ``k`` bracket types (depth at most
  ``max_depth``): at depth 0 a bracket opens, at the maximum depth the innermost one
  closes, otherwise either, with equal probability; an opening bracket's type is
  uniform. The closing bracket's type is fixed by the stack, so a language model must
  track the nesting to reach the language's entropy. Because the generator is known,
  so is the best possible loss: `dyck_optimal_loss` is the exact conditional entropy
  of each next token, averaged, the floor any model's validation loss sits on.
"""

from __future__ import annotations

import hashlib
import importlib.util
import platform
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

#: Shape classes, in label order.
SHAPES = ("square", "frame", "disc", "ring", "plus", "cross", "triangle", "diamond")


def shapes(
    num_samples: int, *, size: int = 16, noise: float = 0.5, seed: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """Images (``num_samples`` x 1 x ``size`` x ``size``, float32) and labels (int64)."""
    gen = np.random.default_rng(seed)
    labels = gen.integers(0, len(SHAPES), size=num_samples)
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float32)
    cy = gen.uniform(4.0, size - 4.0, num_samples).astype(np.float32)[:, None, None]
    cx = gen.uniform(4.0, size - 4.0, num_samples).astype(np.float32)[:, None, None]
    r = gen.uniform(2.5, 4.5, num_samples).astype(np.float32)[:, None, None]
    shape = np.zeros((num_samples, size, size), dtype=np.float32)
    for label in range(len(SHAPES)):
        rows = np.flatnonzero(labels == label)
        shape[rows] = _mask(label, yy[None] - cy[rows], xx[None] - cx[rows], r[rows])
    contrast = gen.uniform(0.7, 1.3, num_samples)[:, None, None]
    # A background of two random plane waves: texture the network must learn to ignore.
    texture = np.zeros_like(shape)
    for _ in range(2):
        fy, fx = gen.uniform(-0.8, 0.8, (2, num_samples, 1, 1)).astype(np.float32)
        phase = gen.uniform(0, 2 * np.pi, (num_samples, 1, 1)).astype(np.float32)
        texture += 0.25 * np.sin(fy * yy[None] + fx * xx[None] + phase)
    pixels = gen.standard_normal(shape.shape, dtype=np.float32)
    images = contrast.astype(np.float32) * shape + texture + noise * pixels
    return images[:, None].astype(np.float32), labels.astype(np.int64)


def _mask(label: int, dy: np.ndarray, dx: np.ndarray, r: np.ndarray) -> np.ndarray:
    """The pixels of shape ``label`` at offsets (dy, dx) from its centre, radius ``r``."""
    ady, adx = np.abs(dy), np.abs(dx)
    if label in (0, 1, 5):
        cheb = np.maximum(ady, adx)
    if label in (2, 3):
        dist2 = dy**2 + dx**2
    name = SHAPES[label]
    if name == "square":
        return cheb <= r
    if name == "frame":
        return (cheb <= r) & (cheb > r - 1.3)
    if name == "disc":
        return dist2 <= r**2
    if name == "ring":
        return (dist2 <= r**2) & (dist2 > (r - 1.4) ** 2)
    if name == "plus":
        return ((ady <= 0.8) & (adx <= r)) | ((adx <= 0.8) & (ady <= r))
    if name == "cross":
        return (np.abs(ady - adx) <= 0.8) & (cheb <= r)
    if name == "triangle":
        return (dy >= -r) & (dy <= r) & (adx <= (dy + r) / 2.0)
    return ady + adx <= r


def dyck(
    num_sequences: int, *, length: int = 32, k: int = 3, max_depth: int = 6, seed: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """Token sequences (``num_sequences`` x ``length + 1``, int64) and per-position log-probs.

    Tokens ``0 .. k-1`` open a bracket of that type, ``k .. 2k-1`` close one; token
    ``2k`` starts every sequence. The second array (``num_sequences`` x ``length``)
    holds the log-probability the generator gave each next token (the model's
    target), whose negative mean is the optimal loss.
    """
    gen = np.random.default_rng(seed)
    n = num_sequences
    tokens = np.empty((n, length + 1), dtype=np.int64)
    tokens[:, 0] = 2 * k
    logp = np.empty((n, length))
    stack = np.zeros((n, max_depth), dtype=np.int64)
    depth = np.zeros(n, dtype=np.int64)
    rows = np.arange(n)
    for t in range(length):
        must_open = depth == 0
        must_close = depth == max_depth
        close = np.where(must_open, False, np.where(must_close, True, gen.random(n) < 0.5))
        kind = gen.integers(0, k, n)
        top = stack[rows, np.maximum(depth - 1, 0)]
        token = np.where(close, k + top, kind)
        p_open_each = np.where(must_open, 1.0 / k, 0.5 / k)
        p_close = np.where(must_close, 1.0, 0.5)
        logp[:, t] = np.log(np.where(close, p_close, p_open_each))
        opening = ~close
        stack[rows[opening], depth[opening]] = kind[opening]
        depth = depth + np.where(close, -1, 1)
        tokens[:, t + 1] = token
    return tokens, logp


def dyck_optimal_loss(logp: np.ndarray) -> float:
    """The expected loss of the true next-token distribution: the floor of any model's."""
    # The loss of the best model on a sample is -log p of the token drawn, in expectation
    # the conditional entropy; averaged over the validation set it is its exact floor.
    return float(-logp.mean())


#: The character LM's corpus: standard-library modules (single files), in this order.
#: Training text, then validation text from other modules, so that validation is text
#: the model never saw, not neighbouring lines of it.
STDLIB_TRAIN = (
    "argparse",
    "calendar",
    "configparser",
    "dataclasses",
    "difflib",
    "fractions",
    "functools",
    "heapq",
    "inspect",
    "ipaddress",
    "pprint",
    "statistics",
    "textwrap",
    "tokenize",
)
STDLIB_VAL = ("csv", "gettext", "numbers", "shlex", "string")
#: Characters the model tells apart: newline and printable ASCII; any other character
#: is one "other" token, and the start token comes last (`dyck_lm`'s convention).
CHARS = "\n" + "".join(chr(c) for c in range(32, 127))
OTHER = len(CHARS)
START = OTHER + 1
VOCAB = START + 1


def stdlib_source(modules: Sequence[str]) -> str:
    """The source text of standard-library ``modules``, joined in the order given.

    Each must be a module of one ``.py`` file in the running interpreter's library;
    the text depends on the Python version (`python_source` records which).
    """
    parts = []
    for name in modules:
        spec = importlib.util.find_spec(name)
        origin = None if spec is None else spec.origin
        if origin is None or not origin.endswith(".py") or origin.endswith("__init__.py"):
            raise ValueError(
                f"modules: {name!r} is not a single-file standard-library module here "
                f"(its source: {origin!r})"
            )
        parts.append(Path(origin).read_text(encoding="utf-8"))
    return "".join(parts)


def encode(text: str) -> np.ndarray:
    """Token ids of ``text`` (int64): `CHARS` by position, anything else `OTHER`."""
    table = np.full(128, OTHER, dtype=np.int64)
    table[[ord(c) for c in CHARS]] = np.arange(len(CHARS))
    codes = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32).astype(np.int64)
    ids = np.full(len(codes), OTHER, dtype=np.int64)
    ascii_ = codes < 128
    ids[ascii_] = table[codes[ascii_]]
    return ids


def python_source(
    *,
    length: int = 64,
    train_modules: Sequence[str] = STDLIB_TRAIN,
    val_modules: Sequence[str] = STDLIB_VAL,
    val_size: int | None = None,
    train_size: int | None = None,
) -> tuple[np.ndarray, np.ndarray, dict[str, Any]]:
    """Training and validation windows of the standard library's source, and what
    they were made of.

    Each text is cut into consecutive windows of ``length`` characters (the rest
    dropped), each row the start token then the window: ``(windows, length + 1)``
    int64 arrays, as `dyck` gives its sequences. ``val_size`` keeps the first that
    many validation windows; ``train_size`` that many training windows evenly spaced
    over the whole text (the first and the last included), so a smaller problem still
    reads every module. The info holds the Python version and the SHA-256 of both
    texts: a run on another interpreter reads another corpus.
    """
    if length < 1:
        raise ValueError(f"length must be >= 1, got {length}")
    if val_size is not None and val_size < 1:
        raise ValueError(f"val_size must be >= 1 or None, got {val_size}")
    overlap = sorted(set(train_modules) & set(val_modules))
    if overlap:
        raise ValueError(f"val_modules must not hold training modules, got {overlap}")
    texts = (stdlib_source(train_modules), stdlib_source(val_modules))
    train, val = (_windows(encode(t), length) for t in texts)
    if val_size is not None:
        val = val[:val_size]
    if train_size is not None:
        if not 1 <= train_size <= len(train):
            raise ValueError(f"train_size must be at most {len(train)} windows, got {train_size}")
        train = train[np.linspace(0, len(train) - 1, train_size).round().astype(np.int64)]
    info = {
        "python": platform.python_version(),
        "corpus_sha256": hashlib.sha256("\0".join(texts).encode()).hexdigest(),
        "train_chars": len(texts[0]),
        "val_chars": len(texts[1]),
    }
    return train, val, info


def _windows(ids: np.ndarray, length: int) -> np.ndarray:
    count = len(ids) // length
    if count < 1:
        raise ValueError(f"the text holds {len(ids)} characters, under one window of {length}")
    rows = ids[: count * length].reshape(count, length)
    return np.concatenate([np.full((count, 1), START, dtype=np.int64), rows], axis=1)
