"""A GAN in the seed project's DCGAN example style: two AdaptiveDataParallel models, one job.

The discriminator and the generator each have their own optimiser and LR scheduler
and are named by keyword; every batch steps both. The loader autoscales, so an
epoch ends by the job's progress: it must still consume every sample once, since
the two models make one step of progress per batch between them. Synthetic data:
2-D points on a ring, with each sample's own latent noise (so that the run does
not depend on the random state). Each epoch prints ``METRIC {json}`` with the
per-sample losses and how many samples it saw.
"""

from __future__ import annotations

import json
import math

from seed_common import EPOCHS, N, record
from torch.utils.data import TensorDataset

import adaptdl
import adaptdl.torch as adl
import torch
from torch import nn

NZ = 4


def ring(n: int) -> TensorDataset:
    gen = torch.Generator().manual_seed(3)
    angle = torch.rand(n, generator=gen) * 2 * math.pi
    points = torch.stack([angle.cos(), angle.sin()], dim=1) + 0.05 * torch.randn(
        n, 2, generator=gen
    )
    noise = torch.randn(n, NZ, generator=gen)
    return TensorDataset(torch.arange(n), points, noise)


class Generator(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.main = nn.Sequential(nn.Linear(NZ, 16), nn.ReLU(True), nn.Linear(16, 2))

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return self.main(input)


class Discriminator(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.main = nn.Sequential(
            nn.Linear(2, 16), nn.LeakyReLU(0.2, inplace=True), nn.Linear(16, 1), nn.Sigmoid()
        )

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return self.main(input)


torch.manual_seed(999)
netG = Generator()
netD = Discriminator()
criterion = nn.BCELoss()
real_label = 1.0
fake_label = 0.0
optimizerD = torch.optim.SGD(netD.parameters(), lr=0.05, momentum=0.9, nesterov=True)
optimizerG = torch.optim.SGD(netG.parameters(), lr=0.05, momentum=0.9, nesterov=True)
scheduleD = torch.optim.lr_scheduler.StepLR(optimizerD, 2, 0.5)
scheduleG = torch.optim.lr_scheduler.StepLR(optimizerG, 2, 0.5)

adaptdl.torch.init_process_group("gloo")
netD = adl.AdaptiveDataParallel(netD, optimizerD, scheduleD, name="netD")
netG = adl.AdaptiveDataParallel(netG, optimizerG, scheduleG, name="netG")

dataloader = adl.AdaptiveDataLoader(ring(N), batch_size=16, shuffle=True)
dataloader.autoscale_batch_size(16, local_bsz_bounds=(4, 16))


def train(epoch: int) -> None:
    stats = adl.Accumulator()
    for _i, (index, real, noise) in enumerate(dataloader, 0):
        # (1) Update D: maximize log(D(x)) + log(1 - D(G(z)))
        netD.zero_grad()
        b_size = real.size(0)
        label = torch.full((b_size,), real_label)
        output = netD(real).view(-1)
        errD_real = criterion(output, label)
        errD_real.backward()
        fake = netG(noise)
        label.fill_(fake_label)
        output = netD(fake.detach()).view(-1)
        errD_fake = criterion(output, label)
        errD_fake.backward()
        errD = errD_real + errD_fake
        optimizerD.step()
        # (2) Update G: maximize log(D(G(z)))
        netG.zero_grad()
        label.fill_(real_label)
        output = netD(fake).view(-1)
        errG = criterion(output, label)
        errG.backward()
        optimizerG.step()

        stats["g_loss_sum"] += errG.item() * b_size
        stats["d_loss_sum"] += errD.item() * b_size
        stats["samples"] += b_size
        record(epoch=epoch, index=adl.current_dataloader().current_index, indices=index.tolist())
    scheduleD.step()
    scheduleG.step()
    with stats.synchronized():
        metric = {
            "epoch": epoch,
            "samples": stats["samples"],
            "g_loss": stats["g_loss_sum"] / stats["samples"],
            "d_loss": stats["d_loss_sum"] / stats["samples"],
            "progress": netD.progress,
        }
        print("METRIC " + json.dumps(metric), flush=True)


for epoch in adl.remaining_epochs_until(EPOCHS):
    train(epoch)
