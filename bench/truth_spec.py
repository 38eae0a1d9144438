"""The building blocks of a truth case (bench/truth.py) and the seeded draw that composes them.

A case is an ordinary training loop (a tiny Linear 16→4 model, so that the injected costs dominate) with costs
injected at known places. :class:`CaseSpec` says which blocks a case has; :func:`draw_case` composes one from a
seeded RNG, so ``(seed, index)`` always gives the same case; :func:`ci_cases` are the fixed, sleep-only cases of
the CI subset (tests/test_truth.py).
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass, field, replace
from typing import Any

# Where a cost can be injected, as the phase stepscope should time it in.
PHASES = ("data_wait", "forward", "backward", "optimizer", "other")
# The primary causes a case can be built around (the one meant to decide the bound).
SINGLE_CAUSES = ("data", "forward", "backward", "optimizer", "other", "checkpoint", "log", "oversubscribed")
RANK_CAUSES = ("data_wait", "forward", "backward", "optimizer", "other", "checkpoint", "log")
# Distinct Dataset class names, so that a loader fix's evidence can be traced to the right loader.
MAP_NAMES = ("ImagesDataset", "CaptionsDataset", "PointsDataset")
ITERABLE_NAMES = ("TokensStream", "SensorStream", "ClicksStream")
VAL_NAME = "HeldOutDataset"
PREFETCH_SHARE = 0.15  # of the cases whose loaders a prefetcher thread iterates (prefetch_generator's pattern)
CYCLE_SHARE = 0.15  # of the cases whose short map-style loaders are iterated through itertools.cycle
EPOCHS_SHARE = 0.35  # of the cases whose short map-style loaders start a new epoch every few steps
CRITIC_SHARE = 0.15  # of the cases with a second model trained by its own optimizer every step (a GAN's)
SCHEDULER_SHARE = 0.3  # of the cases stepping a learning-rate scheduler after each step
RANK0_VAL_SHARE = 0.5  # of the 2-rank cases with validation, where rank 0 alone validates
VAL_TRAIN_SHARE = 0.3  # of the cases with validation, where it takes the training loader's next batches
ACCUMULATING_SHARE = 0.4  # of the cases with accumulation (and no critic), whose optimizer wrapper accumulates
BATCH_FORM_SHARE = 0.3  # of the cases whose loaders give their batches as a dict, or as per-sample items


@dataclass(frozen=True)
class Cost:
    """A cost per call: ``ms`` milliseconds of ``time.sleep`` (load cannot stretch it) or of a busy CPU loop."""

    ms: float
    busy: bool = False

    def describe(self) -> str:
        return f"{self.ms:g}ms {'busy' if self.busy else 'sleep'}"


@dataclass(frozen=True)
class LoaderSpec:
    """One training DataLoader: its Dataset class, style, where its cost sits and how many workers load it."""

    name: str
    iterable: bool = False
    where: str = "getitem"  # "getitem" (spread over the batch's samples) or "collate" (once per batch)
    cost: Cost | None = None  # per batch
    workers: int = 0
    batch: int = 8


@dataclass(frozen=True)
class ValSpec:
    """A validation pass every ``every`` steps over its own loader of ``batches`` batches (each ``cost`` to load),
    or (``source`` "train") over the next ``batches`` batches of the first training loader's iterator."""

    every: int
    batches: int
    cost: Cost | None = None  # per validation batch, in the validation Dataset
    only_rank: int | None = None  # the rank that alone validates (the others wait for it); None: every rank
    source: str = "loader"  # "loader": a loader of its own; "train": the training loader's next batches


@dataclass(frozen=True)
class SideSpec:
    """Per-step side work: a second model's forward without gradients, before the training forward (a teacher)
    or after the optimizer step (a metric or EMA model). Step work: it must stay in the step."""

    where: str  # "before" or "after"
    role: str  # "teacher", "metric", "ema"
    cost: Cost


@dataclass(frozen=True)
class StragglerSpec:
    """In a 2-rank job, ``rank`` spends ``cost`` more per call in ``phase``; for ``checkpoint``/``log`` that rank
    alone saves or logs (``cost`` None: the case's checkpoint/log blocks say how much), the way scripts write
    rank-0-only checkpoints."""

    rank: int
    phase: str
    cost: Cost | None = None


