"""A training loop with three independent slow-downs, each a setting `--apply` can undo: anomaly detection left on
(debug.anomaly), Adam stepping 300 small parameters one by one (foreach=False: optimizer.foreach or .fused), and a
DataLoader without workers whose samples each wait --sample-ms on a read (loader.num_workers).

    python bench/workloads/three_slowdowns.py [--sample-ms 1.0] [--batch-size 8]
"""

import argparse
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset


class ReadDataset(Dataset):
    def __init__(self, n: int, sample_s: float) -> None:
        self.n, self.sample_s = n, sample_s

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        time.sleep(self.sample_s)
        return torch.full((32,), float(i % 5)), i % 4


class ManyParams(nn.Module):
    """A small MLP beside 300 small parameter tensors that reach the loss through one op: the optimizer's
    per-parameter loop is much of its step, while anomaly mode's per-op cost stays that of a few ops."""

    def __init__(self) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))
        self.extra = nn.ParameterList(nn.Parameter(torch.zeros(16)) for _ in range(300))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(x) + torch.stack(list(self.extra)).mean()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sample-ms", type=float, default=1.0)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--epochs", type=int, default=1000)
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.autograd.set_detect_anomaly(True)  # left on from a debugging session
    loader = DataLoader(ReadDataset(2048, args.sample_ms / 1000), batch_size=args.batch_size)
    model = ManyParams()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, foreach=False)
    for _ in range(args.epochs):
        for x, y in loader:
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()


if __name__ == "__main__":
    main()
