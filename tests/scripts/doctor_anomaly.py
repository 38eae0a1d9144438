"""A small MLP trained with autograd anomaly detection left on (a debugging switch that slows both passes)."""

import torch
import torch.nn.functional as F
from torch import nn


def main() -> None:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    torch.autograd.set_detect_anomaly(True)
    model = nn.Sequential(*[m for _ in range(8) for m in (nn.Linear(64, 64), nn.ReLU())], nn.Linear(64, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, fused=True)
    x, y = torch.randn(32, 64), torch.randint(0, 4, (32,))
    for _ in range(100_000):
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()


if __name__ == "__main__":
    main()
