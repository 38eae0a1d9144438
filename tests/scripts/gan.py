"""A GAN: each iteration steps the discriminator's optimizer, then the generator's."""

import argparse

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--epochs", type=int, default=1000)
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)

    real_data = TensorDataset(torch.randn(256, 8) * 0.5 + 1.0)
    loader = DataLoader(real_data, batch_size=args.batch_size, shuffle=True, drop_last=True)
    generator = nn.Sequential(nn.Linear(4, 32), nn.ReLU(), nn.Linear(32, 8))
    discriminator = nn.Sequential(nn.Linear(8, 32), nn.LeakyReLU(0.2), nn.Linear(32, 1))
    opt_d = torch.optim.Adam(discriminator.parameters(), lr=2e-4, betas=(0.5, 0.999))
    opt_g = torch.optim.Adam(generator.parameters(), lr=2e-4, betas=(0.5, 0.999))
    for _ in range(args.epochs):
        for (real,) in loader:
            n = real.shape[0]
            ones, zeros = torch.ones(n, 1), torch.zeros(n, 1)

            opt_d.zero_grad()
            fake = generator(torch.randn(n, 4))
            loss_d = F.binary_cross_entropy_with_logits(discriminator(real), ones) + F.binary_cross_entropy_with_logits(
                discriminator(fake.detach()), zeros
            )
            loss_d.backward()
            opt_d.step()

            opt_g.zero_grad()
            loss_g = F.binary_cross_entropy_with_logits(discriminator(fake), ones)
            loss_g.backward()
            opt_g.step()


if __name__ == "__main__":
    main()
