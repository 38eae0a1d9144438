"""Writes a truth case (bench/truth_spec.py's :class:`CaseSpec`) as a plain training script.

The script has only the blocks its case drew (the doctor lints the source: code that never runs must not be
there to be found). It carries its own timer, ``TRUTH``: at each optimizer step's end it records the time, the
time it spent in its own validation since the previous step's end, the time each phase's calls took (``spans``:
the fetches, forwards, backwards, optimizer steps and zero_grads, as a timer around each call reads them) and the
injected costs as actually spent (``injected``). It writes them as JSON beside itself at exit (stepscope stops the
script with ``SystemExit(0)`` after the measured steps, and ``atexit`` handlers run then), one file per rank.

:func:`write_script` returns the script's text and the lines the fixes should name (the checkpoint's
``torch.save`` and the log line).
"""

from __future__ import annotations

from dataclasses import dataclass

from truth_spec import CaseSpec, Cost, LoaderSpec

HEADER = '''"""stepscope truth case {case_id} (bench/truth.py --seed {seed} --only {case_id}).

{blocks}

An ordinary training loop with injected costs. It keeps its own timer (TRUTH) and writes it at exit to
sys.argv[1] (+ ".rankN" under torchrun): the ground truth that bench/truth.py compares stepscope's figures with.
"""

import atexit
import contextlib
import json
import os
import sys
import time
{extra_imports}
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, IterableDataset, default_collate
{torch_imports}
clock = time.perf_counter
RANK = int(os.environ.get("RANK", "0"))
MAIN_PID = os.getpid()
EXTRA_MS = {extra_ms} if RANK == {extra_rank} else 0.0  # the straggler rank's extra cost
MAX_STEPS = int(os.environ.get("TRUTH_MAX_STEPS", "0"))  # a plain run's length (under stepscope: endless)


class Truth:
    """The script's own clock, one record per optimizer step: its end time, the time spent in validation since
    the previous step's end, each phase's calls (spans), the injected costs as spent and the training samples the
    step's micro-batches held."""

    def __init__(self, path):
        self.path = path
        self.records = []
        self.val_s = 0.0
        self.spans = {{}}
        self.injected = {{}}
        self.samples = 0
        self.in_val = False

    def span(self, key, seconds):
        self.spans[key] = self.spans.get(key, 0.0) + seconds

    def inject(self, key, seconds):
        key = "eval" if self.in_val else key
        self.injected[key] = self.injected.get(key, 0.0) + seconds

    def end_step(self):
        record = {{"t": clock(), "val_s": self.val_s, "spans": self.spans, "injected": self.injected}}
        self.records.append({{**record, "samples": self.samples}})
        self.val_s, self.spans, self.injected, self.samples = 0.0, {{}}, {{}}, 0

    def dump(self):
        if os.getpid() == MAIN_PID:  # not in a loader worker
            with open(self.path, "w") as f:
                json.dump({{"rank": RANK, "records": self.records}}, f)


TRUTH = Truth(sys.argv[1] + (f".rank{{RANK}}" if "RANK" in os.environ else ""))
atexit.register(TRUTH.dump)


def spend(key, ms, busy=False):
    """An injected cost: ms of sleep, or of a busy loop; own-timed."""
    if ms <= 0:
        return
    start = clock()
    if busy:
        while clock() - start < ms / 1e3:
            pass
    else:
        time.sleep(ms / 1e3)
    TRUTH.inject(key, clock() - start)


def unpack(batch):
    """A batch's inputs and targets, in whatever form its loader gave them."""
    if isinstance(batch, dict):
        return batch["inputs"], batch["targets"]
    if isinstance(batch[0], tuple):  # per-sample items
        return torch.stack(batch[0]), torch.stack([t["target"] for t in batch[1]])
    return batch


def fetch(it, name):
    """One batch from a training loader, timed."""
    start = clock()
    batch = next(it)
    took = clock() - start
    TRUTH.span("data_wait", took)
    TRUTH.span("data_wait:" + name, took)
    return batch


class Samples(Dataset):
    """Map-style samples; each costs sample_ms in __getitem__."""

    def __init__(self, n, sample_ms=0.0, busy=False):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 16, generator=g)
        self.y = torch.randn(n, 4, generator=g)
        self.sample_ms, self.busy = sample_ms, busy

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        spend("data_wait", self.sample_ms, self.busy)
        return self.x[i], self.y[i]


class Stream(IterableDataset):
    """An endless stream; each sample costs sample_ms."""

    def __init__(self, sample_ms=0.0, busy=False):
        self.sample_ms, self.busy = sample_ms, busy

    def __iter__(self):
        g = torch.Generator().manual_seed(0)
        while True:
            spend("data_wait", self.sample_ms, self.busy)
            yield torch.randn(16, generator=g), torch.randn(4, generator=g)


class SlowCollate:
    """A collate_fn that costs batch_ms per batch, and gives it in ``form`` (see ``unpack``)."""

    def __init__(self, batch_ms, busy=False, form="tuple"):
        self.batch_ms, self.busy, self.form = batch_ms, busy, form

    def __call__(self, batch):
        spend("data_wait", self.batch_ms, self.busy)
        if self.form == "samples":
            inputs, targets = zip(*batch)
            return inputs, tuple({{"target": y}} for y in targets)
        x, y = default_collate(batch)
        return {{"inputs": x, "targets": y}} if self.form == "dict" else (x, y)
'''

