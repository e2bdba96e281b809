"""Tests of the Pollux goodput model, its fit and its optimiser."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from adaptdl.core.goodput import GoodputFunction, GradParams, PerfParams, fit_perf_params

PERF = PerfParams(0.1, 0.01, 0.2, 0.01, 0.1, 0.005, 2.0)
GRAD = GradParams(sqr=1.0, var=5.0)


def test_throughput_matches_hand_calculation_single_replica() -> None:
    f = GoodputFunction(PERF, GRAD, 128)
    # One replica: no network, T_o = T_c = 0.1 + 0.01 * 64 = 0.74 s.
    assert f.throughput(1, 1, 64, 0) == pytest.approx(64 / 0.74)
    # Two accumulation steps: 3 * 0.74 s for 192 samples.
    assert f.throughput(1, 1, 64, 2) == pytest.approx(192 / (3 * 0.74))


def test_optimize_first_version_is_exact_on_a_small_case() -> None:
    f = GoodputFunction(PERF, GRAD, 128)
    g, b, k = f.optimize(1, 4, max_batch_size=4096)
    sizes = np.arange(32, 1025)
    brute = f.evaluate(1, 4, sizes, 0)
    assert g == pytest.approx(brute.max())
    assert b == sizes[np.argmax(brute)]
    assert k == 0
