"""A training loop with a hand-rolled batch source (nanoGPT-style get_batch()): no torch DataLoader anywhere.

`stepscope dataloader` has nothing to capture: it must say so and point at the library API
(stepscope.measure_loader) instead.
"""

import argparse

import torch
from torch import nn


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--accum", type=int, default=1, help="micro-batches (forward + backward) per optimizer step")
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    data = torch.randn(1024, 16)
    labels = torch.randint(0, 4, (1024,))

    def get_batch(batch_size: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
        index = torch.randint(0, len(data), (batch_size,))
        return data[index], labels[index]

    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    criterion = nn.CrossEntropyLoss()  # a module: the tracker sees its call as a second forward
    for _ in range(args.steps):
        optimizer.zero_grad()
        for _ in range(args.accum):
            x, y = get_batch()
            criterion(model(x), y).backward()
        optimizer.step()
    print(f"loader_none: done after {args.steps} steps", flush=True)


if __name__ == "__main__":
    main()