FOOTER = """

if __name__ == "__main__":
    main()
"""


@dataclass
class Script:
    """A generated case: its source, and the 1-based lines of the checkpoint's save and of the log call."""

    text: str
    checkpoint_line: int | None
    log_line: int | None


def _ms(cost: Cost | None) -> str:
    """``ms, busy`` arguments of ``spend`` for a cost (0 when absent)."""
    return f"{cost.ms if cost else 0.0}, {bool(cost and cost.busy)}"


def _straggles(spec: CaseSpec, phase: str) -> bool:
    return spec.straggler is not None and spec.straggler.phase == phase and spec.straggler.cost is not None


PREFETCHED = '''class Prefetched:
    """A loader iterated by a thread of its own that hands its batches over through a queue, as
    prefetch_generator's BackgroundGenerator does."""

    def __init__(self, loader):
        self.queue = queue.Queue(maxsize=2)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.produce, args=(loader,), daemon=True)
        self.thread.start()
        atexit.register(self.close)

    def produce(self, loader):
        for batch in loader:
            while not self.stop.is_set():
                try:
                    self.queue.put(batch, timeout=0.05)
                    break
                except queue.Full:
                    pass
            if self.stop.is_set():
                return

    def __next__(self):
        return self.queue.get()

    def close(self):
        # Joined before exit: a daemon thread inside a torch op at interpreter exit aborts the process.
        self.stop.set()
        self.thread.join(5)


'''


def _classes(spec: CaseSpec) -> list[str]:
    """A Dataset class per loader (named, so a fix's evidence can name it), the prefetcher, the models and the
    optimizer."""
    out = PREFETCHED.splitlines() if spec.prefetch else []
    for ld in spec.loaders:
        base = "Stream" if ld.iterable else "Samples"
        out += [f"class {ld.name}({base}):", f'    """Training data: {ld.name}."""', "", ""]
    if spec.val:
        out += ["class HeldOutDataset(Samples):", '    """Validation data."""', "", ""]
    out += _net(spec)
    if spec.side:
        out += [
            "class SideNet(nn.Module):",
            f'    """The {spec.side.role}: a second model run without gradients every step."""',
            "",
            "    def __init__(self):",
            "        super().__init__()",
            "        self.linear = nn.Linear(16, 4)",
            "",
            "    def forward(self, x):",
            f'        spend("side", {_ms(spec.side.cost)})',
            "        return self.linear(x)",
            "",
            "",
        ]
    out += _optimizer_class(spec)
    return out


