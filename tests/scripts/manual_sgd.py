"""No optimizer object at all (or one that never steps): parameters are updated by hand after each backward."""

import argparse

import torch
import torch.nn.functional as F
from torch import nn


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--iters", type=int, default=100_000)
    parser.add_argument("--autograd-backward", action="store_true", help="torch.autograd.backward(loss)")
    parser.add_argument("--unused-optimizer", action="store_true", help="make an SGD that never steps")
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)

    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    x = torch.randn(args.batch_size, 16)
    y = torch.randint(0, 4, (args.batch_size,))
    lr = args.lr
    if args.unused_optimizer:  # only its learning rate is read, as a schedule's scripts do
        lr = torch.optim.SGD(model.parameters(), lr=lr).param_groups[0]["lr"]
    for _ in range(args.iters):
        loss = F.cross_entropy(model(x), y)
        if args.autograd_backward:
            torch.autograd.backward(loss)
        else:
            loss.backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= lr * p.grad
                p.grad = None


if __name__ == "__main__":
    main()
