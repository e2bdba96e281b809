"""The linear-regression problem whose gradient noise is known in closed form (item 1).

``y = x . w* + eps``, ``x ~ N(0, Lambda)``, ``eps ~ N(0, sigma^2)``, loss ``1/2 (x . w -
y)^2``: `true_sqr` and `true_var` are |G|^2 and tr(Sigma) at ``w`` exactly (the
derivation is `experiments.gns_accuracy`'s docstring). `gns_accuracy` checks the
estimator against them; `adascale_scale` trains the same problem at several scales.
"""

from __future__ import annotations

from typing import Any

import numpy as np

#: The default experiment; tests shrink it.
DEFAULT = {
    "dim": 64,
    "lam_min": 0.5,
    "lam_max": 1.5,
    "sigma": 1.0,
    "delta0": 2.0,  # initial |delta| per coordinate (|delta0|^2 = dim * delta0^2)
    "num_samples": 65536,
    "batch_size": 256,  # total, two micro-batches of 128 per step
    "lr": 1.5e-4,
    "steps": 4000,
    "smoothing": 0.99,  # None: the adapter's default (0.999)
    "exact_every": 100,
    "seed": 0,
    "share": None,  # None: the measuring budget's own share; else a fixed share of steps
}


def problem(cfg: dict[str, Any]) -> dict[str, np.ndarray]:
    """The problem's constants: ``lam`` (feature variances), ``w_star`` and ``w0``."""
    gen = np.random.default_rng(cfg["seed"])
    d = cfg["dim"]
    lam = np.linspace(cfg["lam_min"], cfg["lam_max"], d)
    w_star = gen.standard_normal(d)
    signs = gen.choice([-1.0, 1.0], size=d)
    w0 = w_star + cfg["delta0"] * signs
    return {"lam": lam, "w_star": w_star, "w0": w0}


def true_sqr(lam: np.ndarray, delta: np.ndarray) -> float:
    """|G|^2 = |Lambda delta|^2."""
    return float(np.sum((lam * delta) ** 2))


def true_var(lam: np.ndarray, delta: np.ndarray, sigma: float) -> float:
    """tr(Sigma) = tr(Lambda) delta' Lambda delta + |Lambda delta|^2 + sigma^2 tr(Lambda)."""
    tr = float(np.sum(lam))
    return tr * float(np.sum(lam * delta**2)) + true_sqr(lam, delta) + sigma**2 * tr


def sample(
    cfg: dict[str, Any], lam: np.ndarray, w_star: np.ndarray, n: int, seed: int
) -> tuple[np.ndarray, np.ndarray]:
    """``n`` draws of (x, y)."""
    gen = np.random.default_rng(seed)
    x = gen.standard_normal((n, lam.size)) * np.sqrt(lam)
    y = x @ w_star + cfg["sigma"] * gen.standard_normal(n)
    return x, y
