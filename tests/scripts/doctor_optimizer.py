"""Optimizer-bound on CPU: 600 small parameter tensors, joined by one cat in forward, updated by Adam's
per-parameter loop (foreach=False): the optimizer step dominates the step."""

import torch
from torch import nn


def main() -> None:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    params = nn.ParameterList(nn.Parameter(torch.randn(32)) for _ in range(600))
    optimizer = torch.optim.Adam(params.parameters(), lr=1e-3, foreach=False)
    for _ in range(100_000):
        optimizer.zero_grad()
        loss = torch.cat(list(params)).square().mean()
        loss.backward()
        optimizer.step()


if __name__ == "__main__":
    main()
