"""The one declared choice of what a training run changes from the library's default path.

A run of `experiments.harness.trainer` trains either core's path (``core``) or one
variant of it, never two: ``floor`` (the training loss reported through
``report_loss``, the loss floor's credit in the decision, to ``floor_target_loss`` or,
at ``"horizon"``, none stated), ``noise-match`` (a fixed size whose steps carry the
initial batch's gradient noise per unit of progress, ``noise_match`` its level) or
``preconditioned`` (AdamScale on the preconditioned gradient's noise). `Variant.of`
reads the choice from a run's config, whose keys are those the run logs have always
held, and refuses a config naming two, or an option of a concluded study that was
removed from the tree (`ARCHIVED`; the git tag `ARCHIVE_TAG` keeps their code).
"""

from __future__ import annotations

import math
from typing import Any

import attrs

#: The variants a run may take (``core``: none).
VARIANTS = ("core", "floor", "noise-match", "preconditioned")

#: The tag that keeps the concluded negative studies removed from the tree.
ARCHIVE_TAG = "experiments-archive-2026-12-07"

#: Config keys of concluded negative studies (RESULTS.md), removed from the tree.
ARCHIVED = {
    "smoothing": "a shorter estimator memory (item 4, 'A shorter memory alone does not help')",
    "signal_memory": "the persistent-signal estimator (item 4, ninth follow-up)",
    "signal_decision_only": "the persistent-signal estimator (item 4, ninth follow-up)",
    "floor_credit": "the per-step floor credit (item 4, eleventh follow-up)",
}

#: The config key that selects each variant.
_KEYS = {
    "floor": "floor_target_loss",
    "noise-match": "noise_match",
    "preconditioned": "preconditioned",
}


def _given(value: Any) -> bool:
    # 0.0 is a target (== False, but given); False and None are not.
    return value is not None and value is not False


def check_floor_config(cfg: dict[str, Any]) -> None:
    """Refuse what the floor does not cover: an optimiser other than SGD (e.g. Adam)."""
    if cfg.get("optimizer", "sgd") != "sgd":
        raise ValueError(
            f"the noise floor needs an SGD-type optimiser, got optimizer={cfg.get('optimizer')!r}"
        )


@attrs.frozen
class Variant:
    """A run's variant (`VARIANTS`) and its one setting.

    ``floor_target``: the ``floor`` variant's target loss (None: the horizon, no
    target stated); ``noise_level``: the ``noise-match`` variant's level in (0, 1].
    """

    kind: str = attrs.field(default="core", validator=attrs.validators.in_(VARIANTS))
    floor_target: float | None = None
    noise_level: float = 1.0

    @classmethod
    def of(cls, cfg: dict[str, Any]) -> Variant:
        """The variant ``cfg`` selects; ValueError naming what is wrong with it."""
        archived = sorted(key for key in ARCHIVED if _given(cfg.get(key)))
        if archived:
            what = "; ".join(f"{key}: {ARCHIVED[key]}" for key in archived)
            raise ValueError(
                f"{', '.join(archived)} belong to concluded studies removed from the tree "
                f"({what}); git tag {ARCHIVE_TAG} keeps them"
            )
        given = [kind for kind, key in _KEYS.items() if _given(cfg.get(key))]
        if len(given) > 1:
            keys = ", ".join(_KEYS[kind] for kind in given)
            raise ValueError(f"a run takes one variant of {VARIANTS}, got {keys}")
        if not given:
            return cls()
        kind = given[0]
        value = cfg[_KEYS[kind]]
        if kind == "floor":
            check_floor_config(cfg)
            if value == "horizon":
                return cls(kind, floor_target=None)
            if not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(
                    f"floor_target_loss must be a finite loss or 'horizon', got {value!r}"
                )
            return cls(kind, floor_target=float(value))
        if kind == "noise-match":
            level = 1.0 if value is True else value  # True: the initial batch's noise
            if not isinstance(level, (int, float)) or not 0.0 < level <= 1.0:
                raise ValueError(f"noise_match must be a level in (0, 1], got {value!r}")
            return cls(kind, noise_level=float(level))
        if cfg.get("rule") != "adamscale":
            raise ValueError(
                f"preconditioned applies to rule 'adamscale', not {cfg.get('rule')!r}"
            )
        return cls(kind)