@dataclass
class CaseSpec:
    """One generated training loop: every building block it has. A ``None``/0 block is absent."""

    case_id: str
    seed: int
    index: int
    ranks: int = 1
    loaders: list[LoaderSpec] = field(default_factory=lambda: [LoaderSpec(MAP_NAMES[0])])
    fetch: str = "each"  # "each": one batch from every loader per micro-batch; "alternate": one loader in turn
    prefetch: bool = False  # each loader iterated by a thread of its own that hands its batches over in a queue
    # >0: the map-style loaders hold this many batches and are iterated through itertools.cycle, which fetches in its
    # first pass only and hands the batches it kept over again after it
    cycle_batches: int = 0
    # >0: the map-style loaders hold this many batches, and an endless generator starts a new epoch (a fresh
    # iterator: its workers start again) whenever one ends, as ``while True: yield from loader`` does
    epoch_batches: int = 0
    # "tuple": (inputs, targets) as default_collate makes them; "dict": {"inputs": ..., "targets": ...}; "samples":
    # per-sample items, (inputs one by one, a target dict each), as collate_fn=lambda b: tuple(zip(*b)) makes them
    batch_form: str = "tuple"
    accum: int = 1  # micro-batches per optimizer step
    forward: Cost | None = None
    backward: Cost | None = None
    optimizer: Cost | None = None
    # "subclass" of SGD; "wrapper": an Optimizer wrapping an inner SGD; "accumulating": a wrapper the loop steps after
    # every micro-batch, which steps its inner SGD every ACCUM-th call (Accelerate's shape)
    optimizer_style: str = "subclass"
    # "before"/"after": a critic model with its own optimizer, updated every step before or after the model's
    # optimizer step (a GAN's discriminator: one step is one round of both)
    critic: str = ""
    scheduler: bool = False  # a learning-rate scheduler stepped after every optimizer step
    other: Cost | None = None  # plain Python in the loop body, after the step
    side: SideSpec | None = None
    val: ValSpec | None = None
    checkpoint_mb: float = 0.0  # torch.save of a state dict this large every step
    log: str | None = None  # "print" or "logging": a line formatting a tensor every step
    log_elems: int = 0  # elements of the tensor the log line formats (its cost)
    straggler: StragglerSpec | None = None
    bg_load: int = 0  # busy-loop processes started beside the run
    cause: str = ""  # the primary cause the draw built the case around (for the report)
    warmup: int = 5
    steps: int = 40

    def blocks(self) -> str:
        """The building blocks in one line, for the report."""
        parts = [f"ranks={self.ranks}", f"cause={self.cause}"]
        for i, ld in enumerate(self.loaders):
            cost = ld.cost.describe() if ld.cost else "free"
            style = "iter" if ld.iterable else "map"
            parts.append(f"loader{i}={ld.name}({style},{ld.where},{cost},w{ld.workers})")
        if len(self.loaders) > 1:
            parts.append(f"fetch={self.fetch}")
        if self.batch_form != "tuple":
            parts.append(f"batches={self.batch_form}")
        if self.prefetch:
            parts.append("prefetch=thread")
        if self.cycle_batches:
            parts.append(f"cycle={self.cycle_batches}batches")
        if self.epoch_batches:
            parts.append(f"epochs={self.epoch_batches}batches")
        if self.accum > 1:
            parts.append(f"accum={self.accum}")
        for name in ("forward", "backward", "optimizer", "other"):
            cost = getattr(self, name)
            if cost is not None:
                parts.append(f"{name}={cost.describe()}")
        if self.optimizer is not None or self.optimizer_style == "accumulating":
            parts.append(f"optimizer_style={self.optimizer_style}")
        if self.critic:
            parts.append(f"critic={self.critic}")
        if self.scheduler:
            parts.append("scheduler")
        if self.side:
            parts.append(f"side={self.side.role}@{self.side.where}({self.side.cost.describe()})")
        if self.val:
            alone = "" if self.val.only_rank is None else f"@rank{self.val.only_rank}"
            source = "" if self.val.source == "loader" else f"@{self.val.source}"
            parts.append(f"val=every{self.val.every}x{self.val.batches}{alone}{source}")
        if self.checkpoint_mb:
            parts.append(f"checkpoint={self.checkpoint_mb:g}MB")
        if self.log:
            parts.append(f"log={self.log}({self.log_elems} elems)")
        if self.straggler:
            s = self.straggler
            extra = f"+{s.cost.describe()}" if s.cost else " alone"
            parts.append(f"straggler=rank{s.rank}:{s.phase}{extra}")
        if self.bg_load:
            parts.append(f"bg_load={self.bg_load}")
        return " ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CaseSpec:
        """The spec ``to_dict`` wrote (a kept run's: the draw may have changed since)."""

        def cost(c: dict[str, Any] | None) -> Cost | None:
            return None if c is None else Cost(**c)

        def block(kind: type, d: dict[str, Any] | None) -> Any:
            return None if d is None else kind(**{**d, "cost": cost(d.get("cost"))})

        fields = {**data}
        fields["loaders"] = [block(LoaderSpec, d) for d in data["loaders"]]
        for name in ("forward", "backward", "optimizer", "other"):
            fields[name] = cost(data.get(name))
        fields["side"] = block(SideSpec, data.get("side"))
        fields["val"] = block(ValSpec, data.get("val"))
        fields["straggler"] = block(StragglerSpec, data.get("straggler"))
        return cls(**fields)


