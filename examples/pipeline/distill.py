"""An asynchronous inference→training pipeline, measured by stepscope's PipelineMonitor.

Fake "engines" stand in for a target model serving hidden states (each call takes --engine-s seconds for
--engine-batch samples); a student MLP learns to reproduce them from a pool. Run it in-process (engines on threads)
or with --ray (engines as Ray actors on a local Ray), and make either side the bottleneck:

    python examples/pipeline/distill.py --engine-s 0.20           # inference-bound: the trainer waits
    python examples/pipeline/distill.py --engine-s 0.02 --train-s 0.05   # training-bound: the pool fills
    python examples/pipeline/distill.py --ray --json out/pipeline.json
"""

from __future__ import annotations

import argparse
import queue
import threading
import time

import torch

from stepscope import PipelineMonitor, Scope

DIM = 32


class FakeEngine:
    """A target model that takes ``seconds`` per call, whatever the batch (as a batched GPU engine roughly does)."""

    def __init__(self, seconds: float, seed: int) -> None:
        self.seconds = seconds
        self.weight = torch.randn(DIM, DIM, generator=torch.Generator().manual_seed(0))
        self.generator = torch.Generator().manual_seed(seed)

    def ready(self) -> bool:
        """Answers once the engine is up (as an Actor, once Ray has started its process)."""
        return True

    def generate(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        time.sleep(self.seconds)
        inputs = torch.randn(n, DIM, generator=self.generator)
        return inputs, torch.tanh(inputs @ self.weight)


def serve(call, pool: queue.Queue, mon, n: int, stop: threading.Event) -> None:
    """One slot: call the engine, put what it produced into the pool, until told to stop."""
    while not stop.is_set():
        inputs, targets = call(n)
        for pair in zip(inputs, targets, strict=True):
            pool.put(pair)
        mon.pool_put(n)


def local_slots(args, mon):
    engines = [FakeEngine(args.engine_s, seed) for seed in range(args.engines)]

    def slot_call(engine):
        def call(n):
            with mon.infer(batch_size=n):  # inside the slot: the engine's own time
                return engine.generate(n)

        return call

    return [slot_call(e) for e in engines for _ in range(args.concurrency)], lambda: None


def ray_slots(args, mon):
    import ray

    from stepscope.pipeline.ray import RayReporter

    if args.ray_address:
        ray.init(address=args.ray_address, log_to_driver=False)
    else:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    reporter = RayReporter(mon, poll_s=0.25, flush_s=0.25)
    Engine = ray.remote(num_cpus=0, max_concurrency=args.concurrency)(
        reporter.timed(FakeEngine, "generate", samples=lambda out: len(out[0]))
    )
    engines = [Engine.remote(args.engine_s, seed) for seed in range(args.engines)]
    ray.get([engine.ready.remote() for engine in engines])  # each actor's process started: the training clock starts

    def slot_call(engine):
        return lambda n: ray.get(engine.generate.remote(n))  # the timing is taken inside the actor

    def close():
        time.sleep(0.3)  # the actors' last timings
        reporter.close()
        ray.shutdown()

    return [slot_call(e) for e in engines for _ in range(args.concurrency)], close


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engines", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=1, help="concurrent calls per engine")
    parser.add_argument("--engine-batch", type=int, default=8)
    parser.add_argument("--engine-s", type=float, default=0.10, help="seconds per engine call")
    parser.add_argument("--train-batch", type=int, default=16)
    parser.add_argument("--train-s", type=float, default=0.0, help="extra seconds of work per training step")
    parser.add_argument("--seconds", type=float, default=8.0, help="how long to train")
    parser.add_argument("--window-s", type=float, default=4.0)
    parser.add_argument("--ray", action="store_true", help="engines as Ray actors on a local Ray")
    parser.add_argument("--ray-address", help="with --ray: join this running Ray (ray.init(address=...)) instead")
    parser.add_argument("--json", help="write the RunSummary (with the pipeline's figures) here")
    args = parser.parse_args()

    scope = Scope(warmup=3, system_interval_s=None)
    mon = PipelineMonitor(slots=args.engines * args.concurrency, window_s=args.window_s, scope=scope)
    slots, close = (ray_slots if args.ray else local_slots)(args, mon)
    pool: queue.Queue = queue.Queue()
    stop = threading.Event()
    threads = [
        threading.Thread(target=serve, args=(call, pool, mon, args.engine_batch, stop), daemon=True) for call in slots
    ]
    for thread in threads:
        thread.start()

    student = torch.nn.Sequential(torch.nn.Linear(DIM, 64), torch.nn.Tanh(), torch.nn.Linear(64, DIM))
    optimizer = torch.optim.SGD(student.parameters(), lr=0.05)
    end = time.perf_counter() + args.seconds
    step = 0
    while time.perf_counter() < end:
        with scope.phase("data_wait"), mon.dispatch_wait():
            pairs = [pool.get() for _ in range(args.train_batch)]
        mon.pool_take(len(pairs))
        inputs, targets = (torch.stack(x) for x in zip(*pairs, strict=True))
        with scope.phase("forward"):
            loss = torch.nn.functional.mse_loss(student(inputs), targets)
            time.sleep(args.train_s)
        with scope.phase("backward"):
            loss.backward()
        with scope.phase("optimizer"):
            optimizer.step()
            optimizer.zero_grad()
        scope.step(batch_size=len(pairs))
        step += 1
        if step % 20 == 0:
            print(f"step {step}: loss={loss.item():.4f} {mon.postfix()}", flush=True)

    stop.set()
    for thread in threads:  # each finishes its engine call: no torch work left running as the interpreter exits
        thread.join(timeout=10)
    close()
    summary = scope.summary()
    scope.print_table()
    for line in summary.verdict.evidence:
        print(f"  - {line}")
    if args.json:
        summary.to_json(args.json)


if __name__ == "__main__":
    main()
