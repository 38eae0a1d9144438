"""Backward passes with no model to audit: --mode none uses no nn.Module at all, --mode empty a module with no
parameters (nn.Tanh on a leaf tensor that requires grad)."""

import argparse

import torch
from torch import nn


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=("none", "empty"), default="none")
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    w = torch.randn(4, 4, requires_grad=True)
    layer = nn.Sequential(nn.Tanh())
    optimizer = torch.optim.SGD([w], lr=0.1)
    x = torch.randn(8, 4)
    for _ in range(5):
        optimizer.zero_grad()
        h = x @ w
        if args.mode == "empty":
            h = layer(h)
        h.square().mean().backward()
        optimizer.step()
    print("params_no_params: done")


if __name__ == "__main__":
    main()
