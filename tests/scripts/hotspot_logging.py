"""A small CPU model whose loop logs its weights every step: the step is host-bound on formatting the log."""

import logging
import sys

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger("train")


def main() -> None:
    logging.basicConfig(filename=sys.argv[1], level=logging.INFO)
    torch.manual_seed(0)
    torch.set_num_threads(1)
    torch.set_printoptions(threshold=10_000)  # the whole weight matrix, as a verbose logger would
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    x, y = torch.randn(16, 32), torch.randint(0, 4, (16,))
    for step in range(100_000):
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        log.info("step %d weights %s", step, model[0].weight)


if __name__ == "__main__":
    main()
