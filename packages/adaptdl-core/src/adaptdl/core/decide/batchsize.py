"""Choosing the local batch size and accumulation steps for the replicas a job has.

The loader asks a `BatchSizeDecision` at the start of every pass and after every
restart. The default divides the target batch size evenly; `GoodputDecision`
maximises goodput with the job's own fitted model, lets the total grow by at most a
factor per decision while the gradient-noise estimate is still warming up
(`estimate_maturity`, `growth_cap`), grows only as far as the noise estimate's lower
confidence bound supports (`confidence_cap`), tries up to twice the one batch size
its throughput fit rests on where an optimistic model rates it better (exploration),
and keeps the current choice unless the new one is faster by more than a threshold
(a change costs little, but flapping between near-equal choices makes the profile
harder to read).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Protocol, overload

import attrs

from adaptdl.core.goodput import GoodputFunction, PerfParams
from adaptdl.core.validate import check_float, check_int, float_in


@attrs.frozen
class BatchSizeQuery:
    """What a decision needs to know. ``current`` is (local_bsz, accum_steps) or None."""

    num_nodes: int
    num_replicas: int
    batch_size: int
    max_batch_size: int | None = None
    local_bsz_bounds: tuple[int | None, int | None] | None = None
    gradient_accumulation: bool = False
    current: tuple[int, int] | None = None
    #: Samples in one pass (0: unknown): rounding the initial batch size up to the
    #: replicas never passes a replica's share of it (`min_total`).
    dataset_size: int = 0


@overload
def pass_capped(max_batch_size: int, batch_size: int, dataset_size: int) -> int: ...
@overload
def pass_capped(max_batch_size: None, batch_size: int, dataset_size: int) -> None: ...
def pass_capped(max_batch_size: int | None, batch_size: int, dataset_size: int) -> int | None:
    """``max_batch_size`` capped at one pass of ``dataset_size`` samples (0: unknown).

    Never below ``batch_size``, the loader's own. A larger step is cut short at the
    pass's end (yet profiled and credited at its full size) or, accumulated, spans two
    passes and holds samples twice; the loader's query and a job's scheduling hints
    both take this cap, so a scheduler never plans for a total the job cannot use.
    """
    n = check_int("dataset_size", dataset_size, min=0)
    if max_batch_size is None or not n:
        return max_batch_size
    return min(max_batch_size, max(n, batch_size))


def batch_size_query(
    num_nodes: int,
    num_replicas: int,
    batch_size: int,
    *,
    max_batch_size: int | None = None,
    local_bsz_bounds: tuple[int | None, int | None] | None = None,
    gradient_accumulation: bool = False,
    local_bsz: int = 0,
    accum_steps: int = 0,
    dataset_size: int = 0,
) -> BatchSizeQuery:
    """The query an adaptive loader asks for the replicas it has now.

    ``batch_size`` is the loader's target (initial) batch size; ``local_bsz`` and
    ``accum_steps`` are its last decision, 0 before it made any (then ``current`` is
    None, and a `GoodputDecision` has nothing to keep). ``dataset_size`` (0: unknown)
    caps the total at one pass (`pass_capped`). Every caller that decides a
    loader's batch size (the loader itself, the cluster simulator's jobs) builds its
    query here, so that one state always asks the same question.
    """
    replicas = check_int("num_replicas", num_replicas, min=1)
    nodes = check_int("num_nodes", num_nodes, min=1, max=replicas)
    target = check_int("batch_size", batch_size, min=1)
    local = check_int("local_bsz", local_bsz, min=0)
    current = (local, check_int("accum_steps", accum_steps, min=0)) if local else None
    max_batch_size = pass_capped(max_batch_size, target, dataset_size)
    return BatchSizeQuery(
        nodes,
        replicas,
        target,
        max_batch_size,
        local_bsz_bounds,
        gradient_accumulation,
        current,
        check_int("dataset_size", dataset_size, min=0),
    )


class BatchSizeDecision(Protocol):
    """Returns (local_bsz, accum_steps) for a query."""

    def __call__(self, query: BatchSizeQuery) -> tuple[int, int]: ...


@attrs.frozen
class RedecideSchedule:
    """When an adaptive loop asks its decision again in the middle of a pass.

    The first model is fitted from a few steps and improves quickly, so the
    intervals start short and double up to ``max_seconds``: most of the benefit of
    a better batch size comes early, and each decision costs a model fit.
    """

    first_seconds: float = attrs.field(default=1.0)
    max_seconds: float = attrs.field(default=60.0)

    @first_seconds.validator
    def _check_first(self, attribute: attrs.Attribute[float], value: Any) -> None:
        check_float("first_seconds", value, min=0.0, min_exclusive=True)

    @max_seconds.validator
    def _check_max(self, attribute: attrs.Attribute[float], value: Any) -> None:
        check_float("max_seconds", value, min=self.first_seconds)

    def next_interval(self, interval: float | None) -> float:
        """The interval after ``interval`` (None: the first one)."""
        if interval is None:
            return self.first_seconds
        return min(2.0 * interval, self.max_seconds)


class FixedSplit:
    """A batch-size decision that always answers (``local_bsz``, ``accum_steps``).

    Set as a job's ``batch_size_decision``, it runs the loader at the total batch
    size ``replicas * local_bsz * (accum_steps + 1)``: how a run fixes a scale above
    its replica count (the local bounds must contain the initial batch size, so
    accumulation cannot be forced through them).
    """

    def __init__(self, local_bsz: int, accum_steps: int) -> None:
        self.local_bsz = check_int("local_bsz", local_bsz, min=1)
        self.accum_steps = check_int("accum_steps", accum_steps, min=0)

    def __call__(self, query: BatchSizeQuery) -> tuple[int, int]:
        return self.local_bsz, self.accum_steps


def even_split(query: BatchSizeQuery) -> tuple[int, int]:
    """Divide the target batch size evenly over the replicas (rounding up).

    When the local batch size would exceed the upper local bound and accumulation
    is allowed, split it into micro-batches instead. The local bounds always hold
    (the lower bound wins where the two conflict), and the total is never below the
    target (`min_total`): it is the smallest such split, even where that passes
    ``max_batch_size`` (by rounding up to a multiple of the replicas, or by the
    lower local bound on every replica). Raises ValueError where no split reaches
    the target (`check_reachable`).
    """
    check_reachable(query)
    lo, hi = _bounds(query)
    local = math.ceil(query.batch_size / query.num_replicas)
    accum = 0
    if hi is not None and local > hi:
        accum = math.ceil(local / hi) - 1
        local = math.ceil(query.batch_size / (query.num_replicas * (accum + 1)))
    share = _pass_share(query)
    if share is not None and local * (accum + 1) > share:
        # Rounding up passed what one pass holds per replica: the pass wins (a step
        # larger than it is cut short, or with drop_last yields nothing at all).
        local = share // (accum + 1)
    return max(local, lo), accum


def min_total(query: BatchSizeQuery) -> int:
    """The smallest total batch size any decision may answer for ``query``.

    The initial batch size rounded up to a multiple of the replicas, or the lower
    local bound on every replica where that is larger: the original AdaptDL's
    floor. A shrink of the replicas never takes the total below it, whatever a
    fitted model rates best (it credits a smaller batch with no more progress per
    sample, so a flat throughput would otherwise tie, and the learning-rate rules
    are not meant for a scale below 1).
    """
    lo, _ = _bounds(query)
    local = -(-query.batch_size // query.num_replicas)
    share = _pass_share(query)
    if share is not None and local > share:
        # The pass caps the floor: it is what `even_split` fits in each replica's share
        # (with accumulation, micro-batches that divide it), so the fallback is admissible.
        return _total(query, *even_split(query))
    return max(local, lo) * query.num_replicas


def _pass_share(query: BatchSizeQuery) -> int | None:
    """Samples each replica takes in one pass, where rounding the batch size up to the
    replicas must stay within it (None: the pass's size is unknown, or the batch size
    itself is larger than a pass, whose steps are cut short at its end anyway)."""
    n = query.dataset_size
    if not n or query.batch_size > n:
        return None
    return n // query.num_replicas


def check_reachable(query: BatchSizeQuery) -> None:
    """Raise ValueError, naming the bounds, replicas and batch size, where no
    admissible split reaches the target: an upper local bound below the target's
    share of each replica, without gradient accumulation."""
    _, hi = _bounds(query)
    share = -(-query.batch_size // query.num_replicas)
    if hi is not None and hi < share and not query.gradient_accumulation:
        raise ValueError(
            f"local_bsz_bounds={query.local_bsz_bounds} cannot make batch_size="
            f"{query.batch_size} on {query.num_replicas} replica"
            f"{'' if query.num_replicas == 1 else 's'}: without gradient accumulation a "
            f"step holds at most {hi} x {query.num_replicas} = {hi * query.num_replicas} "
            f"samples. Raise the max local bound to >= {share}, or set "
            "gradient_accumulation=True"
        )


def _bounds(query: BatchSizeQuery) -> tuple[int, int | None]:
    if query.local_bsz_bounds is None:
        return 1, None
    lo, hi = query.local_bsz_bounds
    return (1 if lo is None else lo), hi


def estimate_maturity(samples: float, init_batch_size: int, warmup_steps: float) -> float:
    """How far the gradient-noise estimate is through its warm-up, in [0, 1].

    ``samples`` were folded into the estimate since it last restarted (inf: an estimate
    whose start is forgotten, `GradientNoiseScale.samples`); the warm-up is
    ``warmup_steps`` steps of ``init_batch_size`` samples (0: no warm-up, always 1).
    """
    b0 = check_int("init_batch_size", init_batch_size, min=1)
    warmup = check_float("warmup_steps", warmup_steps, min=0.0)
    if isinstance(samples, float) and samples == math.inf:
        return 1.0
    n = check_float("samples", samples, min=0.0)
    if warmup == 0.0:
        return 1.0
    return min(n / (warmup * b0), 1.0)


def growth_cap(query: BatchSizeQuery, maturity: float, max_growth: float) -> int | None:
    """The largest total batch size a decision may choose at ``maturity`` (None: no cap).

    A matured estimate (``maturity`` 1) is not capped. Before, the total may grow by at
    most ``max_growth`` over the larger of the current total and the initial batch
    size, and never below the smallest total the local bounds allow on these replicas
    (so that some configuration stays admissible).
    """
    m = check_float("maturity", maturity, min=0.0, max=1.0)
    growth = check_float("max_growth", max_growth, min=1.0)
    if m >= 1.0:
        return None
    base = current_total(query)
    lo, _ = _bounds(query)
    return max(math.floor(base * growth), lo * query.num_replicas, base)


def current_total(query: BatchSizeQuery) -> int:
    """The larger of the current total batch size (if any) and the initial one.

    The initial one is rounded up to a multiple of the replicas, as `even_split` starts
    there: a cap at the bare initial size would force a total below it (16 on 3
    replicas admits 15 and 18, never 16), a shrink the caps must never cause.
    """
    base = -(-query.batch_size // query.num_replicas) * query.num_replicas
    if query.current is not None:
        local, accum = query.current
        base = max(base, local * query.num_replicas * (accum + 1))
    return base


def confidence_cap(query: BatchSizeQuery, bound: GoodputFunction, max_batch_size: int) -> int:
    """The largest total a decision may choose given the conservative model ``bound``.

    The total that ``bound`` (the goodput model at the noise scale's lower confidence
    bound) rates best among the admissible configurations up to ``max_batch_size``,
    but never below the larger of the current total and the initial batch size
    (`current_total`): the bound limits growth only, a shrink is the point
    estimate's to decide.
    """
    base = current_total(query)
    if max_batch_size <= base:
        return max_batch_size
    _, local, accum = _optimum(query, bound, max_batch_size)
    best = int(local) * query.num_replicas * (int(accum) + 1)
    return max(best, base)


def _optimum(query: BatchSizeQuery, fn: GoodputFunction, max_batch_size: int) -> Any:
    """``fn``'s best admissible (goodput, local, accum) for ``query`` up to the total."""
    return fn.optimize(
        query.num_nodes,
        query.num_replicas,
        max_batch_size=max_batch_size,
        atomic_bsz_range=query.local_bsz_bounds,
        accumulation=query.gradient_accumulation,
    )


