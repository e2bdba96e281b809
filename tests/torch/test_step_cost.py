"""What the gradient statistics cost a step: measured steps only, fused norms, no copies.

Core's budget picks the measured steps (`adaptdl.core.stats.statsbudget`); these tests fix
its share and check that the adapter measures exactly those steps, from the right
gradients, and keeps nothing it does not need.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from torch.utils.data import TensorDataset

import adaptdl.torch as adl
import torch
from adaptdl.core.stats.statsbudget import MeasureBudget
from adaptdl.core.stats.step import StepMeasurement
from adaptdl.torch import _context
from adaptdl.torch.launch import torchrun_command
from adaptdl.torch.parallel import AdaptiveDataParallel
from adaptdl.torch.scaling_rules import LinearScale
from adaptdl.torch.stepping import _inner

N = 32


def data() -> TensorDataset:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(N, 3, generator=gen)
    return TensorDataset(x, x.sum(1, keepdim=True))


def wrap(model: torch.nn.Module, share: float | None, **kwargs: Any) -> tuple[Any, Any]:
    optimizer = kwargs.pop("optimizer", None) or torch.optim.SGD(model.parameters(), lr=0.01)
    adp = AdaptiveDataParallel(model, optimizer, scaling_rule=LinearScale(), **kwargs)
    if share is not None:
        adp._steps.budget = MeasureBudget(fixed=share)
    return adp, optimizer


def train(adp: Any, optimizer: Any, loader: Any, seen: list[StepMeasurement]) -> int:
    """Train one epoch; record each measurement core is handed; return the steps."""
    measure = adp._steps.measure

    def spy(m: StepMeasurement, init: int) -> Any:
        seen.append(m)
        return measure(m, init)

    adp._steps.measure = spy
    steps = 0
    for _ in adl.remaining_epochs_until(1):
        for x, y in loader:
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(adp(x), y).backward()
            optimizer.step()
            helper = adl.current_dataloader()
            assert helper is not None
            if helper.is_optim_step():
                steps += 1
                assert not adp._hook_handles  # armed for a step, never beyond it
    return steps


@pytest.mark.parametrize("share", [1.0, 0.5, 0.25])
def test_one_replica_pairs_only_measured_steps_and_copies_only_before_them(share: float) -> None:
    loader = adl.AdaptiveDataLoader(data(), batch_size=4)
    loader.train()
    torch.manual_seed(0)
    adp, optimizer = wrap(torch.nn.Linear(3, 1), share)
    copies = []
    keep = adp._keep

    def counting_keep(*args: Any, **kwargs: Any) -> None:
        copies.append(adp._steps.taken)
        keep(*args, **kwargs)

    adp._keep = counting_keep
    seen: list[StepMeasurement] = []
    steps = train(adp, optimizer, loader, seen)
    measured = [k for k in range(steps) if adp._steps.budget.measures(k)]
    assert len(seen) == len(measured)
    # A copy (at step k) exactly before each measured step (k + 1).
    budget = adp._steps.budget
    assert copies == [k for k in range(steps) if budget.measures(k + 1)]
    gns = adp.gns
    assert gns is not None
    assert gns.num_updates == sum(m.pair is not None for m in seen) >= len(measured) - 1
    assert all(m.share == share for m in seen)


def test_an_unmeasured_step_gathers_no_gradient() -> None:
    # Per-parameter work (a transformer has hundreds of tensors) only on the steps that
    # measure, or keep their gradient for the next step to pair with.
    loader = adl.AdaptiveDataLoader(data(), batch_size=4)
    loader.train()
    adp, optimizer = wrap(torch.nn.Linear(3, 1), 0.25)
    gathered = []
    gather = adp._grad_groups

    def counting() -> Any:
        gathered.append(adp._steps.taken)
        return gather()

    adp._grad_groups = counting
    steps = train(adp, optimizer, loader, [])
    budget = adp._steps.budget
    expected = [k for k in range(steps) if budget.measures(k) or budget.measures(k + 1)]
    assert sorted(set(gathered)) == expected != list(range(steps))


def test_the_kept_gradient_is_one_buffer_reused_step_after_step() -> None:
    loader = adl.AdaptiveDataLoader(data(), batch_size=4)
    loader.train()
    adp, optimizer = wrap(torch.nn.Linear(3, 1), None)
    buffers = set()
    for _ in adl.remaining_epochs_until(1):
        for x, y in loader:
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(adp(x), y).backward()
            optimizer.step()
            assert adp._prev_grads is None and adp._prev_buf is not None
            buffers.add(tuple(t.data_ptr() for g in adp._prev_buf for t in g))
    assert len(buffers) == 1


@given(
    seed=st.integers(0, 2**31 - 1),
    dtype=st.sampled_from([torch.float32, torch.float64, torch.bfloat16, torch.complex64]),
)
def test_the_pairs_inner_product_is_half_what_the_sum_adds_to_the_squares(
    seed: int, dtype: torch.dtype
) -> None:
    # |x + y|^2 = |x|^2 + |y|^2 + 2 Re <x, y>, per tensor list, for every dtype a
    # gradient may have (half precision summed in float32, complex conjugated).
    gen = torch.Generator().manual_seed(seed)
    shapes = [(3, 4), (5,), (2, 1, 3)]
    a = [torch.randn(s, generator=gen).to(dtype) for s in shapes]
    b = [torch.randn(s, generator=gen).to(dtype) for s in shapes]

    def wide(t: torch.Tensor) -> torch.Tensor:
        return t.to(torch.complex128) if t.is_complex() else t.double()

    def sqr(t: torch.Tensor) -> float:
        return float(t.abs().square().sum())

    want = sum(
        (sqr(wide(x) + wide(y)) - sqr(wide(x)) - sqr(wide(y))) / 2
        for x, y in zip(a, b, strict=True)
    )
    got = _inner(a, b, torch.device("cpu"))
    assert got.dtype == torch.float64 and got.shape == ()
    assert float(got) == pytest.approx(want, rel=1e-2, abs=1e-2)
    assert float(_inner([], [], torch.device("cpu"))) == 0.0


def test_pairing_reads_the_kept_gradient_and_writes_nothing() -> None:
    # |prev + current|^2 comes from the squared norms at hand and one inner product: no
    # pass over the gradients writes their sum into the kept buffer (the values are
    # pinned by test_one_replicas_measured_statistics_are_the_gradients_own_norms).
    loader = adl.AdaptiveDataLoader(data(), batch_size=4)
    loader.train()
    torch.manual_seed(0)
    adp, optimizer = wrap(torch.nn.Linear(3, 1), 1.0)
    added = []
    foreach_add = torch._foreach_add_

    def spy_add(*args: Any, **kwargs: Any) -> Any:
        added.append(args)
        return foreach_add(*args, **kwargs)

    paired = 0
    for _ in adl.remaining_epochs_until(1):
        for x, y in loader:
            optimizer.zero_grad()
            pairs = adp._prev_buf is not None and adp._prev_buf_valid
            torch._foreach_add_ = spy_add
            try:
                torch.nn.functional.mse_loss(adp(x), y).backward()  # measured and paired
            finally:
                torch._foreach_add_ = foreach_add
            # Kept again for the next step (every step measures): the current gradient.
            buf = [t for g in adp._prev_buf or [] for t in g]
            grads = [p.grad for p in adp.parameters()]
            assert all(torch.equal(a, b) for a, b in zip(buf, grads, strict=True))
            paired += pairs
            optimizer.step()
    assert paired > 2 and not added


@pytest.mark.parametrize("share", [1.0, 0.5])
def test_accumulation_measures_each_micro_batch_on_measured_steps_only(share: float) -> None:
    loader = adl.AdaptiveDataLoader(data(), batch_size=8)
    loader.autoscale_batch_size(32, (1, 8), gradient_accumulation=True)
    _context.current_job().batch_size_decision = lambda query: (4, 1)  # 2 micro-batches
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    adp, optimizer = wrap(model, share)
    seen: list[StepMeasurement] = []
    grads: list[list[torch.Tensor]] = []
    hook = model.weight.register_hook(lambda g: grads.append([g.detach().clone()]) or None)
    steps = train(adp, optimizer, loader, seen)
    hook.remove()
    assert steps == N // 8
    assert len(seen) == sum(adp._steps.budget.measures(k) for k in range(steps))
    for m in seen:
        assert m.micro_batches == 2 and m.num_replicas == 1
    # The first measured step's local norms are those of its two micro-batches' gradients.
    first = next(k for k in range(steps) if adp._steps.budget.measures(k))
    weight_sqr = sum(float(g[0].double().square().sum()) for g in grads[2 * first : 2 * first + 2])
    bias_sqr = seen[0].local_sqr[0] - weight_sqr  # the bias's part: measured too
    assert 0.0 < bias_sqr < seen[0].local_sqr[0]


def test_norms_are_the_optimiser_groups_gradients_only() -> None:
    # Two groups, and a trainable parameter outside the optimiser: the norms are taken
    # per group and the stranger's gradient is left out.
    loader = adl.AdaptiveDataLoader(data(), batch_size=8)
    loader.autoscale_batch_size(32, (1, 8), gradient_accumulation=True)
    _context.current_job().batch_size_decision = lambda query: (4, 1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 1))
    optimizer = torch.optim.SGD(
        [{"params": [model[0].weight]}, {"params": [model[1].weight, model[1].bias]}], lr=0.01
    )
    adp, _ = wrap(model, None, optimizer=optimizer)
    seen: list[StepMeasurement] = []
    totals = []
    measure = adp._steps.measure

    def spy(m: StepMeasurement, init: int) -> Any:
        seen.append(m)
        totals.append(
            [
                sum(float(p.grad.double().square().sum()) for p in group["params"])
                for group in optimizer.param_groups
            ]
        )
        return measure(m, init)

    adp._steps.measure = spy
    for _ in adl.remaining_epochs_until(1):
        for x, y in loader:
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(adp(x), y).backward()
            optimizer.step()
    assert len(seen) == N // 8
    for m, total in zip(seen, totals, strict=True):
        assert m.total_sqr == pytest.approx(total, rel=1e-5)


def test_a_comm_hook_of_ones_own_is_ddps_own() -> None:
    loader = adl.AdaptiveDataLoader(data(), batch_size=4)
    loader.train()
    torch.manual_seed(0)
    adp, optimizer = wrap(torch.nn.Linear(3, 1), None)
    calls = []

    # Unannotated: DDP checks a hook's annotations, which are strings in this module.
    def hook(state, bucket):  # type: ignore[no-untyped-def]
        calls.append(state)
        fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        fut.set_result(bucket.buffer())
        return fut

    adp.register_comm_hook("mine", hook)
    with pytest.raises(RuntimeError, match="only be called once"):
        adp.register_comm_hook("again", hook)
    seen: list[StepMeasurement] = []
    steps = train(adp, optimizer, loader, seen)
    assert calls == ["mine"] * steps
    assert len(seen) == steps and adp.gns is not None and adp.gns.num_updates == steps - 1


def test_a_compressing_comm_hook_measures_what_it_leaves_in_grad() -> None:
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook

    loader = adl.AdaptiveDataLoader(data(), batch_size=4)
    loader.train()
    torch.manual_seed(0)
    adp, optimizer = wrap(torch.nn.Linear(3, 1), 1.0)
    adp.register_comm_hook(None, fp16_compress_hook)
    seen: list[StepMeasurement] = []
    measure = adp._steps.measure
    adp._steps.measure = lambda m, init: seen.append(m) or measure(m, init)
    grads = []
    for _ in adl.remaining_epochs_until(1):
        for x, y in loader:
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(adp(x), y).backward()
            grads.append(sum(float(p.grad.double().square().sum()) for p in adp.parameters()))
            optimizer.step()
    assert len(seen) == len(grads) > 0
    assert [m.total_sqr[0] for m in seen] == pytest.approx(grads, rel=1e-6)


def test_the_budgets_step_time_is_a_step_of_the_loop_never_what_ran_between_loops(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The statistics' CPU clock, driven by hand: each step takes 1 s, and 100 s pass
    # between two epochs (an evaluation, another model's training, a checkpoint). The
    # budget compares the statistics' cost with a step: it must never read a step of
    # 101 s, which would let the statistics cost 100 times what they may.
    import adaptdl.torch.stepping as stepping

    clock = [0.0]
    monkeypatch.setattr(stepping, "_cpu", lambda: clock[0])
    loader = adl.AdaptiveDataLoader(data(), batch_size=4)
    loader.train()
    torch.manual_seed(0)
    adp, optimizer = wrap(torch.nn.Linear(3, 1), 1.0)
    seen: list[StepMeasurement] = []
    measure = adp._steps.measure

    def spy(m: StepMeasurement, init: int) -> Any:
        seen.append(m)
        return measure(m, init)

    adp._steps.measure = spy
    for _ in adl.remaining_epochs_until(3):
        clock[0] += 100.0  # between the loops
        for x, y in loader:
            clock[0] += 1.0
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(adp(x), y).backward()
            optimizer.step()
    assert len(seen) == 3 * N // 4
    # The first step knows no step time yet; every later one reads a step of the loop.
    assert seen[0].step_time == 0.0
    assert [m.step_time for m in seen[1:]] == [1.0] * (len(seen) - 1)


@pytest.mark.parametrize("share", [1.0, 0.5, 0.25])
def test_one_replicas_measured_statistics_are_the_gradients_own_norms(share: float) -> None:
    # Pins what a measured step of one replica hands core, whatever the path that
    # computes it (buffers kept or not, fused or not): per group, |g_k|^2, and paired
    # with the step before, |g_{k-1}|^2 and |(g_{k-1} + g_k) / 2|^2.
    loader = adl.AdaptiveDataLoader(data(), batch_size=4)
    loader.train()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Tanh(), torch.nn.Linear(5, 1))
    optimizer = torch.optim.SGD(
        [{"params": list(model[0].parameters())}, {"params": list(model[2].parameters())}],
        lr=0.05,
    )
    adp, _ = wrap(model, share, optimizer=optimizer)
    seen: list[tuple[int, StepMeasurement]] = []
    measure = adp._steps.measure

    def spy(m: StepMeasurement, init: int) -> Any:
        seen.append((adp._steps.taken, m))
        return measure(m, init)

    adp._steps.measure = spy
    grads: list[list[list[torch.Tensor]]] = []  # per step, per group
    for _ in adl.remaining_epochs_until(2):
        for x, y in loader:
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(adp(x), y).backward()
            groups = optimizer.param_groups
            grads.append([[p.grad.detach().double().clone() for p in g["params"]] for g in groups])
            optimizer.step()

    def sqr(tensors: list[torch.Tensor]) -> float:
        return sum(float(t.square().sum()) for t in tensors)

    budget = adp._steps.budget
    assert [k for k, _ in seen] == [k for k in range(len(grads)) if budget.measures(k)]
    paired = 0
    for k, m in seen:
        assert m.num_replicas == m.micro_batches == 1 and m.batch_size == 4 and m.share == share
        assert m.total_sqr == pytest.approx([sqr(g) for g in grads[k]], rel=1e-6)
        assert m.local_sqr == m.total_sqr
        if k == 0:  # nothing before it to pair with
            assert m.pair is None
            continue
        assert m.pair is not None and m.pair.prev_batch_size == 4
        prev = grads[k - 1]
        pairs = zip(prev, grads[k], strict=True)
        mixed = [sqr([(a + b) / 2 for a, b in zip(p, c, strict=True)]) for p, c in pairs]
        assert m.pair.prev_sqr == pytest.approx([sqr(g) for g in prev], rel=1e-6)
        assert m.pair.mixed_sqr == pytest.approx(mixed, rel=1e-6)
        paired += 1
    # The step before each measured one was kept for it (measured or not).
    assert paired == len(seen) - (seen[0][0] == 0) > 0


@pytest.mark.e2e
def test_two_replicas_measure_local_gradients_and_call_no_collective_beyond_the_steps(
    tmp_path: Path,
) -> None:
    # DDP reduces the buckets by itself (no communication hook of ours, no all-reduce
    # from Python); a measured step adds the all_gather that sums the local norms, and a
    # step boundary that agrees the all_reduce of the flags (every k-th: these tiny
    # steps are spaced out). The local norms are each replica's own gradients, read
    # from .grad (DDP's defaults) or by the hooks (``.grad`` the bucket).
    script = Path(__file__).with_name("ddp_replicas.py")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = torchrun_command(script, 2, args=[str(tmp_path)])
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for rank in range(2):
        results = json.loads((tmp_path / f"ddp-rank{rank}.json").read_text())
        assert results["grads"]["in_grads"] and not results["hooks"]["in_grads"]
        for mode in ("grads", "hooks"):
            steps = results[mode]["steps"]
            assert [s["measured"] for s in steps] == [k % 2 == 1 for k in range(len(steps))]
            for s in steps:
                if not s["measured"]:
                    assert s["handed"] is None
                    continue
                local, _ = s["handed"]
                assert local == pytest.approx(s["local"], rel=1e-6)
            for s in steps[1:]:  # the first also holds the loop's start
                calls = {k: v for k, v in s["calls"].items() if v}
                assert set(calls) <= {"all_gather", "all_reduce"}, (mode, s)
                assert calls.get("all_gather", 0) == s["measured"], (mode, s)
                assert calls.get("all_reduce", 0) <= 1, (mode, s)
            agreements = sum(s["calls"].get("all_reduce", 0) for s in steps[1:])
            assert 1 <= agreements < len(steps) - 1, (mode, agreements)
    # The local norms differ between the replicas; each measures a part of the reduced
    # gradient (its tensors, the largest first to the less loaded), and the parts add up
    # to its squared norm.
    first, second = (json.loads((tmp_path / f"ddp-rank{r}.json").read_text()) for r in (0, 1))
    for mode in ("grads", "hooks"):
        for a, b in zip(first[mode]["steps"], second[mode]["steps"], strict=True):
            if not a["measured"]:
                continue
            assert a["handed"][0] != pytest.approx(b["handed"][0])
            assert a["total"] == pytest.approx(b["total"], rel=1e-6)
            parts = [x + y for x, y in zip(a["handed"][1], b["handed"][1], strict=True)]
            assert parts == pytest.approx(a["total"], rel=1e-6)
            # Split, not repeated: each replica measured some of the tensors (a replica
            # may own none of a small group's).
            assert sum(a["handed"][1]) > 0 and sum(b["handed"][1]) > 0
            assert sum(a["handed"][1]) < sum(a["total"]) * (1 - 1e-6)


def test_a_step_sets_the_wrappers_own_state_without_nn_modules_setattr(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # nn.Module.__setattr__ checks each value for a parameter, module or buffer (a few
    # microseconds a set); the wrapper's per-step state, some thirty sets a step, is
    # none of those.
    loader = adl.AdaptiveDataLoader(data(), batch_size=4)
    loader.train()
    adp, optimizer = wrap(torch.nn.Linear(3, 1), 0.5)
    through_module: set[str] = set()
    module_setattr = torch.nn.Module.__setattr__

    def counting(self: torch.nn.Module, name: str, value: Any) -> None:
        if self is adp:
            through_module.add(name)
        module_setattr(self, name, value)

    monkeypatch.setattr(torch.nn.Module, "__setattr__", counting)
    steps = train(adp, optimizer, loader, [])
    assert steps > 2
    hot = {"_measuring", "_micro", "_stat_cost", "_in_backward", "_last_sync", "last_gain"}
    assert hot <= adp._step_attrs
    assert not through_module & adp._step_attrs, through_module
    # DDP's own flags still go through it; the state is still the instance's own.
    assert "require_backward_grad_sync" in through_module
    assert adp._measuring is None and "_measuring" in vars(adp)