def _net(spec: CaseSpec) -> list[str]:
    """The tiny trained model: forward spends its cost; a custom autograd Function spends the backward's."""
    out = []
    backward = spec.backward is not None or _straggles(spec, "backward")
    if backward:
        extra = ["        spend('backward', EXTRA_MS)"] if _straggles(spec, "backward") else []
        out += [
            "class SlowGrad(torch.autograd.Function):",
            '    """Identity forward; its backward spends the injected backward cost."""',
            "",
            "    @staticmethod",
            "    def forward(ctx, x):",
            "        return x.view_as(x)",
            "",
            "    @staticmethod",
            "    def backward(ctx, grad):",
            f'        spend("backward", {_ms(spec.backward)})',
            *extra,
            "        return grad",
            "",
            "",
        ]
    out += [
        "class Net(nn.Module):",
        "    def __init__(self):",
        "        super().__init__()",
        "        self.linear = nn.Linear(16, 4)",
        "",
        "    def forward(self, x):",
    ]
    if spec.forward:
        out.append(f'        spend("forward", {_ms(spec.forward)})')
    if _straggles(spec, "forward"):
        out.append('        spend("forward", EXTRA_MS)')
    out.append("        out = self.linear(x)")
    if backward:
        out.append("        out = SlowGrad.apply(out)")
    out += ["        return out", "", ""]
    return out


def _optimizer_class(spec: CaseSpec) -> list[str]:
    """A SGD subclass whose step spends the cost, an Optimizer wrapping an inner SGD (the Lookahead shape), or one
    that accumulates."""
    extra = ["        spend('optimizer', EXTRA_MS)"] if _straggles(spec, "optimizer") else []
    if spec.optimizer_style == "accumulating":
        return [
            "class Accumulating(torch.optim.Optimizer):",
            '    """An optimizer around another that accumulates (Accelerate\'s shape): the loop calls its step after',
            '    every micro-batch; it steps the inner one (spending the cost) at every ACCUM-th call."""',
            "",
            "    def __init__(self, inner):",
            "        self.inner, self.calls = inner, 0",
            "        super().__init__(inner.param_groups, inner.defaults)",
            "",
            "    def step(self, closure=None):",
            "        self.calls += 1",
            "        if self.calls % ACCUM:",
            "            return None",
            f'        spend("optimizer", {_ms(spec.optimizer)})',
            *extra,
            "        return self.inner.step(closure)",
            "",
            "",
        ]
    if spec.optimizer is None and not _straggles(spec, "optimizer"):
        return []
    if spec.optimizer_style == "subclass":
        return [
            "class SlowSGD(torch.optim.SGD):",
            '    """SGD with a heavier update rule: its step spends the injected cost first."""',
            "",
            "    def step(self, closure=None):",
            f'        spend("optimizer", {_ms(spec.optimizer)})',
            *extra,
            "        return super().step(closure)",
            "",
            "",
        ]
    return [
        "class Wrapped(torch.optim.Optimizer):",
        '    """An optimizer around another (the Lookahead shape): its step spends the cost, then steps the inner."""',
        "",
        "    def __init__(self, inner):",
        "        self.inner = inner",
        "        super().__init__(inner.param_groups, inner.defaults)",
        "",
        "    def step(self, closure=None):",
        f'        spend("optimizer", {_ms(spec.optimizer)})',
        *extra,
        "        return self.inner.step(closure)",
        "",
        "",
    ]


def _loader_line(spec: CaseSpec, i: int, ld: LoaderSpec) -> str:
    """``DataLoader(...)`` for one training loader; a data straggler's extra cost goes to loader 0."""
    per_batch = f"{ld.cost.ms if ld.cost else 0.0}"
    if i == 0 and _straggles(spec, "data_wait"):
        per_batch = f"({per_batch} + EXTRA_MS)"
    busy = bool(ld.cost and ld.cost.busy)
    sample = f"{per_batch} / {ld.batch}" if ld.where == "getitem" else "0.0"
    length = ld.batch * (spec.cycle_batches or spec.epoch_batches) or 8192
    dataset = f"{ld.name}({sample}, {busy})" if ld.iterable else f"{ld.name}({length}, {sample}, {busy})"
    args = [dataset, f"batch_size={ld.batch}", f"num_workers={ld.workers}"]
    if ld.where == "collate":
        args.append(f"collate_fn=SlowCollate({per_batch}, {busy}, {spec.batch_form!r})")
    elif spec.batch_form != "tuple":
        args.append(f"collate_fn=SlowCollate(0.0, False, {spec.batch_form!r})")
    return f"        DataLoader({', '.join(args)}),"


