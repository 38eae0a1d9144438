"""Logs the loss with loss.item() every step: one host read-back per step.

--tolist adds a second read-back per step (predictions.tolist()); --item-in-dataset makes the Dataset call .item()
in __getitem__, which is data loading, not a read-back of the training step.
"""

import argparse

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset


class ItemDataset(Dataset):
    def __init__(self, n: int, item_in_getitem: bool) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 16, generator=g)
        self.y = torch.randint(0, 4, (n,), generator=g)
        self.item_in_getitem = item_in_getitem

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        y = self.y[i]
        if self.item_in_getitem:
            y = int(y.item())
        return self.x[i], y


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--epochs", type=int, default=1000)
    parser.add_argument("--tolist", action="store_true")
    parser.add_argument("--item-in-dataset", action="store_true")
    parser.add_argument("--samples", type=int, default=512, help="dataset size (small: many epochs)")
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)

    loader = DataLoader(ItemDataset(args.samples, args.item_in_dataset), batch_size=args.batch_size, shuffle=True)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    running = 0.0
    for _ in range(args.epochs):
        for x, y in loader:
            optimizer.zero_grad()
            logits = model(x)
            loss = F.cross_entropy(logits, y)
            loss.backward()
            optimizer.step()
            running += loss.item()
            if args.tolist:
                predictions = logits.argmax(1).tolist()
                assert len(predictions) == len(x)


if __name__ == "__main__":
    main()
