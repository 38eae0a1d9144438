"""A tiny training loop whose every step also sleeps AB_SLEEP_MS milliseconds (environment, default 10): two
variants that differ only in that variable differ in step time by a known amount.

--exit-code N exits with N at once, before importing torch (a variant that fails). With AB_SLEEP_LOG set, the
process appends the seconds each step's sleep took, as a JSON list, to that file when it exits: beside busy loops a
sleep lasts longer than asked, and a test compares the A/B with what the sleeps took.
"""

import argparse
import atexit
import json
import os
import sys
import time


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--iters", type=int, default=10_000)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--exit-code", type=int, default=0)
    args = parser.parse_args()
    if args.exit_code:
        print(f"ab_sleep: failing with exit code {args.exit_code}", file=sys.stderr, flush=True)
        sys.exit(args.exit_code)
    sleep_s = float(os.environ.get("AB_SLEEP_MS", "10")) / 1000
    slept: list[float] = []
    log = os.environ.get("AB_SLEEP_LOG")
    if log:
        atexit.register(_append, log, slept)  # stepscope ends the run with SystemExit: exit handlers run

    import torch
    import torch.nn.functional as F
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    torch.manual_seed(0)
    torch.set_num_threads(1)
    data = TensorDataset(torch.randn(64, 8), torch.randint(0, 2, (64,)))
    loader = DataLoader(data, batch_size=args.batch_size, drop_last=True)
    model = nn.Linear(8, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    step = 0
    while step < args.iters:
        for x, y in loader:
            F.cross_entropy(model(x), y).backward()
            start = time.perf_counter()
            time.sleep(sleep_s)
            slept.append(time.perf_counter() - start)
            optimizer.step()
            optimizer.zero_grad()
            step += 1


def _append(path: str, slept: list[float]) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(slept) + "\n")


if __name__ == "__main__":
    main()