def _iterate(spec: CaseSpec) -> str:
    """How the loop gets a loader's batches: its iterator, a prefetcher's hand-over, or itertools.cycle."""
    if spec.prefetch:
        return "Prefetched(loader)"
    if spec.epoch_batches:
        return "epochs(loader)"
    return "itertools.cycle(loader)" if spec.cycle_batches else "iter(loader)"


EPOCHS = '''def epochs(loader):
    """The loader's batches, epoch after epoch (each a fresh iterator: its workers start again)."""
    while True:
        yield from loader


'''

CRITIC = '''class Critic(nn.Module):
    """A second model trained every step by an optimizer of its own (a GAN's discriminator)."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 1)

    def forward(self, y):
        return self.linear(y)


'''


def _critic_update(ind: str) -> list[str]:
    """The critic's update on the model's last output, each call own-timed in its phase."""
    return [
        f"{ind}start = clock()",
        f"{ind}critic_opt.zero_grad()",
        f'{ind}TRUTH.span("zero_grad", clock() - start)',
        f"{ind}start = clock()",
        f"{ind}score = critic(out.detach()).mean()",
        f'{ind}TRUTH.span("forward", clock() - start)',
        f"{ind}start = clock()",
        f"{ind}score.backward()",
        f'{ind}TRUTH.span("backward", clock() - start)',
        f"{ind}start = clock()",
        f"{ind}critic_opt.step()",
        f'{ind}TRUTH.span("optimizer", clock() - start)',
    ]


def _setup(spec: CaseSpec) -> list[str]:
    """``main()`` up to the loop: process group, loaders, models, optimizer, validation, log and checkpoint."""
    out = ["def main():", "    torch.manual_seed(0)", "    torch.set_num_threads(1)"]
    if spec.ranks > 1:
        out.append('    dist.init_process_group("gloo")')
    out.append("    loaders = [")
    out += [_loader_line(spec, i, ld) for i, ld in enumerate(spec.loaders)]
    out += [
        "    ]",
        f"    names = {[ld.name for ld in spec.loaders]!r}",
        f"    iters = [{_iterate(spec)} for loader in loaders]",
        "    model = Net()",
    ]
    if spec.ranks > 1:
        out.append("    model = DistributedDataParallel(model)")
    if spec.side:
        out.append(f"    {spec.side.role} = SideNet().eval()")
    if spec.critic:
        out += ["    critic = Critic()", "    critic_opt = torch.optim.SGD(critic.parameters(), lr=0.01)"]
    inner = "torch.optim.SGD(model.parameters(), lr=0.01)"
    if spec.optimizer_style == "accumulating":
        out.append(f"    opt = Accumulating({inner})")
    elif spec.optimizer is None and not _straggles(spec, "optimizer"):
        out.append(f"    opt = {inner}")
    elif spec.optimizer_style == "subclass":
        out.append("    opt = SlowSGD(model.parameters(), lr=0.01)")
    else:
        out.append(f"    opt = Wrapped({inner})")
    if spec.scheduler:
        out.append("    schedule = torch.optim.lr_scheduler.StepLR(opt, step_size=1000, gamma=0.5)")
    if spec.val:
        val = spec.val
        sample = f"{val.cost.ms / 8 if val.cost else 0.0}, {bool(val.cost and val.cost.busy)}"
        out.append(f"    val_loader = DataLoader(HeldOutDataset({8 * val.batches}, {sample}), batch_size=8)")
    if spec.log:
        out += ["    torch.set_printoptions(threshold=1_000_000)", f"    stats = torch.randn({spec.log_elems})"]
    if spec.log == "logging":
        log_path = "os.path.splitext(os.path.abspath(__file__))[0] + '.log'"
        out.append(f"    logging.basicConfig(filename={log_path}, level=logging.INFO)")
        out.append('    log = logging.getLogger("train")')
    if spec.checkpoint_mb:
        out += [
            f"    blob = torch.randn({int(spec.checkpoint_mb * 262144)})  # {spec.checkpoint_mb:g} MB of float32",
            "    ckpt_path = os.path.splitext(os.path.abspath(__file__))[0] + f'.rank{RANK}.pt'",
        ]
    out += ["    step = 0", "    micro = 0"]
    return out


