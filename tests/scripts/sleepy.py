"""A model whose forward sleeps a known time (ground truth that load can lengthen, never shorten): imported by the
test scripts beside it (a script's own folder is on its sys.path)."""

import time

import torch
from torch import nn


class Sleepy(nn.Module):
    def __init__(self, forward_ms: float) -> None:
        super().__init__()
        self.linear = nn.Linear(16, 4)
        self.forward_s = forward_ms / 1e3

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.forward_s)
        return self.linear(x)
