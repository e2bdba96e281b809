"""Every entry point of the project: tests, lint, typecheck, bench, demo, sim, faults, outcome.

All sessions install with the pins in constraints.txt so that torch is the CPU
build (an unpinned torch pulls a multi-GB CUDA build). Users get the ranges in
each package's pyproject.toml.
"""

from __future__ import annotations

import os
from pathlib import Path

import nox

nox.options.sessions = ["lint", "tests"]
nox.options.reuse_existing_virtualenvs = True
nox.options.default_venv_backend = "virtualenv"

ROOT = Path(__file__).parent
CONSTRAINTS = ("-c", str(ROOT / "constraints.txt"))
PACKAGES = (
    "packages/adaptdl-core",
    "packages/adaptdl-torch",
    "packages/adaptdl-sched",
    "packages/adaptdl-sim[plots]",
)
TEST_DEPS = (
    "pytest>=8",
    "pytest-cov>=5",
    "pytest-timeout>=2.3",
    "hypothesis>=6.100",
    "tensorboard>=2.10",
    # tests/core/test_no_torch.py runs ruff to check that lint bans torch in core.
    "ruff>=0.6",
)
PYTHON = "3.11"
# One BLAS/OpenMP thread per process: runs start several processes on 2 cores, and
# multithreaded BLAS made the goodput fit ~10x slower on a busy machine.
THREADS = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def _install(session: nox.Session, *extra: str) -> None:
    session.install(*CONSTRAINTS, *PACKAGES, *extra)


def _pytest(session: nox.Session, *args: str) -> None:
    # The slowest tests in every log: a CI run that takes longer says where.
    session.run(
        "pytest",
        "--timeout=600",
        "--durations=15",
        *args,
        env={**THREADS, "HYPOTHESIS_PROFILE": os.environ.get("HYPOTHESIS_PROFILE", "ci")},
    )


@nox.session(python=PYTHON)
def tests(session: nox.Session) -> None:
    """Unit, property and end-to-end tests (real torchrun processes on CPU with gloo)."""
    _install(session, *TEST_DEPS)
    # The live scheduler's tests (real processes, Ray) are nox -s sched's.
    args = session.posargs or ["tests", "--ignore=tests/sched/live"]
    _pytest(session, "--cov=adaptdl.core", "--cov-report=term", *args)


@nox.session(python=PYTHON)
def integrations(session: nox.Session) -> None:
    """Tests of the framework integrations, with PyTorch Lightning and Accelerate installed.

    Kept out of ``tests`` so that the main suite runs without the frameworks (its
    integration tests then skip).
    """
    extras = "packages/adaptdl-torch[lightning,accelerate]"
    packages = [extras if p == "packages/adaptdl-torch" else p for p in PACKAGES]
    session.install(*CONSTRAINTS, *packages, *TEST_DEPS)
    args = session.posargs or ["tests/integrations"]
    _pytest(session, *args)


@nox.session(python=PYTHON)
def sched(session: nox.Session) -> None:
    """The live scheduler's tests: real replica processes (emulated jobs and real
    adaptdl.torch gloo jobs), on this machine and on a local Ray cluster of simulated
    nodes.

    Only this session installs Ray (the extra ``adaptdl-sched[ray]``); ``tests``
    runs the rest of tests/sched (the policies and the round).
    """
    # Core, the scheduler and the torch adapter (torch at constraints.txt's pin: the
    # end-to-end test runs real gloo jobs); not the simulator's plots.
    deps = [d for d in TEST_DEPS if not d.startswith("tensorboard")]
    session.install(
        *CONSTRAINTS,
        "packages/adaptdl-core",
        "packages/adaptdl-torch",
        "packages/adaptdl-sched[ray]",
        *deps,
    )
    _pytest(session, *(session.posargs or ["tests/sched/live"]))


@nox.session(python=PYTHON)
def streaming(session: nox.Session) -> None:
    """The sharded-dataset tests with the optional readers' extras (pyarrow, fsspec).

    Not in the default sessions: CI's ``tests`` runs them without the extras, where
    the Parquet and remote-storage tests skip.
    """
    _install(session, *TEST_DEPS, "pyarrow>=14", "fsspec>=2023.1")
    args = session.posargs or [
        "tests/core/test_shards.py",
        "tests/torch/test_torch_shards.py",
        "tests/torch/test_shards_parquet.py",
        "tests/torch/test_shard_index_build.py",
    ]
    _pytest(session, *args)


@nox.session(python=PYTHON)
def lint(session: nox.Session) -> None:
    """ruff check and ruff format --check over the whole tree."""
    session.install("ruff>=0.6")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session(python=PYTHON)
def typecheck(session: nox.Session) -> None:
    """mypy (strict on adaptdl.core and adaptdl.sched) and the import-layer contract."""
    _install(session, "mypy>=1.10", "import-linter>=2.1", "pytest", "hypothesis")
    # Core's layers and the distributions' arrows (pyproject.toml, [tool.importlinter]).
    session.run("lint-imports")
    session.run("mypy", "packages/adaptdl-core/src/adaptdl/core")
    session.run("mypy", "packages/adaptdl-sched/src/adaptdl/sched")
    session.run(
        "mypy",
        "packages/adaptdl-torch/src/adaptdl/torch",
        "packages/adaptdl-sim/src/adaptdl/sim",
        # The original's top-level modules, kept for programs written against it.
        "packages/adaptdl-torch/src/adaptdl/env.py",
        "packages/adaptdl-torch/src/adaptdl/checkpoint.py",
        "packages/adaptdl-torch/src/adaptdl/collective.py",
    )


@nox.session(python=PYTHON)
def bench(session: nox.Session) -> None:
    """Ratio benchmarks against the peers; prints figures, asserts nothing."""
    _install(session)
    scripts = session.posargs or sorted(str(p) for p in (ROOT / "benchmarks").glob("bench_*.py"))
    for script in scripts:
        session.run("python", script, env=THREADS)


@nox.session(python=PYTHON)
def demo(session: nox.Session) -> None:
    """The main demo: elastic training through restarts at 2, 3 and 1 replicas."""
    _install(session)
    session.run("python", "examples/elastic_demo.py", *session.posargs, env=THREADS)


@nox.session(python=PYTHON)
def sim(session: nox.Session) -> None:
    """Compare scheduling policies on the Pollux workloads (built-in ones without them)."""
    _install(session)
    pollux = ROOT.parent / "shared" / "pollux"
    if pollux.is_dir():
        workloads = sorted(str(p) for p in (pollux / "workloads").glob("workload-*.csv"))
        session.run(
            "adaptdl-sim", "compare", "--traces", str(pollux / "traces"), *workloads, env=THREADS
        )
    else:
        session.log(f"{pollux} not found: comparing on the built-in workload")
        session.run("adaptdl-sim", "compare", env=THREADS)


@nox.session(python=PYTHON)
def faults(session: nox.Session) -> None:
    """Fault-injection trials under real torchrun processes (50, three at a time; seed printed)."""
    _install(session, "rich>=13")
    args = session.posargs or ["--trials", "50", "--jobs", "3"]
    session.run("python", "-m", "faults", *args, env=THREADS)


@nox.session(python=PYTHON)
def outcome(session: nox.Session) -> None:
    """Statistical soundness: GNS accuracy, AdaScale at scale, autoscaling vs fixed."""
    _install(session)
    session.run(
        "python",
        "-m",
        "experiments.outcome",
        *(session.posargs or ["--out", "out/outcome"]),
        env=THREADS,
    )
