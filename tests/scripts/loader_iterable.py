"""A DataLoader over an IterableDataset (no __len__) that splits its stream across workers with get_worker_info().

Every sample busy-waits --sample-ms. "loader_iterable: trained" is printed only after training.
"""

import argparse
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, get_worker_info


class BusyStream(IterableDataset):
    def __init__(self, n: int, sample_ms: float) -> None:
        self.n = n
        self.sample_s = sample_ms / 1000

    def __iter__(self):
        info = get_worker_info()
        start, step = (0, 1) if info is None else (info.id, info.num_workers)
        for i in range(start, self.n, step):
            end = time.perf_counter() + self.sample_s
            while time.perf_counter() < end:
                pass
            yield torch.full((16,), float(i)), i % 4


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sample-ms", type=float, default=0.5)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--samples", type=int, default=4096)
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    loader = DataLoader(BusyStream(args.samples, args.sample_ms), batch_size=args.batch_size)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    for x, y in loader:
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
    print("loader_iterable: trained", flush=True)


if __name__ == "__main__":
    main()
