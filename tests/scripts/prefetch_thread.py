"""A loop fed by a prefetcher thread, as prefetch_generator's BackgroundGenerator feeds one: a thread iterates a
DataLoader whose Dataset sleeps --sample-ms per sample (and runs a transform module) and hands the batches over
through a queue.Queue. The training thread's forward sleeps --forward-ms inside a module. A third thread calls a
small model every millisecond (a metrics thread). Known answers: the training thread's wait for data is its wait in
``queue.get``, its forward is its forward, and a batch is --batch-size samples.

With --timers PATH the script writes its own timers there, a JSON line per iteration: the training thread's wait in
``queue.get`` and its forward (s). With --device cuda the training thread copies each batch to the GPU.
"""

import argparse
import json
import queue
import threading
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset


class SleepyDataset(Dataset):
    def __init__(self, sample_ms: float) -> None:
        self.sample_s = sample_ms / 1e3
        self.transform = nn.Identity()

    def __len__(self) -> int:
        return 100_000

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        time.sleep(self.sample_s)
        return self.transform(torch.randn(8)), torch.tensor(index % 2)


class SleepyForward(nn.Module):
    def __init__(self, forward_ms: float) -> None:
        super().__init__()
        self.forward_s = forward_ms / 1e3
        self.linear = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.forward_s)
        return self.linear(x)


def produce(loader: DataLoader, handover: queue.Queue, stop: threading.Event) -> None:
    for batch in loader:
        while not stop.is_set():
            try:
                handover.put(batch, timeout=0.05)
                break
            except queue.Full:
                continue
        if stop.is_set():
            return


def metrics(stop: threading.Event) -> None:
    probe = nn.Linear(8, 1)
    x = torch.randn(2, 8)
    while not stop.wait(0.001):
        with torch.no_grad():
            probe(x)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--iters", type=int, default=10_000)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--sample-ms", type=float, default=2.0)
    parser.add_argument("--forward-ms", type=float, default=3.0)
    parser.add_argument("--timers")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    loader = DataLoader(SleepyDataset(args.sample_ms), batch_size=args.batch_size)
    handover: queue.Queue = queue.Queue(maxsize=2)
    stop = threading.Event()
    threads = [
        threading.Thread(target=produce, args=(loader, handover, stop), daemon=True),
        threading.Thread(target=metrics, args=(stop,), daemon=True),
    ]
    for thread in threads:
        thread.start()
    model = SleepyForward(args.forward_ms).to(args.device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    timers = open(args.timers, "w", buffering=1) if args.timers else None  # noqa: SIM115 (closed at exit)
    try:
        for _ in range(args.iters):
            t0 = time.perf_counter()
            x, y = handover.get()
            x, y = x.to(args.device, non_blocking=True), y.to(args.device, non_blocking=True)
            t1 = time.perf_counter()
            out = model(x)
            t2 = time.perf_counter()
            nn.functional.cross_entropy(out, y).backward()
            optimizer.step()
            optimizer.zero_grad()
            if timers is not None:
                timers.write(json.dumps({"get_s": t1 - t0, "forward_s": t2 - t1}) + "\n")
    finally:
        # Joined, not left as daemons: a daemon thread inside a torch op at interpreter exit aborts the process
        # (pytorch/pytorch#38228), and stepscope's tests run this script inside the test process.
        stop.set()
        for thread in threads:
            thread.join()
        if timers is not None:
            timers.close()


if __name__ == "__main__":
    main()
