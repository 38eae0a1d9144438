"""A torch.compile'd model with a frozen stem and a head that is never called."""

import torch
import torch.nn.functional as F
from torch import nn


class Small(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(8, 16)
        self.stem.requires_grad_(False)
        self.body = nn.Linear(16, 16)
        self.head = nn.Linear(16, 4)
        self.aux_head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.body(self.stem(x))))


def main() -> None:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = torch.compile(Small())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(8, 8)
    y = torch.randint(0, 4, (8,))
    for _ in range(20):
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
    print("params_compiled: done")


if __name__ == "__main__":
    main()
