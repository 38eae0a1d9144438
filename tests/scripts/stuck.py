"""A process that is stuck (or busy) in one known place, for `stepscope dump` and the py-spy tests.

    python stuck.py busy      spins in spin_forever()
    python stuck.py lock      the main thread waits in wait_for_lock() on a lock another thread holds forever
    python stuck.py recv      waits in wait_for_bytes() on a socket nobody writes to
    python stuck.py barrier   torch.distributed gloo: rank 0 waits in wait_at_barrier() for a rank 1 that never
                              arrives (run two processes with RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set)

Each prints "stuck: ready" once it is about to block (or spin), then never returns.
"""

import socket
import sys
import threading
import time


def ready() -> None:
    print("stuck: ready", flush=True)


def spin_forever() -> None:
    ready()
    total = 0
    while True:
        total = (total + 1) % 1_000_003


def hold_forever(lock: threading.Lock, held: threading.Event) -> None:
    with lock:
        held.set()
        time.sleep(1e6)


def wait_for_lock() -> None:
    lock, held = threading.Lock(), threading.Event()
    threading.Thread(target=hold_forever, args=(lock, held), name="holder", daemon=True).start()
    held.wait()
    ready()
    lock.acquire()


def wait_for_bytes() -> None:
    mine, _theirs = socket.socketpair()
    ready()
    mine.recv(1024)


def wait_at_barrier() -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    if dist.get_rank() == 0:
        ready()
        dist.barrier()
    else:
        ready()
        time.sleep(1e6)  # never reaches the barrier


if __name__ == "__main__":
    {"busy": spin_forever, "lock": wait_for_lock, "recv": wait_for_bytes, "barrier": wait_at_barrier}[sys.argv[1]]()
