"""The held-out character-level language model of issue 36's study (`problems.python_source`,
`trainer.build_problem`'s "charlm"): its corpus, its encoding, one training step.

Defined before any study run on it (RESULTS.md, issue 36's protocol); these tests check
the definition, not any result.
"""

from __future__ import annotations

import platform

import numpy as np
import pytest
from experiments.harness import problems
from hypothesis import given
from hypothesis import strategies as st


@given(st.text(max_size=80))
def test_encoding_keeps_newline_and_printable_ascii_and_maps_the_rest_to_other(
    text: str,
) -> None:
    ids = problems.encode(text)
    assert ids.shape == (len(text),)
    for ch, i in zip(text, ids, strict=True):
        if ch in problems.CHARS:
            assert problems.CHARS[i] == ch
        else:
            assert i == problems.OTHER


def test_the_corpus_is_windows_of_the_standard_library_with_a_start_token() -> None:
    train, val, info = problems.python_source(length=32, val_size=50)
    assert train.shape[1] == val.shape[1] == 33 and len(val) == 50
    assert (train[:, 0] == problems.START).all() and (val[:, 0] == problems.START).all()
    assert train[:, 1:].max() <= problems.OTHER and train.min() >= 0
    assert info["python"] == platform.python_version()
    assert len(info["corpus_sha256"]) == 64
    # The first training window is the start of the first module's source, verbatim.
    first = problems.stdlib_source(problems.STDLIB_TRAIN[:1])[:32]
    assert "".join(problems.CHARS[i] for i in train[0, 1:]) == first
    again = problems.python_source(length=32, val_size=50)
    assert np.array_equal(again[0], train) and again[2] == info


def test_a_subset_of_training_windows_spans_the_corpus() -> None:
    full, _, _ = problems.python_source(length=64, val_size=1)
    some, _, _ = problems.python_source(length=64, val_size=1, train_size=100)
    assert len(some) == 100
    assert np.array_equal(some[0], full[0]) and np.array_equal(some[-1], full[-1])


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"length": 0}, "length must be >= 1"),
        ({"val_size": 0}, "val_size must be >= 1 or None"),
        ({"train_modules": ("json",)}, "'json' is not a single-file standard-library module"),
        (
            {"val_modules": ("heapq",)},
            r"val_modules must not hold training modules, got \['heapq'\]",
        ),
        ({"train_size": 10**9}, "train_size must be at most"),
    ],
)
def test_bad_arguments_are_named(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        problems.python_source(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
def test_the_problem_trains_one_step_and_evaluates(optimizer: str) -> None:
    from experiments.harness.trainer import CHARLM_ADAM, CHARLM_SGD, build_problem, make_optimizer

    import torch

    base = CHARLM_ADAM if optimizer == "adam" else CHARLM_SGD
    cfg, model, batch_loss, evaluate = build_problem({**base, "train_size": 64, "val_size": 16})
    assert cfg["train_size"] == 64 and cfg["corpus_sha256"]
    before, _ = evaluate()
    # Chance level over the predictable tokens: log(VOCAB - 1) nats, near it at the start.
    assert abs(before - np.log(problems.VOCAB - 1)) < 1.0
    opt = make_optimizer(cfg, model.parameters())
    for _ in range(5):
        loss = batch_loss(model, torch.arange(16))
        opt.zero_grad()
        loss.backward()
        opt.step()
    after, _ = evaluate()
    assert np.isfinite(after) and after < before
