"""One torchrun worker that trains any of the outcome problems to a target, and its loop.

`train` is the loop every outcome worker shares (the classifier of items 2 and 3 and
the problems of item 4): one configuration, adaptive or at a fixed batch size,
trained to a scale-invariant progress cap (in epochs of the initial batch size:
``progress_epochs * train_size / init_batch_size`` initial-batch steps), reporting
per optimiser step the progress, total batch size, accumulation steps, gain,
learning-rate factor and goodput; at regular intervals of processed samples the
validation loss and metric, with the training wall time and this process's CPU
time so far (evaluation excluded). The run reaches its target when the validation
accuracy reaches ``target_accuracy`` or the validation loss falls to
``target_loss``.

Either the batch size is fixed (``local_bsz`` and ``accum_steps`` given: the job's
batch-size decision is replaced by `FixedSplit`) or it is adaptive (``autoscale``:
AdaptDL's goodput-driven decision, up to ``max_batch_size``). The learning rate
follows a cosine schedule over the *progress*, so that runs at different scales see
the same schedule per unit of progress, and the scaling rule (``adascale``,
``adamscale`` or ``linear``) multiplies it at each step.

``measure_share`` (optional) fixes the share of optimiser steps that measure the
gradient statistics (core's `MeasureBudget`, which otherwise follows their measured
cost): runs compared step by step then do not also differ by the machine's load.

What the run changes from the library's default path is one declared choice,
`experiments.harness.variants.Variant` (core's path, the loss floor, noise matching
or AdamScale's preconditioned noise), read once from the config.

``python -m experiments.harness.trainer`` runs the worker of the ``problem`` named in
its config: ``shapes`` (a small CNN) or ``dyck`` (a small transformer language
model), both from `experiments.harness.problems`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

from experiments.harness import problems
from experiments.harness.launch import FixedSplit, fix_measure_share, worker_config, write_result
from experiments.harness.noisematch import check_config, extra_noise_weight, match_noise
from experiments.harness.variants import Variant

#: The shapes CNN: 8 classes of 16 x 16 images, tuned at the initial batch size only.
SHAPES = {
    "problem": "shapes",
    "train_size": 16384,
    "val_size": 2048,
    "noise": 0.5,
    "init_batch_size": 16,
    "optimizer": "sgd",
    "momentum": 0.9,
    "lr": 0.01,
    "rule": "adascale",
    "seed": 0,
}

#: The Dyck-language transformer: 3 bracket types, depth <= 6, 32 tokens a sequence.
DYCK = {
    "problem": "dyck",
    "train_size": 16384,
    "val_size": 1024,
    "length": 32,
    "brackets": 3,
    "max_depth": 6,
    "d_model": 32,
    "layers": 2,
    "init_batch_size": 16,
    "optimizer": "adam",
    "lr": 0.003,
    "rule": "adamscale",
    "seed": 0,
}


#: Issue 36's held-out character LM on the standard library's source (problems.
#: python_source), defined before any run on it: no constant tuned on it. ``lr`` is
#: the protocol's lr0; its calibration (RESULTS.md, issue 36's protocol) picks x0.5,
#: x1 or x2 of it at the initial size and sets the target and the budget.
CHARLM_ADAM = {
    "problem": "charlm",
    "train_size": 8192,  # windows of 64 characters, evenly spaced over the corpus
    "val_size": 1024,
    "length": 64,
    "d_model": 64,
    "layers": 2,
    "init_batch_size": 16,
    "optimizer": "adam",
    "lr": 1e-3,
    "rule": "adamscale",
    "seed": 0,
}
#: The same problem with SGD and momentum under AdaScale (the floor's held-out case).
CHARLM_SGD = {**CHARLM_ADAM, "optimizer": "sgd", "momentum": 0.9, "lr": 0.1, "rule": "adascale"}


def train(
    cfg: dict[str, Any],
    model: Any,
    batch_loss: Callable[[Any, Any], Any],
    evaluate: Callable[[], tuple[float, float]],
) -> None:
    """Train ``model`` under ``cfg`` (see the module docstring); rank 0 writes the result.

    ``batch_loss(net, indices)`` is the loss of the samples at ``indices`` (a tensor of
    dataset positions) through ``net``, the model wrapped for data parallelism (its
    forward is what synchronises the gradients); ``evaluate()`` returns (validation
    loss, validation metric).
    Call after ``adl.init_process_group``.
    """
    import adaptdl.torch as adl
    import torch
    from adaptdl.torch._context import current_job
    from adaptdl.torch.scaling_rules import AdamScale, AdaScale, LinearScale

    job = current_job()
    b0 = cfg["init_batch_size"]
    variant = Variant.of(cfg)  # the one declared choice (core's path, or one variant)
    # `floor`: core's floor share (adaptdl.core.stats.floor), through the loss the loop
    # reports (`report_loss`), its target the variant's (None: the horizon).
    reporting = variant.kind == "floor"
    report_target = variant.floor_target
    matched = None
    if variant.kind == "noise-match":
        # A fixed size's steps carry the initial batch's gradient noise per unit of
        # progress (times the variant's level).
        matched = check_config(cfg, job.topology.num_replicas)
        level = variant.noise_level
    n = cfg["train_size"]
    loader = adl.AdaptiveDataLoader(range(n), batch_size=b0, shuffle=True)
    if cfg.get("autoscale"):
        loader.autoscale_batch_size(
            cfg["max_batch_size"],
            local_bsz_bounds=tuple(cfg["local_bsz_bounds"]),  # type: ignore[arg-type]
            gradient_accumulation=cfg["gradient_accumulation"],
        )
        job.batch_size_decision = DecisionLog(job.batch_size_decision, job)
    else:
        local, accum = cfg["local_bsz"], cfg["accum_steps"]
        job.batch_size_decision = FixedSplit(local, accum)
        total = local * (accum + 1) * job.topology.num_replicas
        # Adaptive mode with a fixed decision: the loop then ends on progress, not data.
        loader.autoscale_batch_size(max(total, b0), gradient_accumulation=True)
    optimizer = make_optimizer(cfg, model.parameters())
    rules = {"linear": LinearScale, "adamscale": AdamScale, "adascale": AdaScale}
    rule = rules[cfg["rule"]]()
    if variant.kind == "preconditioned":  # the original's noise (Variant.of checked the rule)
        rule = AdamScale(preconditioned=True)
    adp = adl.AdaptiveDataParallel(model, optimizer, scaling_rule=rule)
    # Fixed, the gains and the progress of runs compared step by step do not vary with load.
    fix_measure_share(adp, cfg.get("measure_share"))

    target = cfg["progress_epochs"] * n / b0  # initial-batch steps
    steps: list[list[float]] = []
    evals: list[list[float]] = []
    samples = 0
    next_eval = 0
    train_time = 0.0
    train_cpu = 0.0  # this process's CPU time: less sensitive than wall time to other load
    target_acc = cfg.get("target_accuracy")
    target_loss = cfg.get("target_loss")
    reached: dict[str, float] | None = None
    diverged = False
    noise: list[list[float]] = []
    # The floor variant only: rows (progress, the training loss's average, the initial
    # batch's floor, the share), once the job holds a floor with a share.
    floor: list[list[float]] = []
    tick, tick_cpu = time.perf_counter(), time.process_time()
    for _ in adl.remaining_epochs_until(cfg["progress_epochs"]):
        for idx in loader:
            helper = adl.current_dataloader()
            assert helper is not None
            loss = batch_loss(adp, torch.as_tensor(idx))
            optimizer.zero_grad()
            loss.backward()
            samples += len(idx) * job.topology.num_replicas
            if helper.is_accum_step():
                optimizer.step()  # skipped by the adapter until the batch's last micro-batch
                if reporting:  # every micro-batch's, averaged at the step
                    adp.report_loss(loss, target_loss=report_target)
                continue
            fraction = min(adp.progress / target, 1.0)
            for group in optimizer.param_groups:
                group["lr"] = cosine_lr(cfg, fraction)
            if matched is not None:
                weight = extra_noise_weight(helper.current_batch_size / b0, adp.gain, level)
                if weight > 0.0:  # the same on every replica: the gain is the job's
                    match_noise(model, batch_loss, torch.as_tensor(idx), matched, weight)
            step_loss = float(loss)
            optimizer.step()
            if reporting:
                # Each replica reports its own; rank 0's decision (broadcast) reads its.
                adp.report_loss(step_loss, target_loss=report_target)
                shared, share = job.metrics.floor, job.metrics.floor_share()
                if shared is not None and share > 0.0 and len(steps) % 8 == 0:
                    floor0 = shared.floor0_at(job.metrics.grad_params())
                    floor.append([adp.progress, shared.average, floor0, share])
            # Judged on the parameters, the same on every replica after the averaged
            # step: a rank judging its own loss could stop while the other enters the
            # next all-reduce and waits there.
            if not parameters_finite(model):
                diverged = True
            steps.append(
                [
                    adp.progress,
                    helper.current_batch_size,
                    helper.current_local_bsz,
                    helper.accumulation_steps,
                    adp.last_gain,
                    adp.last_lr_factor,
                    step_loss,
                    adp.goodput() or 0.0,
                    train_time + time.perf_counter() - tick,
                ]
            )
            if len(steps) % 8 == 1 and adp.gns is not None:
                g = adp.gns
                noise.append([adp.progress, samples, g.sqr, g.var, min(g.samples, 1e300)])
            if samples >= next_eval:
                train_time += time.perf_counter() - tick
                train_cpu += time.process_time() - tick_cpu
                val_loss, val_acc = evaluate()
                evals.append([adp.progress, samples, train_time, val_loss, val_acc, train_cpu])
                hit = (target_acc is not None and val_acc >= target_acc) or (
                    target_loss is not None and val_loss <= target_loss
                )
                if reached is None and hit:
                    reached = {
                        "seconds": train_time,
                        "cpu_seconds": train_cpu,
                        "progress": adp.progress,
                        "samples": samples,
                        "steps": len(steps),
                    }
                next_eval += cfg["eval_every_samples"]
                tick, tick_cpu = time.perf_counter(), time.process_time()
            if diverged or (cfg.get("stop_at_target") and reached is not None):
                break
        if diverged or (cfg.get("stop_at_target") and reached is not None):
            break
    train_time += time.perf_counter() - tick
    train_cpu += time.process_time() - tick_cpu
    val_loss, val_acc = evaluate()
    if not evals or evals[-1][1] != samples:
        evals.append([adp.progress, samples, train_time, val_loss, val_acc, train_cpu])
    if job.topology.rank == 0:
        gns = adp.gns
        write_result(
            {
                "config": cfg,
                "replicas": job.topology.num_replicas,
                "steps": steps,
                "evals": evals,
                "val_loss": val_loss,
                "val_acc": val_acc,
                "progress": adp.progress,
                "samples": samples,
                "train_seconds": train_time,
                "train_cpu_seconds": train_cpu,
                "reached": reached,
                "diverged": diverged,
                "noise_scale": gns.noise_scale if gns is not None else None,
                "smoothing": gns.smoothing if gns is not None else None,
                "estimator": type(gns).__name__,
                # Per decision of an adaptive run: what the model predicted (DecisionLog).
                "decisions": getattr(job.batch_size_decision, "records", []),
                # Every few steps: (progress, samples, |G|^2, tr(Sigma), estimate samples).
                "noise": noise,
                **({"floor": floor} if reporting else {}),
            }
        )


#: Total batch sizes at which a DecisionLog records the model's predictions.
CANDIDATES = (16, 32, 64, 128, 256, 512, 1024)


class DecisionLog:
    """Wraps a job's batch-size decision and records, per call, what its model said.

    Each record: the wall and CPU time, the current and chosen (local, accum), the
    gradient-noise estimate (|G|^2, tr(Sigma), samples folded in), the fitted
    throughput parameters, the profiled configurations (atomic size, mean accumulation
    and optimiser step times, optimiser steps), and per candidate total batch size on
    the job's replicas (the largest local size within the bounds, then accumulation)
    the model's throughput (samples/s) and statistical efficiency. The outcome
    experiments compare these with what the fixed-size runs measured.
    """

    def __init__(self, inner: Any, job: Any) -> None:
        self.inner = inner
        self.job = job
        self.records: list[dict[str, Any]] = []
        self.start, self.start_cpu = time.perf_counter(), time.process_time()

    def __call__(self, query: Any) -> tuple[int, int]:
        choice = self.inner(query)
        record: dict[str, Any] = {
            "seconds": time.perf_counter() - self.start,
            "cpu_seconds": time.process_time() - self.start_cpu,
            # The clocks above count evaluations, a run's time to target does not; the
            # progress places the decision on the run's own trajectory.
            "progress": float(self.job.metrics.progress),
            "current": list(query.current) if query.current is not None else None,
            "choice": list(choice),
        }
        gns = self.job.metrics.gns
        if gns is not None and gns.has_estimate:
            record["gns"] = [gns.sqr, gns.var, min(gns.samples, 1e300)]
            z = getattr(self.inner, "confidence_z", None)
            bound = gns.grad_params_bound(z) if z is not None else None
            if bound is not None:
                # The bound's |G|^2 and tr(Sigma) per sample (GradParams.var is per M0).
                record["bound"] = [bound.sqr, bound.var * gns.init_batch_size, z]
        fn = self.job.goodput_fn() if query.max_batch_size is not None else None
        if fn is not None:
            record["perf"] = fn.perf_params.to_dict()
            prof = self.job.metrics.profiler
            obs = prof.observations()
            columns = (obs.num_nodes, obs.num_replicas, obs.atomic_bsz)
            times = (obs.accum_step_time, obs.optim_step_time)
            record["profiled"] = [
                [int(b), float(a), float(o), prof.timing(int(n), int(r), int(b)).optim.count]
                for n, r, b, a, o in zip(*columns, *times, strict=True)
            ]
            r = query.num_replicas
            hi = (query.local_bsz_bounds or (None, 128))[1] or 128
            rows = []
            for total in CANDIDATES:
                local = min(max(total // r, 1), hi)
                accum = max(total // (r * local) - 1, 0)
                rows.append(
                    [
                        total,
                        float(fn.throughput(query.num_nodes, r, local, accum)),
                        float(fn.efficiency(total)),
                    ]
                )
            record["candidates"] = rows
        self.records.append(record)
        return choice  # type: ignore[no-any-return]


def parameters_finite(model: Any) -> bool:
    """Whether every parameter of ``model`` is finite (a NaN or inf anywhere makes its
    tensor's sum non-finite)."""
    import torch

    with torch.no_grad():
        sums = torch.stack([p.detach().sum().double() for p in model.parameters()])
    return bool(torch.isfinite(sums).all())


def classifier_eval(model: Any, x: Any, y: Any) -> tuple[float, float]:
    """(cross-entropy, accuracy) of ``model`` on inputs ``x`` and labels ``y``.

    Under a process group each replica evaluates every ``world``-th sample and the sums
    are all-reduced: every replica returns the whole set's figures, each having done
    its share of the work (evaluation is wall time the runs do not count as training).
    """
    import torch.nn.functional as F

    import torch

    with torch.no_grad():
        rows = _my_rows(len(y))
        logits = model(x[rows])
        loss = F.cross_entropy(logits, y[rows], reduction="sum")
        correct = (logits.argmax(1) == y[rows]).sum()
        return _whole_set_means([float(loss), float(correct)], len(y))


def lm_eval(model: Any, tokens: Any) -> tuple[float, float]:
    """(cross-entropy, accuracy) of language model ``model`` predicting each next token
    of the sequences ``tokens``, averaged over every such token; shared out over the
    replicas as `classifier_eval` is."""
    import torch.nn.functional as F

    import torch

    with torch.no_grad():
        mine = tokens[_my_rows(len(tokens))]
        logits = model(mine[:, :-1])
        logits = logits.reshape(-1, logits.shape[-1])
        nexts = mine[:, 1:].reshape(-1)
        loss = F.cross_entropy(logits, nexts, reduction="sum")
        correct = (logits.argmax(1) == nexts).sum()
        return _whole_set_means([float(loss), float(correct)], tokens[:, 1:].numel())


def _my_rows(n: int) -> slice:
    """This replica's share of ``n`` evaluation rows: every ``world``-th from its rank."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return slice(0, n)
    return slice(dist.get_rank(), n, dist.get_world_size())


def _whole_set_means(sums: list[float], n: int) -> tuple[float, float]:
    """The two means over all ``n`` rows from each replica's ``sums`` of its share."""
    import torch.distributed as dist

    import torch

    total = torch.tensor(sums, dtype=torch.float64)
    if dist.is_initialized():
        dist.all_reduce(total)
    return float(total[0]) / n, float(total[1]) / n


def shapes_data(cfg: dict[str, Any]) -> tuple[Any, Any, Any, Any]:
    """Training images and labels, validation images and labels of the shapes problem.

    With ``data_seed`` None the run's ``seed`` draws the data. Otherwise every seed
    trains on the draw of ``data_seed``, and the seed varies, besides the
    initialisation, where each training image sits in the dataset, so the order the
    loader visits them in (its shuffle is seeded alike in every run).
    """
    import numpy as np

    n, data_seed = cfg["train_size"], cfg.get("data_seed")
    x, y = problems.shapes(
        n + cfg["val_size"],
        noise=cfg["noise"],
        seed=cfg["seed"] if data_seed is None else data_seed,
    )
    order = np.arange(n)
    if data_seed is not None:
        order = np.random.default_rng([data_seed, cfg["seed"]]).permutation(n)
    return x[order], y[order], x[n:], y[n:]


def shapes_cnn() -> Any:
    """The CNN of the shapes problem: two 3x3 conv + pool stages and a small MLP head."""
    import torch

    nn = torch.nn
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(32 * 4 * 4, 64),
        nn.ReLU(),
        nn.Linear(64, 8),
    )


