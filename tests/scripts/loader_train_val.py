"""A training script with two loaders: a validation loader (256 samples) built first, then a train loader.

Every sample busy-waits --sample-ms in __getitem__ (CPU-bound work, like decoding), or with --sleep sleeps that long
(I/O-bound work, like reading from storage). `stepscope dataloader` should
measure the largest loader (the train one) at its first iteration and stop the script before it trains; the line
"loader_train_val: trained" is printed only after training.
"""

import argparse
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset


class BusyDataset(Dataset):
    def __init__(self, n: int, sample_ms: float, sleep: bool = False) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 16, generator=g)
        self.y = torch.randint(0, 4, (n,), generator=g)
        self.sample_s = sample_ms / 1000
        self.sleep = sleep

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        if self.sleep:
            time.sleep(self.sample_s)
            return self.x[i], self.y[i]
        end = time.perf_counter() + self.sample_s
        while time.perf_counter() < end:
            pass
        return self.x[i], self.y[i]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sample-ms", type=float, default=0.5)
    parser.add_argument("--sleep", action="store_true", help="samples sleep (I/O-bound) instead of busy-waiting")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--num-workers", type=int, default=0)
    parser.add_argument("--train-samples", type=int, default=4096)
    parser.add_argument("--val-samples", type=int, default=256)
    parser.add_argument("--validate-first", action="store_true", help="iterate the val loader before training")
    parser.add_argument("--epochs", type=int, default=2)
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)

    val = DataLoader(BusyDataset(args.val_samples, args.sample_ms, args.sleep), batch_size=args.batch_size)
    train = DataLoader(
        BusyDataset(args.train_samples, args.sample_ms, args.sleep),
        batch_size=args.batch_size,
        shuffle=True,
        num_workers=args.num_workers,
        drop_last=True,
    )
    print(f"loader_train_val: built val={len(val.dataset)} train={len(train.dataset)}", flush=True)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)

    def validate() -> float:
        with torch.no_grad():
            return sum(F.cross_entropy(model(x), y).item() for x, y in val)

    if args.validate_first:
        print(f"loader_train_val: validated {validate():.3f}", flush=True)
    for _ in range(args.epochs):
        for x, y in train:
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
        validate()
    print("loader_train_val: trained", flush=True)


if __name__ == "__main__":
    main()
