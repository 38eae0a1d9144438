"""A well-configured CPU loop that reads the loss back with .item() every step (the habit that stalls a GPU)."""

import torch
import torch.nn.functional as F
from torch import nn


def main() -> None:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    x, y = torch.randn(512, 256), torch.randint(0, 4, (512,))
    losses = []
    for _ in range(100_000):
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())


if __name__ == "__main__":
    main()
