"""A loader that does CPU work: each sample burns --sample-cpu-ms of CPU time (a stand-in for decoding and
augmentation) and sleeps --sample-sleep-ms (a stand-in for a read), in --num-workers processes beside a model
whose forward and backward run on torch's intra-op threads (--threads; 0 leaves torch's default, one per core)."""

import argparse
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset


class CpuDataset(Dataset):
    def __init__(self, n: int, cpu_ms: float, sleep_ms: float) -> None:
        self.n = n
        self.cpu_s = cpu_ms / 1000
        self.sleep_s = sleep_ms / 1000

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        if self.sleep_s:
            time.sleep(self.sleep_s)
        end = time.thread_time() + self.cpu_s  # CPU time, not wall time: it takes longer when the cores are shared
        x = 0
        while time.thread_time() < end:
            x += 1
        return torch.full((256,), float(i % 7)), i % 4


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sample-cpu-ms", type=float, default=0.5)
    parser.add_argument("--sample-sleep-ms", type=float, default=0.0)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--num-workers", type=int, default=0)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--epochs", type=int, default=1000)
    args = parser.parse_args()
    torch.manual_seed(0)
    if args.threads:
        torch.set_num_threads(args.threads)

    loader = DataLoader(
        CpuDataset(4096, args.sample_cpu_ms, args.sample_sleep_ms),
        batch_size=args.batch_size,
        num_workers=args.num_workers,
        persistent_workers=args.num_workers > 0,
    )
    model = nn.Sequential(
        nn.Linear(256, args.width), nn.ReLU(), nn.Linear(args.width, args.width), nn.ReLU(), nn.Linear(args.width, 4)
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(args.epochs):
        for x, y in loader:
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()


if __name__ == "__main__":
    main()
