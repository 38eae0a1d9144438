"""A CUDA loop that never waits for the GPU: the data is made on the device and the loss is never read. Its float32
4096-wide matmuls (TF32 off) take the GPU ~10 ms a step while the host queues them in well under 1 ms, so the host
runs ahead of the GPU for the whole measured window unless something syncs each step."""

import torch
import torch.nn.functional as F
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4096, 4096), nn.GELU(), nn.Linear(4096, 4096), nn.GELU(), nn.Linear(4096, 16)).cuda()
optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
x, y = torch.randn(4096, 4096, device="cuda"), torch.randint(0, 16, (4096,), device="cuda")
for _ in range(100_000):
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