def _micro_batch(spec: CaseSpec) -> list[str]:
    """One micro-batch: the fetches, the side work before it, forward and backward (DDP: no_sync but the last)."""
    ind = " " * 12
    out = ["        for k in range(ACCUM):"]
    if spec.ranks > 1:
        out.append("            sync = model.no_sync() if k < ACCUM - 1 else contextlib.nullcontext()")
    else:
        out.append("            sync = contextlib.nullcontext()")
    if spec.fetch == "each" or len(spec.loaders) == 1:
        out += [
            f"{ind}batches = [unpack(fetch(it, name)) for it, name in zip(iters, names)]",
            f"{ind}x = torch.cat([b[0] for b in batches])",
            f"{ind}y = torch.cat([b[1] for b in batches])",
        ]
    else:
        out.append(f"{ind}x, y = unpack(fetch(iters[micro % len(iters)], names[micro % len(iters)]))")
    out.append(f"{ind}TRUTH.samples += len(x)")
    if spec.side and spec.side.where == "before":
        out += [
            f"{ind}start = clock()",
            f"{ind}with torch.no_grad():",
            f"{ind}    target = {spec.side.role}(x)",
            f'{ind}TRUTH.span("forward", clock() - start)',
            f"{ind}y = 0.5 * (y + target)",
        ]
    out += [
        f"{ind}with sync:",
        f"{ind}    start = clock()",
        f"{ind}    out = model(x)",
        f'{ind}    TRUTH.span("forward", clock() - start)',
        f"{ind}    loss = ((out - y) ** 2).mean() / ACCUM",
        f"{ind}    start = clock()",
        f"{ind}    loss.backward()",
        f'{ind}    TRUTH.span("backward", clock() - start)',
        f"{ind}micro += 1",
    ]
    if spec.optimizer_style == "accumulating":  # stepped after every micro-batch: it steps at every ACCUM-th
        out += [f"{ind}start = clock()", f"{ind}opt.step()", f'{ind}TRUTH.span("optimizer", clock() - start)']
    return out


def _after_step(spec: CaseSpec) -> tuple[list[str], int | None, int | None]:
    """The loop body after the optimizer step; with the offsets (in the returned lines) of the log call and the
    checkpoint's save, which the fixes should name."""
    ind = " " * 8
    out = [
        f"{ind}start = clock()",
        f"{ind}opt.zero_grad()",
        f'{ind}TRUTH.span("zero_grad", clock() - start)',
    ]
    if spec.scheduler:
        out.append(f"{ind}schedule.step()")
    if spec.side and spec.side.where == "after":
        out += [
            f"{ind}start = clock()",
            f"{ind}with torch.no_grad():",
            f"{ind}    {spec.side.role}(x)",
            f'{ind}TRUTH.span("forward", clock() - start)',
        ]
    if spec.other:
        out.append(f'{ind}spend("other", {_ms(spec.other)})')
    if _straggles(spec, "other"):
        out.append(f'{ind}spend("other", EXTRA_MS)')
    log_at = ckpt_at = None
    only = spec.straggler is not None and spec.straggler.phase in ("log", "checkpoint")
    if spec.log:
        pre = [f"{ind}if RANK == {spec.straggler.rank}:"] if only and spec.straggler.phase == "log" else []
        body = ind + ("    " if pre else "")
        out += [*pre, f"{body}start = clock()"]
        log_at = len(out)
        if spec.log == "print":
            out.append(f'{body}print(f"step {{step}} loss {{loss.item():.5f}} stats {{stats}}")')
        else:
            out.append(f'{body}log.info("step %d loss %.5f stats %s", step, loss.item(), stats)')
        out.append(f'{body}TRUTH.inject("log", clock() - start)')
    if spec.checkpoint_mb:
        pre = [f"{ind}if RANK == {spec.straggler.rank}:"] if only and spec.straggler.phase == "checkpoint" else []
        body = ind + ("    " if pre else "")
        out += [*pre, f"{body}start = clock()"]
        ckpt_at = len(out)
        out.append(f'{body}torch.save({{"model": model.state_dict(), "blob": blob}}, ckpt_path)')
        out.append(f'{body}TRUTH.inject("checkpoint", clock() - start)')
    if spec.val:
        alone = "" if spec.val.only_rank is None else f" and RANK == {spec.val.only_rank}"
        source = "iters[0]" if spec.val.source == "train" else "val_loader"
        out += [f"{ind}if step % {spec.val.every} == 0{alone}:", f"{ind}    validate(model, {source})"]
    out += [f"{ind}if step == MAX_STEPS:", f"{ind}    break"]
    return out, log_at, ckpt_at


