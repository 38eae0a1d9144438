"""A training loop whose every step also runs --side-forwards forwards of a second model without gradients (a
metric, a reference model, an EMA check) --where: "after" the optimizer step, or "before" the training forward.
Every forward sleeps a known time (--forward-ms for the model, --side-ms for the second one), so the step's figures
have ground truth. With --val-every K it also validates every K steps over its own loader (--val-batches batches),
or with --val-source train over the training loader's next batches: that is validation. The script keeps its own
timer: each step's end (perf_counter) and the time its own validation took, written as JSON to --timer at exit."""

import argparse
import atexit
import itertools
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from sleepy import Sleepy
from torch.utils.data import DataLoader, TensorDataset


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--iters", type=int, default=100_000)
    parser.add_argument("--forward-ms", type=float, default=4.0)
    parser.add_argument("--side-ms", type=float, default=1.0)
    parser.add_argument("--side-forwards", type=int, default=6)
    parser.add_argument("--where", choices=["after", "before"], default="after")
    parser.add_argument("--val-every", type=int, default=0)
    parser.add_argument("--val-batches", type=int, default=5)
    parser.add_argument("--val-source", choices=["loader", "train"], default="loader")
    parser.add_argument("--timer", default=None)
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    rows = 8 * 400 if args.val_source == "train" else 512  # validation takes batches of the epoch too
    train = DataLoader(TensorDataset(torch.randn(rows, 16), torch.randint(0, 4, (rows,))), batch_size=8, shuffle=True)
    val = DataLoader(TensorDataset(torch.randn(8 * args.val_batches, 16)), batch_size=8)
    model, side = Sleepy(args.forward_ms), Sleepy(args.side_ms)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    ends: list[float] = []
    val_s: list[float] = []
    if args.timer:
        atexit.register(lambda: Path(args.timer).write_text(json.dumps({"ends": ends, "val_s": val_s})))

    def side_work(x: torch.Tensor) -> None:
        with torch.no_grad():
            for _ in range(args.side_forwards):
                side(x)

    step = 0
    while step < args.iters:
        epoch = iter(train)
        for x, y in epoch:
            if args.where == "before":
                side_work(x)
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            if args.where == "after":
                side_work(x)
            step += 1
            spent = 0.0
            if args.val_every and step % args.val_every == 0:
                t0 = time.perf_counter()
                model.eval()
                batches = (
                    b[0] for b in (itertools.islice(epoch, args.val_batches) if args.val_source == "train" else val)
                )
                with torch.no_grad():
                    for v in batches:
                        model(v)
                model.train()
                spent = time.perf_counter() - t0
            ends.append(time.perf_counter())
            val_s.append(spent)
            if step == args.iters:
                break


if __name__ == "__main__":
    main()