def is_two_rank(index: int, share: float) -> bool:
    """Exactly ``share`` of the cases are 2-rank, spread evenly: case ``index`` is one when the running count of
    2-rank cases steps up at it (so ``--only`` redraws the same kind of case)."""
    return int((index + 1) * share) > int(index * share)


def _cost(rng: random.Random, lo: float, hi: float, busy_p: float) -> Cost:
    """A cost of ``lo``–``hi`` ms (0.5 ms grain), busy with probability ``busy_p``."""
    return Cost(ms=round(rng.uniform(lo, hi) * 2) / 2, busy=rng.random() < busy_p)


def _loaders(rng: random.Random, data_primary: Cost | None, oversubscribed: bool) -> list[LoaderSpec]:
    """1–3 loaders: map-style or iterable, each with a distinct Dataset class. Loader 0 carries the primary data
    cost (main-process, or 4–6 CPU-bound workers when ``oversubscribed``); the others cost 0–2 ms."""
    count = 1 if oversubscribed else rng.choices((1, 2, 3), weights=(5, 3, 2))[0]
    map_names, iter_names = list(MAP_NAMES), list(ITERABLE_NAMES)
    rng.shuffle(map_names)
    rng.shuffle(iter_names)
    loaders = []
    for i in range(count):
        iterable = not oversubscribed and rng.random() < 0.35
        name = (iter_names if iterable else map_names).pop()
        where = rng.choice(("getitem", "collate"))
        if i == 0 and oversubscribed:
            cpu = Cost(float(round(rng.uniform(16, 24))), busy=True)
            loaders.append(LoaderSpec(name, False, "getitem", cpu, rng.randint(4, 6)))
        elif i == 0 and data_primary is not None:
            loaders.append(LoaderSpec(name, iterable, where, data_primary, 0))
        else:
            cost = _cost(rng, 0.5, 2.0, 0.3) if rng.random() < 0.6 else None
            # A worker for an iterable dataset yields the whole stream: fine here, the stream is endless.
            workers = rng.choice((0, 0, 1))
            loaders.append(LoaderSpec(name, iterable, where, cost, workers))
    return loaders


def _secondary(rng: random.Random, spec: CaseSpec, skip: set[str]) -> None:
    """Small costs (1–3 ms, at most two) in phases other than the primary's, so the primary stays the largest."""
    names = [p for p in ("forward", "backward", "optimizer", "other") if p not in skip]
    rng.shuffle(names)
    for name in names[: rng.randint(0, 2)]:
        setattr(spec, name, _cost(rng, 1.0, 3.0, 0.3))


