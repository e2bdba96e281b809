"""Benchmark of adaptdl.core.goodput: the optimiser and the fit against their targets.

Prints median wall times (time.perf_counter over repetitions) next to the target
on one core, and for one configuration the ratio to a brute force that evaluates
every admissible (atomic_bsz, accum_steps) pair at once with numpy. Timings on a
shared machine are noisy: read the ratios, and rerun before trusting a figure.

    python benchmarks/bench_goodput.py
"""

from __future__ import annotations

import os

# The targets are for one core: keep BLAS (used inside L-BFGS-B) single-threaded.
# Threaded OpenBLAS on a busy machine makes each tiny BLAS call of the fit ~10x slower.
for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import statistics  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from typing import Any  # noqa: E402

import attrs  # noqa: E402
import numpy as np  # noqa: E402

from adaptdl.core.goodput import GoodputFunction, GradParams, PerfParams, fit_perf_params  # noqa: E402

# A job like the Pollux ImageNet traces: compute-bound steps, costlier links across nodes.
PERF = PerfParams(
    alpha_c=0.02, beta_c=0.0025, alpha_n=0.15, beta_n=0.01, alpha_r=0.03, beta_r=0.004, gamma=2.5
)
GRAD = GradParams(sqr=0.02, var=0.5)
INIT_BATCH_SIZE = 128
MAX_BATCH_SIZE = 8192
ATOMIC_RANGE = (16, 256)


def median_time(
    fn: Callable[[], Any], *, budget_s: float = 2.0, min_reps: int = 5
) -> tuple[float, float]:
    """Median wall and CPU seconds of one call of fn, repeated for about budget_s.

    CPU time (time.process_time) is what the call itself used: on a shared, busy
    machine it is the steadier figure; wall time is what a caller waits.
    """
    fn()  # warm up
    wall: list[float] = []
    cpu: list[float] = []
    deadline = time.perf_counter() + budget_s
    while len(wall) < min_reps or time.perf_counter() < deadline:
        start, start_cpu = time.perf_counter(), time.process_time()
        fn()
        wall.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
        if len(wall) >= 20_000:
            break
    return statistics.median(wall), statistics.median(cpu)


def brute_force(
    f: GoodputFunction, nodes: int, replicas: int, accumulation: bool
) -> tuple[float, int, int]:
    """Best configuration by evaluating every admissible integer pair (the peer)."""
    bmin, bmax = ATOMIC_RANGE
    u_max = MAX_BATCH_SIZE // (replicas * bmin) if accumulation else 1
    u, b = np.meshgrid(np.arange(1, u_max + 1), np.arange(bmin, bmax + 1), indexing="ij")
    total = replicas * u * b
    values = np.where(
        (total <= MAX_BATCH_SIZE) & (total >= INIT_BATCH_SIZE),
        f.evaluate(nodes, replicas, b, u - 1),
        -np.inf,
    )
    i = np.unravel_index(np.argmax(values), values.shape)
    return float(values[i]), int(b[i]), int(u[i] - 1)


def synthetic_observations(
    n: int, rng: np.random.Generator, perf: PerfParams = PERF
) -> tuple[np.ndarray, ...]:
    nodes = rng.integers(1, 5, n)
    replicas = nodes * rng.integers(1, 5, n)
    bsz = rng.integers(16, 257, n)
    f = GoodputFunction(perf, GRAD, 1)
    accum = (perf.alpha_c + perf.beta_c * bsz) * np.exp(rng.normal(0, 0.05, n))
    optim = replicas * bsz / f.throughput(nodes, replicas, bsz, 0) * np.exp(rng.normal(0, 0.05, n))
    return nodes, replicas, bsz, accum, optim


def main() -> None:
    f = GoodputFunction(PERF, GRAD, INIT_BATCH_SIZE)
    rng = np.random.default_rng(0)
    replicas = rng.integers(1, 65, 1024)
    nodes = np.maximum(1, replicas // rng.integers(1, 9, 1024))
    nodes = np.minimum(nodes, replicas)
    rows: list[tuple[str, tuple[float, float], float, str]] = []

    def optimize(num_nodes: Any, num_replicas: Any, accumulation: bool) -> Any:
        return f.optimize(num_nodes, num_replicas, MAX_BATCH_SIZE, ATOMIC_RANGE, accumulation)

    for acc in (False, True):
        label = "accumulation" if acc else "no accumulation"
        ours = median_time(lambda: optimize(2, 8, acc))  # noqa: B023 (called at once)
        peer = median_time(lambda: brute_force(f, 2, 8, acc))  # noqa: B023
        best = brute_force(f, 2, 8, acc)
        found = optimize(2, 8, acc)
        assert found[0] >= best[0] * (1 - 1e-9), (found, best)
        ratio = f"{ours[1] / peer[1]:.3f}"
        rows.append((f"optimize, 1 configuration, {label}", ours, 200e-6, ratio))
        many = median_time(lambda: optimize(nodes, replicas, acc))  # noqa: B023
        rows.append((f"optimize, 1024 configurations, {label}", many, 20e-3, ""))

    for n in (10, 50, 200):
        data = synthetic_observations(n, rng)
        fit = median_time(lambda: fit_perf_params(*data), budget_s=3.0)  # noqa: B023
        rows.append((f"fit_perf_params, {n} observations", fit, 50e-3, ""))

    # Measured accumulation (accum_measured): the fit tries the optimiser step's own
    # cost alpha_o only where the data show one; against the same data unmeasured.
    for label, alpha_o in (("accum measured, alpha_o 0", 0.0), ("accum measured, alpha_o", 0.02)):
        data = synthetic_observations(50, rng, attrs.evolve(PERF, alpha_o=alpha_o))
        measured = np.ones(50, dtype=bool)
        fit = median_time(lambda: fit_perf_params(*data, accum_measured=measured), budget_s=3.0)  # noqa: B023
        base = median_time(lambda: fit_perf_params(*data), budget_s=3.0)  # noqa: B023
        rows.append((f"fit_perf_params, 50, {label}", fit, 50e-3, f"{fit[1] / base[1]:.2f}u"))

    print(
        f"{'figure':<46} {'wall':>9} {'cpu':>9} {'target':>9} "
        f"{'wall/tgt':>8} {'cpu/tgt':>8} {'/brute':>7}"
    )
    for name, (wall, cpu), target, peer_ratio in rows:
        print(
            f"{name:<46} {wall * 1e3:>7.3f}ms {cpu * 1e3:>7.3f}ms {target * 1e3:>7.3f}ms "
            f"{wall / target:>8.2f} {cpu / target:>8.2f} {peer_ratio:>7}"
        )
    print("(/brute: CPU time of ours over a numpy brute force over every admissible pair;")
    print(" u: CPU time of the fit over the same fit with no accumulation measured)")


if __name__ == "__main__":
    main()
