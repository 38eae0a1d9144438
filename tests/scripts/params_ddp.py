"""params_train's net under DDP (gloo, launched by torchrun) with find_unused_parameters=True.

Besides the never-called ``aux_head``, the frozen tied ``tok``/``out.weight`` and the odd-step ``odd`` branch,
``rank0_only`` is used on rank 0 and never on the others: unused on rank 1, so unused for DDP.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

VOCAB, DIM, CLASSES, SEQ = 32, 16, 4, 6


class Gate(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(DIM))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.scale * 0.0


class Net(nn.Module):
    def __init__(self, rank: int) -> None:
        super().__init__()
        self.rank = rank
        self.tok = nn.Embedding(VOCAB, DIM)
        self.tok.weight.requires_grad_(False)
        self.body = nn.Linear(DIM, DIM)
        self.gate = Gate()
        self.odd = nn.Linear(DIM, DIM)
        self.rank0_only = nn.Linear(DIM, DIM)
        self.aux_head = nn.Linear(DIM, CLASSES)
        self.out = nn.Linear(DIM, VOCAB)
        self.out.weight = self.tok.weight
        self.calls = 0

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        step = self.calls
        self.calls += 1
        h = torch.tanh(self.body(self.tok(idx)))
        h = self.gate(h)
        if step % 2 == 1:
            h = h + self.odd(h)
        if self.rank == 0:
            h = h + self.rank0_only(h)
        return self.out(h)


def main() -> None:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(0, VOCAB, (64, SEQ), generator=g)
    data = TensorDataset(idx, torch.randint(0, VOCAB, (64, SEQ), generator=g))
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=4, sampler=sampler, drop_last=True)
    model = DistributedDataParallel(Net(rank), find_unused_parameters=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    try:
        for epoch in range(100):
            sampler.set_epoch(epoch)
            for x, y in loader:
                optimizer.zero_grad()
                loss = F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1))
                loss.backward()
                optimizer.step()
        print(f"params_ddp: rank {rank} done")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
