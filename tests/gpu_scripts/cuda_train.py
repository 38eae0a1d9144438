"""A CUDA training script for the gpu-marked run test: pinned loader batches copied with non_blocking, a model
big enough that the GPU has real work, and a loss.item() every step (a host sync)."""

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

torch.manual_seed(0)
device = "cuda"
data = TensorDataset(torch.randn(4096, 1024), torch.randint(0, 10, (4096,)))
loader = DataLoader(data, batch_size=256, shuffle=True, pin_memory=True)
layers = [nn.Linear(1024, 4096), nn.GELU(), nn.Linear(4096, 4096), nn.GELU(), nn.Linear(4096, 10)]
model = nn.Sequential(*layers).to(device)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
for _epoch in range(100):
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        last_loss = loss.item()
