"""`experiments.harness.variants`: a run's one declared variant, read from its config."""

from __future__ import annotations

from typing import Any

import pytest
from experiments.harness.runs import PROBLEMS
from experiments.harness.variants import ARCHIVE_TAG, Variant, check_floor_config

SHAPES, DYCK = PROBLEMS["shapes"], PROBLEMS["dyck"]


def test_check_floor_config_refuses_adam() -> None:
    check_floor_config({"optimizer": "sgd"})
    with pytest.raises(ValueError, match="needs an SGD-type optimiser, got optimizer='adam'"):
        check_floor_config({"optimizer": "adam"})


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        ({}, Variant()),
        ({"floor_target_loss": 0.0}, Variant("floor", floor_target=0.0)),  # 0 is a target
        ({"floor_target_loss": "horizon"}, Variant("floor", floor_target=None)),
        ({"noise_match": True}, Variant("noise-match", noise_level=1.0)),  # older logs
        ({"noise_match": 0.5}, Variant("noise-match", noise_level=0.5)),
        ({"preconditioned": False, "noise_match": None}, Variant()),
    ],
)
def test_the_config_selects_one_variant(extra: dict[str, Any], expected: Variant) -> None:
    assert Variant.of({**SHAPES, **extra}) == expected
    assert Variant.of({**DYCK, "preconditioned": True}) == Variant("preconditioned")


@pytest.mark.parametrize(
    ("cfg", "message"),
    [
        ({**SHAPES, "floor_target_loss": 0.3, "noise_match": 1.0}, "one variant of"),
        ({**DYCK, "floor_target_loss": 0.3}, "needs an SGD-type optimiser"),
        ({**SHAPES, "floor_target_loss": float("nan")}, "a finite loss or 'horizon'"),
        ({**SHAPES, "noise_match": 1.5}, r"a level in \(0, 1\], got 1.5"),
        ({**SHAPES, "preconditioned": True}, "applies to rule 'adamscale', not 'adascale'"),
        ({**SHAPES, "signal_memory": 0.5}, f"concluded studies.*git tag {ARCHIVE_TAG}"),
        ({**SHAPES, "smoothing": 0.99}, "smoothing belong to concluded studies"),
        ({**SHAPES, "floor_credit": True}, "per-step floor credit"),
    ],
)
def test_two_variants_or_an_archived_option_are_refused(cfg: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Variant.of(cfg)


def test_an_unknown_kind_is_refused() -> None:
    with pytest.raises(ValueError, match="kind"):
        Variant("smoothing")