def _primary(rng: random.Random, spec: CaseSpec, cause: str) -> Cost | None:
    """Sets the primary cost of ``cause`` (8–20 ms per call, per step for checkpoint/log); returns the data cost
    for loader 0 when the cause is data."""
    cost = _cost(rng, 8.0, 20.0, 0.4)
    if cause in ("forward", "backward", "optimizer", "other"):
        # Per call: with accumulation forward/backward run `accum` times a step, so a smaller cost suffices.
        per_call = Cost(max(4.0, round(cost.ms / (spec.accum if cause != "optimizer" else 1))), cost.busy)
        setattr(spec, cause, per_call if cause in ("forward", "backward") else cost)
    elif cause == "checkpoint":
        spec.checkpoint_mb = float(rng.choice((6, 8, 12)))
    elif cause == "log":
        spec.log = rng.choice(("print", "logging"))
        spec.log_elems = rng.choice((1600, 2000, 2500))
    elif cause == "data":
        return cost
    return None


def draw_case(seed: int, index: int, ranks_share: float = 0.15, load: bool = False) -> CaseSpec:
    """The case ``index`` of the run seeded ``seed``: a primary cause meant to decide the bound, plus side blocks
    drawn independently (validation, side work, accumulation, extra loaders, small secondary costs)."""
    rng = random.Random(f"truth:{seed}:{index}")
    spec = CaseSpec(case_id=f"c{index:03d}", seed=seed, index=index)
    spec.ranks = 2 if is_two_rank(index, ranks_share) else 1
    spec.accum = rng.choice((2, 3, 4)) if rng.random() < 0.3 else 1
    if spec.ranks == 2 and rng.random() < 0.75:
        spec.cause = "straggler:" + rng.choice(RANK_CAUSES)
    else:
        spec.cause = rng.choice(SINGLE_CAUSES if spec.ranks == 1 else SINGLE_CAUSES[:-1])
    base = spec.cause.split(":")[-1]
    data_cost = _primary(rng, spec, base) if not spec.cause.startswith("straggler") else None
    spec.loaders = _loaders(rng, data_cost, spec.cause == "oversubscribed")
    if spec.cause.startswith("straggler"):
        spec.straggler = _straggler(rng, spec, base)
    _secondary(rng, spec, {base})
    if len(spec.loaders) > 1:
        spec.fetch = rng.choice(("each", "alternate"))
    # Its own draw, so that adding the block left every other block of a seed's cases as it was. Not with the
    # oversubscribed cause: its main thread's wait for the cores its workers hold is the loader's (issue 24).
    prefetch = random.Random(f"truth:{seed}:{index}:prefetch").random() < PREFETCH_SHARE
    spec.prefetch = prefetch and spec.cause != "oversubscribed"
    cycle = random.Random(f"truth:{seed}:{index}:cycle")
    finite = not any(ld.iterable for ld in spec.loaders)  # an endless stream's first pass never ends
    # Not with a data cause either: the measured steps would never fetch, and the cause never show.
    shown = spec.cause not in ("oversubscribed", "data", "straggler:data_wait")
    if cycle.random() < CYCLE_SHARE and finite and not spec.prefetch and shown:
        # The pass ends in the warm-up (its first 1-4 steps): every measured step replays kept batches. A step
        # that fetches some of its batches and replays others reads its samples short (docs/run.md, limits).
        per_step = spec.accum if spec.fetch == "each" else spec.accum / len(spec.loaders)
        spec.cycle_batches = max(1, round(cycle.randint(1, spec.warmup - 1) * per_step))
    # The loop shapes drawn last, each from its own draw, so that every earlier block of a seed's cases stays.
    shapes = random.Random(f"truth:{seed}:{index}:shapes")
    epochs = shapes.random() < EPOCHS_SHARE
    if epochs and finite and not spec.prefetch and not spec.cycle_batches and spec.cause != "oversubscribed":
        # A new epoch every 2-8 steps: with workers, each starts its processes again (the stall is data_wait).
        per_step = spec.accum if spec.fetch == "each" else spec.accum / len(spec.loaders)
        spec.epoch_batches = max(1, round(shapes.randint(2, 8) * per_step))
    if shapes.random() < CRITIC_SHARE:
        spec.critic = shapes.choice(("before", "after"))
    spec.scheduler = shapes.random() < SCHEDULER_SHARE
    rank0_val = shapes.random() < RANK0_VAL_SHARE
    form = random.Random(f"truth:{seed}:{index}:batch-form")
    if form.random() < BATCH_FORM_SHARE:
        spec.batch_form = form.choice(("dict", "samples"))
    if spec.optimizer is not None or (spec.straggler and spec.straggler.phase == "optimizer"):
        spec.optimizer_style = rng.choice(("subclass", "wrapper"))
    if rng.random() < 0.3:
        where = rng.choice(("before", "after"))
        role = "teacher" if where == "before" else rng.choice(("metric", "ema"))
        spec.side = SideSpec(where, role, _cost(rng, 1.0, 3.0, 0.0))
    if rng.random() < 0.35:
        val_cost = _cost(rng, 1.0, 4.0, 0.3) if rng.random() < 0.5 else None
        spec.val = ValSpec(every=rng.randint(5, 10), batches=rng.randint(2, 4), cost=val_cost)
        if spec.ranks > 1 and rank0_val:
            spec.val = replace(spec.val, only_rank=0)
        # Its own draw (added later). Its batches cost what the training loader's do.
        if random.Random(f"truth:{seed}:{index}:val-source").random() < VAL_TRAIN_SHARE:
            spec.val = replace(spec.val, source="train", cost=None)
    if spec.ranks == 1 and not load and rng.random() < 0.08:
        spec.bg_load = rng.choice((1, 2))
    if load:
        spec.bg_load = 2
    accumulating = random.Random(f"truth:{seed}:{index}:accumulating").random() < ACCUMULATING_SHARE
    if accumulating and spec.accum > 1 and not spec.critic:
        spec.optimizer_style = "accumulating"
    return spec


