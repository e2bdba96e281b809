"""A training program in the seed project's tutorial style, on synthetic data.

As the seed's MNIST tutorial: the loaders are made (and autoscaled) before
``adaptdl.torch.init_process_group("gloo")``; each epoch trains, then validates
with an ``Accumulator`` made inside the epoch; after the epoch loop a test pass
iterates the test loader once more. Every replica prints its metrics as
``METRIC {json}`` lines; the end-to-end test compares them with an uninterrupted
run's. ``E2E_DROPOUT`` puts dropout in the model (random numbers matter), and
each replica prints ``PARAMS <sha256>`` of its (full) parameters when training ends.

``E2E_FSDP=1`` shards the model with FSDP2 (``fully_shard`` per layer and at the
root, after ``init_process_group``, with the optimiser made over the shards) and
adapts it with `AdaptiveFSDP` instead of `AdaptiveDataParallel`; the training
batch size is then fixed (no ``autoscale_batch_size``).

Per batch, every replica also appends a record to
``$E2E_RECORD_DIR/run<R>-rank<k>.jsonl`` (the harness waits on them to stop it).
"""

from __future__ import annotations

import hashlib
import json
import os

import torch.nn.functional as F
from seed_common import DROPOUT, EPOCHS, N, record
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import fully_shard
from torch.utils.data import TensorDataset

import adaptdl.torch
import torch
from adaptdl.torch.fsdp import AdaptiveFSDP
from torch import nn

FSDP = os.environ.get("E2E_FSDP") == "1"


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 32)
        self.dropout = nn.Dropout(DROPOUT)
        self.fc2 = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.log_softmax(self.fc2(self.dropout(F.relu(self.fc1(x)))), dim=1)


def synthetic(n: int, seed: int) -> TensorDataset:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=gen)
    y = (x[:, :4].argmax(dim=1) + (x[:, 4] > 1.0).long()) % 4
    return TensorDataset(torch.arange(n), x, y)


def train(model: nn.Module, loader: adaptdl.torch.AdaptiveDataLoader, optimizer, epoch: int):
    model.train()
    for index, data, target in loader:
        optimizer.zero_grad()
        loss = F.nll_loss(model(data), target)
        loss.backward()
        optimizer.step()
        record(
            epoch=epoch,
            index=adaptdl.torch.current_dataloader().current_index,
            indices=index.tolist(),
        )


def test(model: nn.Module, loader: adaptdl.torch.AdaptiveDataLoader, what: str, epoch) -> None:
    model.eval()
    stats = adaptdl.torch.Accumulator()
    with torch.no_grad():
        for _, data, target in loader:
            output = model(data)
            stats["loss"] += F.nll_loss(output, target, reduction="sum").item()
            stats["correct"] += output.argmax(dim=1).eq(target).sum().item()
            stats["count"] += len(target)
    with stats.synchronized():
        metric = {
            "what": what,
            "epoch": epoch,
            "count": stats["count"],
            "correct": stats["correct"],
            "loss": stats["loss"] / stats["count"],
        }
        print("METRIC " + json.dumps(metric), flush=True)


def optimise(model: nn.Module) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.StepLR]:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return optimizer, torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.8)


def main() -> None:
    torch.manual_seed(1)
    train_loader = adaptdl.torch.AdaptiveDataLoader(synthetic(N, 0), batch_size=16, shuffle=True)
    test_loader = adaptdl.torch.AdaptiveDataLoader(synthetic(N // 2, 1), batch_size=24)
    if not FSDP:
        train_loader.autoscale_batch_size(16, local_bsz_bounds=(4, 16))

    model = Net()
    if FSDP:
        adaptdl.torch.init_process_group("gloo")  # fully_shard needs the process group
        for module in (model.fc1, model.fc2, model):
            fully_shard(module)
        optimizer, scheduler = optimise(model)  # over the shards
        adapted = AdaptiveFSDP(model, optimizer, lr_scheduler=scheduler)
    else:
        optimizer, scheduler = optimise(model)
        adaptdl.torch.init_process_group("gloo")  # after the loaders: the tutorial's order
        adapted = adaptdl.torch.AdaptiveDataParallel(model, optimizer, scheduler)
    # DDP's wrapper is a module; AdaptiveFSDP hooks the sharded module itself, which
    # is then called directly (its train() and eval() included).
    runner = adapted if isinstance(adapted, nn.Module) else model

    for epoch in adaptdl.torch.remaining_epochs_until(EPOCHS):
        train(runner, train_loader, optimizer, epoch)
        test(runner, test_loader, "valid", epoch)
        scheduler.step()
    test(runner, test_loader, "test", None)  # after the epoch loop

    # Every replica gathers the full parameters (a collective under FSDP2).
    options = StateDictOptions(full_state_dict=True)
    digest = hashlib.sha256()
    for name, param in sorted(get_model_state_dict(model, options=options).items()):
        digest.update(name.encode())
        digest.update(param.detach().numpy().tobytes())
    print(f"PARAMS {digest.hexdigest()}", flush=True)


if __name__ == "__main__":
    main()
