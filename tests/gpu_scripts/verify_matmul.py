"""A float32 MLP of large matmuls on CUDA, TF32 off (the default "highest" matmul precision) and no autocast: the
step is tensor-core bound, so `doctor --verify --allow-numerics` should measure tf32 and bf16 autocast as faster.

It never waits for the GPU (the data is made on the device, the loss never read): the host queues a step in a few
ms while the GPU runs it in ~7 ms at the default batch of 2048 (~14 ms at MATMUL_BATCH=4096, on an H200), so the
host runs ahead of the GPU for a short measured window unless something syncs each step."""

import os

import torch
import torch.nn.functional as F
from torch import nn

torch.manual_seed(0)
batch = int(os.environ.get("MATMUL_BATCH", "2048"))
model = nn.Sequential(nn.Linear(4096, 4096), nn.GELU(), nn.Linear(4096, 4096), nn.GELU(), nn.Linear(4096, 16)).cuda()
optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
x, y = torch.randn(batch, 4096, device="cuda"), torch.randint(0, 16, (batch,), device="cuda")
for _ in range(100_000):
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