@attrs.define
class GoodputDecision:
    """Maximise goodput with the model that ``goodput_fn`` returns (None: even split).

    The rule, in order (docs/ARCHITECTURE.md, "The batch-size rule"):

    1. Maturity. ``estimate_samples`` (None: always mature) returns the samples
       folded into the gradient-noise estimate since it last restarted; the maturity
       is that over ``warmup_steps * batch_size`` samples, at most 1
       (`estimate_maturity`). An estimate a few steps old is noise: its |G|^2 is
       often clamped at 0, which makes the gain equal the scale and the model ask for
       the largest batch allowed.
    2. Growth cap. While the maturity is below 1 the total batch size may grow by at
       most ``max_growth`` per decision over the larger of the current total and the
       initial batch size (`growth_cap`); shrinking is never capped. A matured
       estimate chooses over every admissible configuration up to ``max_batch_size``.
       ``resolved`` (None: always) returns whether the estimate resolves the
       gradient (|G|^2 above 0, `GradientNoiseScale.resolved`); one that does not
       reads as pure noise, the gain is the scale at every size, and it is capped as
       an immature one whatever its age: growth by ``max_growth`` per decision while
       the gradient stays lost in the noise (an untrained network's plateau); once
       the estimate resolves a gradient, the next decision may shrink it again.
    3. Confidence cap. ``bound_fn(z)`` (None: no such cap) returns the goodput model
       with the gradient statistics at the noise scale's lower confidence bound
       (`GradientNoiseScale.grad_params_bound`, ``z = confidence_z`` standard
       errors). The total may grow above the larger of the current total and the
       initial batch size only up to the total that this conservative model
       rates best (`confidence_cap`): a jump needs the estimate's own spread to
       support it, whatever its age. It catches what the warm-up cannot: a mature
       estimate whose |G|^2 is small within its noise (the gain then nears the
       scale) asks for a large batch while its upper bound on |G|^2 does not; one
       at or below 0 is also held to ``max_growth`` per decision (``resolved``).
       Near 0 the two caps meet without a jump in the bound (it reads |G|^2 at
       ``|estimate| + z * error``); only the ``max_growth`` cap starts there.
    4. Exploration. ``explore_fn(accumulation)`` (None: no exploration; the
       argument is the query's ``gradient_accumulation``) returns, while the
       throughput fit cannot speak, the optimistic model of it and the atomic size
       a try may grow from (`Profiler.optimistic_fit`). Two gaps: while the fit has
       seen a single atomic batch size, it cannot tell a step's fixed cost from its
       per-sample cost and takes half of each (a prior that rated growth at 1.34x
       where 1.77x was measured, on a transformer whose fixed cost is 86% of a step
       at the initial size); the optimistic model takes the compute time measured
       there as constant in the batch size. While no accumulation micro-batch was
       measured, it cannot tell the optimiser step's own cost ``alpha_o`` from the
       compute and takes none, so accumulation never pays on one replica; the
       optimistic model takes the fixed compute cost as the optimiser step's. A
       decision on the fit alone may never try the configuration that would have
       shown it wrong. Where the optimistic model, under the same caps and with
       its local batch (atomic size times micro-batches) at most ``max_growth``
       times the profiled size (as Pollux's scheduler explores replica counts),
       chooses a larger total than the fit does and rates it above the current
       choice by the hysteresis threshold, the decision tries it (a local bound of
       one size: one accumulation step); otherwise the fit's choice stands, a
       shrink included. A try in flight is held until its steps are in the fit;
       they identify it and end the exploration; the decisions that follow use the
       fit, which undoes a try it refutes (by the threshold).
    5. Hysteresis. The optimum under the caps replaces an admissible current choice
       only when its modelled goodput exceeds the current one's by more than
       ``speedup_threshold`` (a factor > 1); on a fixed model every change then
       raises goodput by that factor, so decisions never go back and forth.
    """

    goodput_fn: Callable[[], GoodputFunction | None]
    speedup_threshold: float = attrs.field(default=1.05, validator=float_in(min=1.0))
    fallback: BatchSizeDecision = even_split
    estimate_samples: Callable[[], float] | None = None
    warmup_steps: float = attrs.field(default=100.0, validator=float_in(min=0.0))
    max_growth: float = attrs.field(default=2.0, validator=float_in(min=1.0))
    bound_fn: Callable[[float], GoodputFunction | None] | None = None
    confidence_z: float = attrs.field(default=2.0, validator=float_in(min=0.0))
    resolved: Callable[[], bool] | None = None
    explore_fn: Callable[[bool], tuple[PerfParams, int] | None] | None = None

    def maturity(self, query: BatchSizeQuery) -> float:
        """The noise estimate's maturity for ``query``: 0 while it resolves no gradient
        (``resolved``), else its warm-up's (1 without ``estimate_samples``)."""
        if self.resolved is not None and not self.resolved():
            return 0.0
        if self.estimate_samples is None:
            return 1.0
        return estimate_maturity(self.estimate_samples(), query.batch_size, self.warmup_steps)

    def __call__(self, query: BatchSizeQuery) -> tuple[int, int]:
        # The smallest split at or above the floor (`min_total`); ValueError where the
        # bounds reach none. Every answer below holds at least its total.
        least = even_split(query)
        fn = self.goodput_fn() if query.max_batch_size is not None else None
        if fn is None or query.max_batch_size is None:
            return self.fallback(query)
        # The floor wins over max_batch_size where rounding up must pass it (as
        # `even_split` does), and over the caps: none may leave only smaller totals.
        floor = _total(query, *least)
        query = attrs.evolve(query, max_batch_size=max(query.max_batch_size, floor))
        assert query.max_batch_size is not None
        cap = growth_cap(query, self.maturity(query), self.max_growth)
        top = query.max_batch_size if cap is None else min(cap, query.max_batch_size)
        max_batch_size = max(top, floor)
        bound = self.bound_fn(self.confidence_z) if self.bound_fn is not None else None
        goodput, local, accum = _capped_optimum(query, fn, bound, max_batch_size)
        if int(local) < 1:
            return least  # none fits (not reached: the floor's split does)
        tried = self._explore(query, fn, bound, max_batch_size, int(local) * (int(accum) + 1))
        if tried is not None:
            answer = tried
        elif self._keeps_current(query, fn, goodput):
            assert query.current is not None
            answer = query.current
        else:
            answer = int(local), int(accum)
        # The optimiser's own floor is its model's initial batch size: a model made for
        # another one could answer below this query's.
        return answer if _total(query, *answer) >= min_total(query) else least

    def _explore(
        self,
        query: BatchSizeQuery,
        fn: GoodputFunction,
        bound: GoodputFunction | None,
        max_batch_size: int,
        chosen: int,
    ) -> tuple[int, int] | None:
        """The larger size to try (item 4), or None: the optimistic model's optimum
        under the same caps, its atomic size at most ``max_growth`` times the one
        profiled, when it is larger than the fit's choice (``chosen``: its atomic size
        times its micro-batches) and passes the hysteresis on the optimistic model."""
        if self.explore_fn is None:
            return None
        found = self.explore_fn(query.gradient_accumulation)
        if found is None:
            return None
        params, profiled = found
        # Tied to the size profiled, not the current one: a size decided but not yet
        # profiled (the next decision may come first) never extends the reach.
        reach = math.floor(self.max_growth * profiled)  # the atomic size a try may have
        lo, _ = _bounds(query)
        # The limit holds the atomic size within reach too: local * (accum + 1) <= reach.
        limit = min(max_batch_size, reach * query.num_replicas)
        if reach < lo or limit <= max(chosen * query.num_replicas, query.batch_size - 1):
            return None  # nothing larger within reach
        explore = attrs.evolve(fn, perf_params=params)
        if bound is not None:
            bound = attrs.evolve(bound, perf_params=params)
        goodput, local, accum = _capped_optimum(query, explore, bound, limit)
        if int(local) < 1 or int(local) * (int(accum) + 1) <= chosen:
            return None
        # An accumulation try is unmeasured while the optimistic model still holds an
        # optimiser-step cost of its own (above the fit's: 0 until measured).
        unmeasured = int(accum) > 0 and params.alpha_o > fn.perf_params.alpha_o
        if query.current == (int(local), int(accum)) and (int(local) > profiled or unmeasured):
            # A try in flight (not yet profiled: the decision came first) is held
            # until its steps can speak.
            return query.current
        if self._keeps_current(query, explore, goodput):
            # Not worth a try: the fit's own choice decides (a shrink it wants stands).
            return None
        return int(local), int(accum)

    def _keeps_current(self, query: BatchSizeQuery, fn: GoodputFunction, goodput: Any) -> bool:
        """Whether an admissible current choice stands against ``goodput`` on ``fn``
        (the hysteresis)."""
        if query.current is None or not _admissible(query, *query.current):
            return False
        now = fn.evaluate(query.num_nodes, query.num_replicas, *query.current)
        return bool(goodput <= self.speedup_threshold * max(float(now), 1e-12))


def _capped_optimum(
    query: BatchSizeQuery,
    fn: GoodputFunction,
    bound: GoodputFunction | None,
    max_batch_size: int,
) -> Any:
    """``fn``'s best (goodput, local, accum) up to ``max_batch_size`` and, given the
    conservative model ``bound``, up to `confidence_cap`."""
    if bound is not None:
        max_batch_size = min(max_batch_size, confidence_cap(query, bound, max_batch_size))
    return _optimum(query, fn, max_batch_size)


def _total(query: BatchSizeQuery, local: int, accum: int) -> int:
    return local * query.num_replicas * (accum + 1)


def _admissible(query: BatchSizeQuery, local: int, accum: int) -> bool:
    """Whether (``local``, ``accum``) is within the bounds, the accumulation setting,
    ``max_batch_size`` and the floor (`min_total`): a current choice that is not
    (one made on more replicas) is never kept."""
    lo, hi = _bounds(query)
    if local < lo or (hi is not None and local > hi):
        return False
    if accum > 0 and not query.gradient_accumulation:
        return False
    total = _total(query, local, accum)
    if total < min_total(query):
        return False
    return query.max_batch_size is None or total <= query.max_batch_size
