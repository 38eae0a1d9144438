"""A plain CPU training script for overhead benchmarks: DataLoader over in-memory tensors, a small MLP built from
several modules, AdamW, gradient clipping, and a loss.item() per step (as most scripts log).

    python bench/workloads/cpu_train.py --steps 500
"""

import argparse

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=500)
parser.add_argument("--batch-size", type=int, default=64)
args = parser.parse_args()

torch.manual_seed(0)
torch.set_num_threads(1)
data = TensorDataset(
    torch.randn(args.steps * args.batch_size, 256), torch.randint(0, 10, (args.steps * args.batch_size,))
)
loader = DataLoader(data, batch_size=args.batch_size, shuffle=True)
blocks = [nn.Sequential(nn.Linear(256, 256), nn.LayerNorm(256), nn.GELU()) for _ in range(4)]
model = nn.Sequential(*blocks, nn.Linear(256, 10))
criterion = nn.CrossEntropyLoss()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
total = 0.0
for x, y in loader:
    loss = criterion(model(x), y)
    loss.backward()
    nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    total += loss.item()
print(f"mean loss {total / args.steps:.4f}")
