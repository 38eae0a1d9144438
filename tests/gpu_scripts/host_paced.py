"""A CUDA step whose GPU work is either tiny next to the host's (a forward that sleeps FORWARD_MS on the host around
a 64-wide layer: the GPU only follows the host) or large (HEAVY=1: 4096-wide matmuls at batch 4096 and no sleep),
with the loss read every step when ITEM=1 (a host sync) and never otherwise. For test_follow_gpu.py."""

import os
import time

import torch
from torch import nn

torch.manual_seed(0)
device = "cuda"
heavy = os.environ.get("HEAVY") == "1"
read_loss = os.environ.get("ITEM") == "1"
forward_s = float(os.environ.get("FORWARD_MS", "3")) / 1e3
width, batch = (4096, 4096) if heavy else (64, 32)


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.Linear(width, width), nn.GELU())
        self.head = nn.Linear(width, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not heavy:
            time.sleep(forward_s / 2)
        x = self.body(x)
        if not heavy:
            time.sleep(forward_s / 2)
        return self.head(x)


model = Model().to(device)
optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
x, y = torch.randn(batch, width, device=device), torch.randint(0, 10, (batch,), device=device)
for _ in range(int(os.environ.get("STEPS", "100000"))):
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if read_loss:
        loss.item()
