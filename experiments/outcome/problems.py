"""Two workloads generated in code: shapes for a small CNN, a bracket language for a transformer.

Nothing is downloaded; every sample is drawn from a seeded numpy Generator.

* `shapes`: 16 x 16 grey images of one of eight shapes (filled and hollow square,
  disc, ring, plus, cross, triangle, diamond) at a random position, size and contrast,
  on a random low-frequency texture with strong pixel noise. Telling a ring from a
  disc, or a plus from a cross, at contrast below the noise takes real convolutional
  features; no classifier reaches 100%.
* `dyck`: sequences of a Dyck language with ``k`` bracket types (depth at most
  ``max_depth``): at depth 0 a bracket opens, at the maximum depth the innermost one
  closes, otherwise either, with equal probability; an opening bracket's type is
  uniform. The closing bracket's type is fixed by the stack, so a language model must
  track the nesting to reach the language's entropy. Because the generator is known,
  so is the best possible loss: `dyck_optimal_loss` is the exact conditional entropy
  of each next token, averaged, the floor any model's validation loss sits on.
"""

from __future__ import annotations

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
