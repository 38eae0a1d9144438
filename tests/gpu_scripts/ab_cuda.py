"""A CUDA training loop whose batch size is AB_BATCH (environment, default 256), for the gpu-marked A/B test:
two variants that differ only in the batch differ in device memory and must be warned about."""

import os

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

torch.manual_seed(0)
batch = int(os.environ.get("AB_BATCH", "256"))
data = TensorDataset(torch.randn(8192, 1024), torch.randint(0, 10, (8192,)))
loader = DataLoader(data, batch_size=batch, shuffle=True, pin_memory=True, drop_last=True)
model = nn.Sequential(nn.Linear(1024, 4096), nn.GELU(), nn.Linear(4096, 4096), nn.GELU(), nn.Linear(4096, 10)).cuda()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
for _epoch in range(1000):
    for x, y in loader:
        x, y = x.cuda(non_blocking=True), y.cuda(non_blocking=True)
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss.item()
