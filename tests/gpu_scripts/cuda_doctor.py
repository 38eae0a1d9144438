"""A CUDA script with the free knobs left off, for the gpu-marked doctor test: a float32 conv net with an
attention layer (scaled_dot_product_attention), no autocast, TF32 off (the default "highest" matmul precision),
cudnn.benchmark off with a fixed input shape, and a loss.item() every step."""

import torch
import torch.nn.functional as F
from torch import nn


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Sequential(nn.Conv2d(3, 64, 3, padding=1), nn.ReLU(), nn.Conv2d(64, 64, 3, padding=1))
        self.qkv = nn.Linear(64, 3 * 64)
        self.head = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv(x).flatten(2).transpose(1, 2)  # (batch, tokens, 64)
        q, k, v = self.qkv(h).view(h.shape[0], h.shape[1], 3, 4, 16).permute(2, 0, 3, 1, 4)
        h = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(h.shape)
        return self.head(h.mean(dim=1))


torch.manual_seed(0)
model = Net().cuda()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
x, y = torch.randn(64, 3, 32, 32, device="cuda"), torch.randint(0, 10, (64,), device="cuda")
for _ in range(100_000):
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    last_loss = loss.item()
