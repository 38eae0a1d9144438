"""Mixed precision on CPU: the forward pass under torch.autocast("cpu", dtype=torch.bfloat16).

The Dataset yields dicts, so the loader's batches are dicts of tensors.
"""

import argparse

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset


class DictDataset(Dataset):
    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 32, generator=g)
        self.y = torch.randint(0, 8, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return {"features": self.x[i], "label": self.y[i]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--epochs", type=int, default=1000)
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)

    loader = DataLoader(DictDataset(256), batch_size=args.batch_size, shuffle=True)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 8))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    for _ in range(args.epochs):
        for batch in loader:
            x, y = batch["features"], batch["label"]
            optimizer.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logits = model(x)
                loss = F.cross_entropy(logits.float(), y)
            loss.backward()
            optimizer.step()


if __name__ == "__main__":
    main()