def dyck_lm(vocab: int, length: int, d_model: int, layers: int) -> Any:
    """A causal pre-norm transformer LM over ``vocab`` tokens (the start token included)."""
    import torch

    class LM(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = torch.nn.Embedding(vocab, d_model)
            self.pos = torch.nn.Parameter(0.02 * torch.randn(length, d_model))
            layer = torch.nn.TransformerEncoderLayer(
                d_model, 2, 2 * d_model, dropout=0.0, batch_first=True, norm_first=True
            )
            self.enc = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
            self.out = torch.nn.Linear(d_model, vocab - 1)  # the start token is never next
            mask = torch.nn.Transformer.generate_square_subsequent_mask(length)
            self.register_buffer("mask", mask)

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            h = self.emb(tokens) + self.pos[: tokens.shape[1]]
            return self.out(self.enc(h, mask=self.mask, is_causal=True))  # type: ignore[no-any-return]

    return LM()


def make_optimizer(cfg: dict[str, Any], params: Any) -> Any:
    """The problem's optimiser over ``params``: Adam, or SGD with its momentum."""
    import torch

    if cfg.get("optimizer", "sgd") == "adam":
        return torch.optim.Adam(params, lr=cfg["lr"])
    return torch.optim.SGD(params, lr=cfg["lr"], momentum=cfg.get("momentum", 0.0))


def cosine_lr(cfg: dict[str, Any], fraction: float) -> float:
    """The base learning rate at ``fraction`` (in [0, 1]) of the cosine schedule."""
    return float(cfg["lr"] * 0.5 * (1.0 + math.cos(math.pi * fraction)))


def build_problem(
    cfg: dict[str, Any],
) -> tuple[dict[str, Any], Any, Callable[[Any, Any], Any], Callable[[], tuple[float, float]]]:
    """(cfg, model, batch_loss, evaluate) of the problem named in ``cfg``, seeded by it.

    For dyck with a ``target_excess`` the returned cfg adds ``optimal_loss`` (the
    exact best loss of the validation draw) and ``target_loss``; for charlm it adds the
    corpus's Python version and SHA-256 (`problems.python_source`). ``batch_loss(net,
    indices)`` and ``evaluate()`` are what `train` takes.
    """
    import torch.nn.functional as F

    import torch

    torch.manual_seed(cfg["seed"])
    n, n_val = cfg["train_size"], cfg["val_size"]
    if cfg["problem"] == "shapes":
        x, y, xv, yv = (torch.from_numpy(a) for a in shapes_data(cfg))
        model = shapes_cnn()

        def batch_loss(net: Any, idx: torch.Tensor) -> torch.Tensor:
            return F.cross_entropy(net(x[idx]), y[idx])

        def evaluate() -> tuple[float, float]:
            return classifier_eval(model, xv, yv)

        return cfg, model, batch_loss, evaluate
    if cfg["problem"] == "charlm":
        train_np, val_np, corpus = problems.python_source(
            length=cfg["length"], val_size=n_val, train_size=n
        )
        # The corpus (Python version, SHA-256) goes into every result with the config.
        cfg = {**cfg, **corpus}
        train_tok, val_tok = torch.from_numpy(train_np), torch.from_numpy(val_np)
        vocab, length = problems.VOCAB, cfg["length"]
    elif cfg["problem"] == "dyck":
        k, length = cfg["brackets"], cfg["length"]
        tok_np, logp = problems.dyck(
            n + n_val, length=length, k=k, max_depth=cfg["max_depth"], seed=cfg["seed"]
        )
        if "target_excess" in cfg:
            # The target is a loss this far above the best possible one on this draw.
            optimal = problems.dyck_optimal_loss(logp[n:])
            cfg = {**cfg, "optimal_loss": optimal, "target_loss": optimal + cfg["target_excess"]}
        tokens = torch.from_numpy(tok_np)
        train_tok, val_tok = tokens[:n], tokens[n:]
        vocab = 2 * k + 1
    else:
        raise ValueError(f"problem must be 'shapes', 'dyck' or 'charlm', got {cfg['problem']!r}")
    lm = dyck_lm(vocab, length, cfg["d_model"], cfg["layers"])

    def lm_loss(net: Any, idx: torch.Tensor) -> torch.Tensor:
        batch = train_tok[idx]
        logits = net(batch[:, :-1]).reshape(-1, vocab - 1)
        return F.cross_entropy(logits, batch[:, 1:].reshape(-1))

    def lm_evaluate() -> tuple[float, float]:
        return lm_eval(lm, val_tok)

    return cfg, lm, lm_loss, lm_evaluate


def worker() -> None:
    """One replica of one training run of the problem named in the config."""
    import adaptdl.torch as adl

    cfg = worker_config()
    adl.init_process_group("gloo")
    cfg, model, batch_loss, evaluate = build_problem(cfg)
    train(cfg, model, batch_loss, evaluate)


if __name__ == "__main__":
    worker()