VALIDATE = '''def validate(model, loader):
    """A validation pass over its own loader, own-timed."""
    TRUTH.in_val = True
    start = clock()
    model.eval()
    with torch.no_grad():
        for x, _ in loader:
            model(x)
    model.train()
    TRUTH.val_s += clock() - start
    TRUTH.in_val = False


'''

VALIDATE_TRAIN = '''def validate(model, batches):
    """A validation pass over the training loader's next VAL_BATCHES batches (no loader of its own), own-timed."""
    TRUTH.in_val = True
    start = clock()
    model.eval()
    with torch.no_grad():
        for _ in range(VAL_BATCHES):
            x, _ = unpack(next(batches))
            model(x)
    model.train()
    TRUTH.val_s += clock() - start
    TRUTH.in_val = False


'''


def write_script(spec: CaseSpec) -> Script:
    """The case's training script, with the lines its host fixes should name."""
    extra_imports = "import logging\n" if spec.log == "logging" else ""
    if spec.prefetch:
        extra_imports += "import queue\nimport threading\n"
    if spec.cycle_batches:
        extra_imports += "import itertools\n"
    torch_imports = ""
    if spec.ranks > 1:
        torch_imports = "import torch.distributed as dist\nfrom torch.nn.parallel import DistributedDataParallel\n"
    s = spec.straggler
    head = HEADER.format(
        case_id=spec.case_id,
        seed=spec.seed,
        blocks=spec.blocks(),
        extra_imports=extra_imports,
        torch_imports=torch_imports,
        extra_ms=s.cost.ms if s and s.cost else 0.0,
        extra_rank=s.rank if s else -1,
    )
    lines = [*head.splitlines(), "", "", f"ACCUM = {spec.accum}", "", ""]
    lines += _classes(spec)
    if spec.epoch_batches:
        lines += EPOCHS.splitlines()
    if spec.critic:
        lines += CRITIC.splitlines()
    if spec.val and spec.val.source == "train":
        lines += [f"VAL_BATCHES = {spec.val.batches}", "", "", *VALIDATE_TRAIN.splitlines()]
    elif spec.val:
        lines += VALIDATE.splitlines()
    lines += _setup(spec)
    body = ["    try:", "        while True:"] if spec.ranks > 1 else ["    while True:"]
    lines += body
    inner: list[str] = _micro_batch(spec)
    if spec.critic == "before":
        inner += _critic_update(" " * 8)
    if spec.optimizer_style != "accumulating":
        inner += ["        start = clock()", "        opt.step()", '        TRUTH.span("optimizer", clock() - start)']
    if spec.critic == "after":  # its step ends the round: the step
        inner += _critic_update(" " * 8)
    inner += ["        TRUTH.end_step()", "        step += 1"]
    after, log_at, ckpt_at = _after_step(spec)
    shift = "    " if spec.ranks > 1 else ""
    first_after = len(lines) + len(inner) + 1  # 1-based line of after[0]
    lines += [shift + line for line in inner + after]
    if spec.ranks > 1:
        lines += ["    finally:", "        dist.destroy_process_group()"]
    text = "\n".join(lines) + "\n" + FOOTER
    return Script(
        text=text,
        checkpoint_line=first_after + ckpt_at if ckpt_at is not None else None,
        log_line=first_after + log_at if log_at is not None else None,
    )
