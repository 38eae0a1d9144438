"""A small CPU model whose loop saves a checkpoint every step: the step is host-bound on the save."""

import argparse
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn


def save_checkpoint(state: dict, path: Path, sleep_ms: float) -> None:
    if sleep_ms:
        time.sleep(sleep_ms / 1000)  # stands in for a slow filesystem, with a known cost
    else:
        torch.save(state, path)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sleep-ms", type=float, default=0.0, help="sleep instead of torch.save")
    parser.add_argument("--mb", type=float, default=4.0, help="checkpoint size (MB of float32)")
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    ballast = torch.zeros(int(args.mb * 2**20 / 4))  # the rest of the state a real checkpoint carries
    x, y = torch.randn(16, 32), torch.randint(0, 4, (16,))
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "ckpt.pt"
        for step in range(100_000):
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            save_checkpoint({"model": model.state_dict(), "ballast": ballast, "step": step}, path, args.sleep_ms)


if __name__ == "__main__":
    main()
