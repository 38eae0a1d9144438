"""A small language-model-shaped net with every kind of parameter `stepscope params` tells apart.

``tok`` is a frozen embedding tied to ``out.weight`` (one tensor, two names); ``gate.scale`` is reached by every
backward but its gradient is exactly zero; ``odd`` is only used on odd steps (0-based); ``aux_head`` is never
called. With --clean there is no aux_head and the odd branch runs every step, so every trainable tensor is used.
With --calibrate a second model (one tensor) scales the logits. Trained with a DataLoader and AdamW.
"""

import argparse
import sys

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

VOCAB, DIM, CLASSES, SEQ = 32, 16, 4, 6


class Gate(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(DIM))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.scale * 0.0


class Net(nn.Module):
    def __init__(self, clean: bool = False) -> None:
        super().__init__()
        self.clean = clean
        self.tok = nn.Embedding(VOCAB, DIM)
        self.tok.weight.requires_grad_(False)
        self.body = nn.Linear(DIM, DIM)
        self.gate = Gate()
        self.odd = nn.Linear(DIM, DIM)
        if not clean:
            self.aux_head = nn.Linear(DIM, CLASSES)
        self.out = nn.Linear(DIM, VOCAB)
        self.out.weight = self.tok.weight
        self.calls = 0

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        step = self.calls
        self.calls += 1
        h = torch.tanh(self.body(self.tok(idx)))
        h = self.gate(h)
        if self.clean or step % 2 == 1:
            h = h + self.odd(h)
        return self.out(h)


class Calibrator(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.log_temp = nn.Parameter(torch.zeros(1))

    def forward(self, logits: torch.Tensor) -> torch.Tensor:
        return logits * torch.exp(-self.log_temp)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--clean", action="store_true")
    parser.add_argument("--calibrate", action="store_true")
    parser.add_argument("--iters", type=int, default=200)
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)

    g = torch.Generator().manual_seed(0)
    idx = torch.randint(0, VOCAB, (64, SEQ), generator=g)
    data = TensorDataset(idx, torch.randint(0, VOCAB, (64, SEQ), generator=g))
    loader = DataLoader(data, batch_size=8, shuffle=True, drop_last=True, generator=torch.Generator().manual_seed(1))
    model = Net(clean=args.clean)
    calibrator = Calibrator() if args.calibrate else None
    params = list(model.parameters()) + (list(calibrator.parameters()) if calibrator else [])
    optimizer = torch.optim.AdamW(params, lr=1e-3)
    print("params_train: start")
    step = 0
    while step < args.iters:
        for x, y in loader:
            optimizer.zero_grad()
            logits = model(x)
            if calibrator is not None:
                logits = calibrator(logits)
            loss = F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))
            loss.backward()
            optimizer.step()
            step += 1
            if step >= args.iters:
                break
    print(f"params_train: done after {step} steps")
    sys.exit(0)


if __name__ == "__main__":
    main()
