"""A plain, complete training loop (DataLoader, forward, backward, clip, step, zero_grad) that reports how it was run.

It prints its __name__, argv and --tag to stdout and one line to stderr, trains --iters optimizer steps, prints
"basic: done after N steps" and exits with --exit-code.
"""

import argparse
import sys

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--iters", type=int, default=100_000)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--tag", default="none")
    parser.add_argument("--exit-code", type=int, default=0)
    parser.add_argument("--clip", choices=["norm", "value"], default="norm")
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)

    print(f"basic: __name__={__name__} argv0={sys.argv[0]} tag={args.tag}", flush=True)
    print("basic: a line on stderr", file=sys.stderr, flush=True)
    data = TensorDataset(torch.randn(256, 16), torch.randint(0, 4, (256,)))
    loader = DataLoader(data, batch_size=args.batch_size, shuffle=True, drop_last=True)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    step = 0
    while step < args.iters:
        for x, y in loader:
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            if args.clip == "norm":
                nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            else:
                nn.utils.clip_grad_value_(model.parameters(), 0.5)
            optimizer.step()
            optimizer.zero_grad()
            step += 1
            if step == args.iters:
                break
    print(f"basic: done after {step} steps", flush=True)
    sys.exit(args.exit_code)


if __name__ == "__main__":
    main()
