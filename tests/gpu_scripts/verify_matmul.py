"""A float32 MLP of large matmuls on CUDA, TF32 off (the default "highest" matmul precision) and no autocast: the
step is tensor-core bound, so `doctor --verify --allow-numerics` should measure tf32 and bf16 autocast as faster."""

import torch
import torch.nn.functional as F
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4096, 4096), nn.GELU(), nn.Linear(4096, 4096), nn.GELU(), nn.Linear(4096, 16)).cuda()
optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
x, y = torch.randn(2048, 4096, device="cuda"), torch.randint(0, 16, (2048,), device="cuda")
for _ in range(100_000):
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
