"""A float32 conv net on CUDA with a fixed input shape and cudnn.benchmark explicitly off: `doctor --verify` should
measure cudnn.benchmark (cuDNN times its algorithms once per shape, then keeps the fastest)."""

import torch
import torch.nn.functional as F
from torch import nn

torch.backends.cudnn.benchmark = False
torch.set_float32_matmul_precision("high")  # TF32 on: cudnn.benchmark is then the free knob left
torch.manual_seed(0)
model = nn.Sequential(
    nn.Conv2d(3, 96, 5, padding=2), nn.ReLU(), nn.Conv2d(96, 96, 5, padding=2, dilation=1), nn.ReLU(),
    nn.Conv2d(96, 160, 3, padding=1, stride=2), nn.ReLU(), nn.Conv2d(160, 160, 7, padding=3), nn.ReLU(),
    nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(160, 10),
).cuda()  # fmt: skip
optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
x, y = torch.randn(64, 3, 96, 96, device="cuda"), torch.randint(0, 10, (64,), device="cuda")
for _ in range(100_000):
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
