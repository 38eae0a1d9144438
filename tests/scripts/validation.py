"""A compute-bound training loop that validates every --val-every steps, with known times.

The model's forward sleeps --forward-ms (compute with ground truth that load cannot change much); a validation
pass runs --val-batches forwards under torch.no_grad. --where says where it runs: "end" (after optimizer.step,
from a validation DataLoader), "start" (between the training batch's fetch and its forward), "tensors" (after the
step, on tensors already in memory: no loader), "train-batches" (after the step, on the training loader's next
batches: no loader of its own). --teacher adds a frozen teacher's forward without gradients to
every training step (part of the step: it must not be read as validation).
"""

import argparse
import itertools

import torch
import torch.nn.functional as F
from sleepy import Sleepy
from torch.utils.data import DataLoader, TensorDataset


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--iters", type=int, default=100_000)
    parser.add_argument("--forward-ms", type=float, default=8.0)
    parser.add_argument("--val-every", type=int, default=10)
    parser.add_argument("--val-batches", type=int, default=30)
    parser.add_argument("--where", choices=["end", "start", "tensors", "train-batches"], default="end")
    parser.add_argument("--teacher", action="store_true")
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    rows = 8 * 400 if args.where == "train-batches" else 512  # validation takes batches of the epoch too
    train = DataLoader(TensorDataset(torch.randn(rows, 16), torch.randint(0, 4, (rows,))), batch_size=8, shuffle=True)
    val = DataLoader(TensorDataset(torch.randn(8 * args.val_batches, 16), torch.zeros(8 * args.val_batches)), 8)
    held_out = [torch.randn(8, 16) for _ in range(args.val_batches)]
    model = Sleepy(args.forward_ms)
    teacher = Sleepy(args.forward_ms / 2).eval()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

    def validate() -> float:
        model.eval()
        total = 0.0
        with torch.no_grad():
            if args.where == "tensors":
                batches = held_out
            elif args.where == "train-batches":
                batches = (x for x, _ in itertools.islice(epoch, args.val_batches))
            else:
                batches = (x for x, _ in val)
            for x in batches:
                total += float(model(x).sum())
        model.train()
        return total

    step = 0
    while step < args.iters:
        epoch = iter(train)
        for x, y in epoch:
            if args.where == "start" and step % args.val_every == 0:
                validate()
            if args.teacher:
                with torch.no_grad():
                    target = teacher(x).argmax(dim=1)
                y = target
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            step += 1
            if args.where != "start" and step % args.val_every == 0:
                validate()
            if step == args.iters:
                break


if __name__ == "__main__":
    main()
