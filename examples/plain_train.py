"""An ordinary CPU training script with no stepscope in it, and a deliberately slow input pipeline.

Each sample takes --sample-ms milliseconds to load (a sleep standing in for decoding and augmentation), so with
16 samples per batch and no loader workers the step waits ~32 ms for data while the model computes in ~1-2 ms.
Profile it without changing a line:

    stepscope run examples/plain_train.py            # the table should name the input pipeline (bound: data)
    stepscope run examples/plain_train.py --num-workers 2
"""

import argparse
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset


class SlowDataset(Dataset):
    """Random features and labels; each __getitem__ takes `sample_ms` milliseconds."""

    def __init__(self, size: int, sample_ms: float) -> None:
        self.size = size
        self.sample_s = sample_ms / 1e3

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        time.sleep(self.sample_s)
        generator = torch.Generator().manual_seed(index)
        return torch.randn(64, generator=generator), torch.tensor(index % 10)


def main() -> None:
    parser = argparse.ArgumentParser(description="a small training script with a slow loader")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--sample-ms", type=float, default=2.0)
    parser.add_argument("--num-workers", type=int, default=0)
    args = parser.parse_args()

    torch.manual_seed(0)
    loader = DataLoader(SlowDataset(1024, args.sample_ms), batch_size=args.batch_size, num_workers=args.num_workers)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for epoch in range(args.epochs):
        total = 0.0
        for x, y in loader:
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            total += loss.item()
        print(f"epoch {epoch}: mean loss {total / len(loader):.4f}")


if __name__ == "__main__":
    main()