def _straggler(rng: random.Random, spec: CaseSpec, phase: str) -> StragglerSpec:
    """A rank that spends 6–15 ms (sleep) more per step in ``phase``. Checkpoints and logs are written by rank 0
    alone, as scripts write them; a data straggler's loader 0 loads in the main process, so its wait shows."""
    if phase == "checkpoint":
        spec.checkpoint_mb = float(rng.choice((6, 8, 12)))
        return StragglerSpec(0, phase)
    if phase == "log":
        spec.log = rng.choice(("print", "logging"))
        spec.log_elems = rng.choice((1600, 2000, 2500))
        return StragglerSpec(0, phase)
    if phase == "data_wait":
        spec.loaders[0] = replace(spec.loaders[0], workers=0)
    # Sleeps: the two ranks already share the two cores, a busy straggler would slow the other rank too.
    return StragglerSpec(rng.choice((0, 1)), phase, _cost(rng, 6.0, 15.0, 0.0))


def ci_cases() -> list[CaseSpec]:
    """The CI subset: fixed cases whose costs are all sleeps of ≥ 5 ms (a loaded machine cannot stretch them),
    four single-rank and one 2-rank, each a few seconds."""
    s = Cost
    cases = [
        CaseSpec("ci-data", 0, 0, loaders=[LoaderSpec("ImagesDataset", cost=s(12.0))], forward=s(5.0), cause="data"),
        CaseSpec(
            "ci-forward-val",
            0,
            1,
            forward=s(10.0),
            val=ValSpec(every=5, batches=2, cost=s(5.0)),
            cause="forward",
        ),
        CaseSpec(
            "ci-optimizer-teacher",
            0,
            2,
            optimizer=s(12.0),
            optimizer_style="wrapper",
            side=SideSpec("before", "teacher", s(5.0)),
            cause="optimizer",
        ),
        CaseSpec(
            "ci-backward-accum-metric",
            0,
            3,
            accum=2,
            backward=s(6.0),
            side=SideSpec("after", "metric", s(5.0)),
            loaders=[LoaderSpec("ImagesDataset"), LoaderSpec("TokensStream", iterable=True, where="collate")],
            fetch="alternate",
            cause="backward",
        ),
        CaseSpec(
            "ci-ddp-straggler-val",
            0,
            4,
            ranks=2,
            loaders=[LoaderSpec("ImagesDataset", cost=s(5.0))],
            straggler=StragglerSpec(1, "data_wait", s(10.0)),
            val=ValSpec(every=5, batches=2, cost=s(5.0)),
            cause="straggler:data_wait",
        ),
    ]
    return cases
