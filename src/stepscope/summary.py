"""RunSummary: the one record every producer writes and every consumer reads.

Plain dataclasses with a versioned JSON form, documented field by field in docs/summary-schema.md. Loading
checks ``schema_version``: an older version is upgraded step by step through ``_UPGRADES``; a newer one, or a
file that is not a stepscope summary, is refused with a sentence that says what to do.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from stepscope.verdict import Verdict  # part of the schema, and of trace analyses

SCHEMA_VERSION = 8

BOUNDS = ("data", "compute", "optimizer", "host", "comms", "memory", "inference", "training", "balanced", "unknown")
COSTS = ("config", "code", "infra")


class SummaryError(ValueError):
    """A summary file that cannot be read: missing, not JSON, not a stepscope summary, or of another schema."""


@dataclass
class Steps:
    """How many steps ran and which were measured."""

    warmup: int = 0
    measured: int = 0
    profiled: int = 0  # steps recorded by torch.profiler (a trace capture): left out of the statistics
    boundary: str | None = None  # what closed a step: "scope.step", "optimizer.step", "backward", ...


@dataclass
class StepSeries:
    """Host step times over the whole run, warm-up and profiled steps included, in bounded memory: point ``i`` is
    the mean of steps ``[i * stride, (i + 1) * stride)`` counted from the first timed step (the last point may
    average fewer)."""

    stride: int
    step_ms: list[float]


@dataclass
class LossSeries:
    """The training loss of each measured step, read once when the run ends (never during it, which would add a
    host sync per step): the sum of the scalar tensors the step's backward passes began from (one per micro-batch,
    each as the script scaled it), for the first ``MAX_LOSS_STEPS`` measured steps. ``steps[i]`` is the measured
    step's index from 0; a step whose loss was not finite has None. Runs of a seeded script see the same batches,
    so the losses of two runs compare step by step: what a setting that changes numerics did to training."""

    steps: list[int]
    values: list[float | None]


MAX_LOSS_STEPS = 1024


@dataclass
class Overhead:
    """stepscope's own cost in this run, measured in it (instrument/own_cost.py): its hook handlers' time and its
    threads' CPU over the measured steps, per measured step."""

    us_per_step: float  # hooks + threads, µs per measured step
    share: float | None  # of the mean measured step (0.01 = 1%); None without a step time
    hooks_us_per_step: float
    threads_us_per_step: float | None  # None where the threads' CPU cannot be read
    how: str  # what was measured, and what was not


@dataclass
class PhaseStats:
    """One phase over the measured steps in which it ran. Host wall time; device time when CUDA-timed."""

    mean_ms: float
    median_ms: float
    p95_ms: float
    share: float  # of total measured step time (host wall), 0..1
    steps: int  # measured steps in which the phase ran
    nested: bool = False  # ran inside another phase: its time is already in the enclosing phase's share
    device_mean_ms: float | None = None
    device_median_ms: float | None = None
    device_p95_ms: float | None = None
    device_share: float | None = None  # of total measured step time (host wall), 0..1
    # the share (0..1) of the device time in which the GPU only followed the host: it had done the phase's work by
    # the time the host ended the phase (measured on probed steps; null where none was probed)
    device_host_paced: float | None = None

    def gpu_work_share(self) -> float | None:
        """``device_share`` less the part in which the GPU only followed the host (``device_host_paced``): the
        share of the step (0..1) that GPU work set the pace of. None without device time."""
        if self.device_share is None:
            return None
        return self.device_share * (1.0 - (self.device_host_paced or 0.0))


@dataclass
class Throughput:
    """Rates over the measured steps; samples_per_s is null when no batch size was known.

    ``steps_per_s``/``samples_per_s`` are the *step rate*: training steps over the time spent in them. The
    ``wall_`` rates are the *wall rate*: the same steps and samples over the measured wall window (validation
    passes and time between steps included). A synchronous multi-rank job's rates are the job's: every rank's
    samples over the slowest rank's time."""

    steps_per_s: float | None = None
    samples_per_s: float | None = None
    wall_steps_per_s: float | None = None
    wall_samples_per_s: float | None = None
    step_time_ms: float | None = None
    gpu_excess_ms: float | None = None  # the GPU's time per step beyond the host's, in step_time_ms (host ahead)
    flops_per_step: int | None = None  # model FLOPs of one forward+backward (FlopCounterMode), when counted
    tflops: float | None = None  # achieved: flops_per_step / mean step time
    mfu: float | None = None  # tflops / the GPU's dense peak for the training dtype, 0..1
    mfu_peak: str | None = None  # the peak used, e.g. "NVIDIA H100 80GB HBM3 bfloat16 dense 989.4 TFLOP/s"


@dataclass
class Wall:
    """The measured wall window, accounted once: ``window_s = steps_s + eval_s + between_s`` (s). The window runs
    from the start of the first measured step (or of a validation pass before it) to the end of the last one."""

    window_s: float = 0.0
    steps_s: float = 0.0  # inside measured training steps
    eval_s: float = 0.0  # inside validation passes
    between_s: float = 0.0  # in neither: steps torch.profiler recorded, stepscope's own checkpoint writes, ...


def is_final(summary: RunSummary) -> bool:
    """Whether a process's summary is the one it wrote at its end, not a checkpoint written while it ran."""
    return summary.exit is None or summary.exit.reason != "running"


def describe_value(value: Any) -> str:
    """A fix's value as a person writes it on the command line: on/off, a number, a precision."""
    return ("on" if value else "off") if isinstance(value, bool) else str(value)


@dataclass
class Fix:
    """One ranked fix: what to change, why, and how much it can gain at most."""

    id: str
    title: str
    why: str
    evidence: list[str]
    how: str
    cost: str  # "config" < "code" < "infra"
    gain_bound: float | None  # upper bound on the step-time saving, 0..1; null when it cannot be bounded
    gain_reason: str = ""
    changes_numerics: bool = False
    gain_basis: str = "step"  # what gain_bound is a share of: "step" time, or "wall" time (outside the steps)
    # `--apply` argument with every value the evidence recommends, settings joined by commas
    # (loader.num_workers=2,loader.persistent_workers)
    apply: str | None = None
    # `doctor --verify`: what the fix gained when applied, from interleaved runs: speedup, ci_low, ci_high, runs
    # ([baseline, with the fix]), verdict, applied (--apply argument), flag (why the doctor should learn from it)
    measured: dict[str, Any] | None = None


@dataclass
class Meta:
    """Where and how the run was measured."""

    stepscope_version: str = ""
    torch_version: str | None = None
    device: str = "cpu"
    timing: str = "host"  # "host" (perf_counter) or "cuda" (CUDA events for device time)
    started_at: str = ""  # ISO 8601, UTC
    command: str = ""
    hostname: str = ""
    python_version: str = ""
    rank: int | None = None  # global rank (torch.distributed, else the launcher's RANK / SLURM_PROCID / OMPI_*)
    local_rank: int | None = None
    world_size: int | None = None
    node_rank: int | None = None  # the node's index in the job, where the launcher says (GROUP_RANK, SLURM_NODEID)
    job_id: str | None = None  # which job the rank belongs to: "slurm:JOB.STEP", "torchrun:RUN_ID", "rendezvous:H:P"
    pid: int | None = None  # the measured process (with hostname and rank: which process wrote a summary)
    launch_id: str | None = None  # the `stepscope run` that started it (several share a `--out` folder)

    @property
    def node(self) -> str:
        """The node the process ran on, in words: its host, and the launcher's node index where there is one (two
        nodes of a job may share a host name: containers, or a test on one machine)."""
        host = self.hostname or "?"
        return host if self.node_rank is None else f"{host} (node {self.node_rank})"


@dataclass
class LoaderInfo:
    """A DataLoader the run iterated, its settings, and what was fetched from it."""

    index: int
    dataset: str
    batch_size: int | None
    num_workers: int
    pin_memory: bool
    persistent_workers: bool
    prefetch_factor: int | None
    drop_last: bool
    iterable: bool  # an IterableDataset (no sampler, maybe no length)
    length: int | None  # batches per epoch, when known
    batches: int = 0
    samples: int = 0
    fetch_s: float = 0.0
    eval_batches: int = 0  # of ``batches``, fetched inside validation passes
    eval_fetch_s: float = 0.0  # of ``fetch_s``, inside validation passes
    tensors_per_batch: int = 0  # tensors in its first batch (up to 64): each crosses from a worker process apart
    # of a step's fetches outside validation passes, those past the batches its workers hold ready (num_workers ×
    # prefetch_factor; gradient accumulation takes several a step): how many, and their wait (s)
    burst_fetches: int = 0
    burst_fetch_s: float = 0.0

    @property
    def step_fetch_s(self) -> float:
        """Time (s) the training steps waited on this loader: its fetches outside validation passes (iterated on
        another thread than the steps', a prefetcher's: the fetches' own time, which the steps wait for only where
        it does not overlap them)."""
        return max(self.fetch_s - self.eval_fetch_s, 0.0)


@dataclass
class Epoch:
    """One pass over a DataLoader (a fresh iterator over it)."""

    loader: int
    index: int
    time_s: float
    batches: int
    samples: int
    start_stall_ms: float | None  # from iter(loader) to the first batch: worker start-up and first fetch
    complete: bool  # ended by exhausting the loader (not cut short by the end of the run)


@dataclass
class Exit:
    """How the measured process ended."""

    # "finished" | "stopped" (after --steps) | "error" | "interrupted" | "terminated" | "killed" (only a checkpoint
    # was left) | "running" (a checkpoint written while the process ran) | "timeout" (one run of several ended by
    # stepscope past its time limit)
    reason: str = "finished"
    code: int | None = None
    error: str | None = None
    at: float | None = None  # Unix time (s) of the failure: the error, the signal (None for finished/stopped)
    # Where the training thread waited when checkpoints found no step closed for --checkpoint-s: since (Unix time of
    # the last step closed), steps, where (file:line), code, calls, collective, stack (see instrument/checkpoint.py)
    hung: dict[str, Any] | None = None
    cause_rank: int | None = None  # merged runs: the rank that failed first (the others' failures follow from it)


@dataclass
class Straggler:
    """The slowest rank and the phase that makes it slow."""

    rank: int
    phase: str
    excess_ms: float  # that rank's mean time in the phase above the median of the other ranks
    # The ranks that wait for it in collectives: their `comms` time per step clearly above the straggler's own.
    waiting_ranks: list[int] = field(default_factory=list)
    node: str | None = None  # the straggler's host, when the ranks ran on more than one
    wait_ms: float | None = None  # the median of the waiting ranks' mean comms time per step
    own_comms_ms: float | None = None  # the straggler's own mean comms time per step (the collectives' own cost)


@dataclass
class Cluster:
    """Figures across the ranks of a multi-rank run."""

    world_size: int
    ranks_reported: list[int]
    samples_per_s: float | None  # the job's (merge.job_throughput): the sum over ranks only where none waits
    phases: dict[str, dict[str, float]] = field(default_factory=dict)  # name -> {min_ms, mean_ms, max_ms}
    straggler: Straggler | None = None
    missing_ranks: list[int] = field(default_factory=list)  # ranks of the world that wrote no summary
    # One entry per node, when the ranks ran on more than one: node, ranks, samples_per_s (sum), step_ms and
    # comms_ms (means over its ranks)
    nodes: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class RunSummary:
    """Everything stepscope measured and concluded about one run (or one rank of a run)."""

    steps: Steps = field(default_factory=Steps)
    phases: dict[str, PhaseStats] = field(default_factory=dict)
    throughput: Throughput = field(default_factory=Throughput)
    verdict: Verdict = field(default_factory=Verdict)
    fixes: list[Fix] = field(default_factory=list)
    system: dict[str, Any] = field(default_factory=dict)
    ranks: list[RunSummary] = field(default_factory=list)
    meta: Meta = field(default_factory=Meta)
    notes: list[str] = field(default_factory=list)
    loaders: list[LoaderInfo] = field(default_factory=list)
    epochs: list[Epoch] = field(default_factory=list)
    counters: dict[str, float] = field(default_factory=dict)  # per measured step: item_calls, host_syncs, ...
    exit: Exit | None = None
    cluster: Cluster | None = None
    params: list[dict[str, Any]] = field(default_factory=list)  # `stepscope params`: one audit per model
    facts: dict[str, Any] = field(default_factory=dict)  # runtime settings the doctor reads (docs/summary-schema.md)
    dataloader: dict[str, Any] = field(default_factory=dict)  # `stepscope dataloader`: the loader measured alone
    series: StepSeries | None = None  # step times over the run (per rank in a merged summary)
    pipeline: dict[str, Any] = field(default_factory=dict)  # PipelineMonitor's last snapshot (docs/pipeline.md)
    trace: dict[str, Any] = field(default_factory=dict)  # highlights of the run's torch.profiler traces
    eval: dict[str, Any] = field(default_factory=dict)  # validation passes between training steps, kept apart
    hotspots: dict[str, Any] = field(default_factory=dict)  # per phase: the source lines host time was spent on
    # `--apply`: the fixes stepscope applied to the run itself, each {id, value, applied, where, why}
    applied: list[dict[str, Any]] = field(default_factory=list)
    wall: Wall | None = None  # where the measured window's wall time went (per rank in a merged summary)
    invariants: list[str] = field(default_factory=list)  # the figures' broken invariants, one sentence each
    loss: LossSeries | None = None  # each measured step's training loss (per rank in a merged summary)
    overhead: Overhead | None = None  # stepscope's own cost per step (the slowest rank's share in a merged summary)
    schema_version: int = SCHEMA_VERSION

    @property
    def world_size(self) -> int:
        """Processes in the run: the cluster's (a merged multi-rank summary), else the meta's, else 1."""
        if self.cluster is not None:
            return self.cluster.world_size
        return self.meta.world_size or 1

    @property
    def batch_per_rank(self) -> float | None:
        """Samples per optimizer step on one rank (gradient accumulation included): samples/s over steps/s, the
        mean over the ranks that know both; None when no batch size was known."""
        ratios = [
            r.throughput.samples_per_s / r.throughput.steps_per_s
            for r in self.ranks or [self]
            if r.throughput.samples_per_s and r.throughput.steps_per_s
        ]
        return sum(ratios) / len(ratios) if ratios else None

    def to_dict(self) -> dict[str, Any]:
        """The JSON-ready form, ``schema_version`` first."""
        data = dataclasses.asdict(self)
        return {"schema_version": data.pop("schema_version"), **data}

    def to_json(self, path: str | Path | None = None) -> str:
        """Serialise to indented JSON; also writes it to ``path`` when given (parents created)."""
        text = orjson.dumps(self.to_dict(), option=orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY).decode()
        if path is not None:
            path = Path(path)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text + "\n")
        return text

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "summary") -> RunSummary:
        """Build from the JSON form, upgrading older schema versions; raises SummaryError with the reason."""
        if not isinstance(data, dict) or "schema_version" not in data:
            raise SummaryError(f"{source} is not a stepscope summary: it has no schema_version field.")
        version = data["schema_version"]
        if not isinstance(version, int) or version < 1:
            raise SummaryError(f"{source} has an invalid schema_version {version!r}.")
        if version > SCHEMA_VERSION:
            raise SummaryError(
                f"{source} was written with summary schema {version}, but this stepscope reads schema "
                f"{SCHEMA_VERSION} and older: upgrade stepscope to read it."
            )
        while version < SCHEMA_VERSION:
            data = _UPGRADES[version](data)
            version = data["schema_version"]
        unknown = sorted(set(data) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise SummaryError(f"{source} has fields that summary schema {SCHEMA_VERSION} does not know: {unknown}.")
        ranks = data.get("ranks", [])
        try:
            if not isinstance(ranks, list):
                raise _Mismatch(f"ranks should be a list, got {_shown(ranks)}")
            summary = _build(cls, {**data, "ranks": [], "schema_version": version}, "")
        except _Mismatch as exc:
            raise SummaryError(f"{source} does not match summary schema {SCHEMA_VERSION}: {exc}.") from None
        summary.ranks = [cls.from_dict(r, source=f"{source} (rank entry {i})") for i, r in enumerate(ranks)]
        _check_vocabulary(summary, source)
        return summary

    @classmethod
    def from_json(cls, path: str | Path) -> RunSummary:
        """Load a summary file written by ``to_json``."""
        path = Path(path)
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            raise SummaryError(f"no summary file at {path}.") from None
        except OSError as exc:
            raise SummaryError(f"cannot read summary {path}: {exc.strerror}.") from exc
        try:
            data = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise SummaryError(f"{path} is not valid JSON ({exc}).") from exc
        return cls.from_dict(data, source=str(path))


def read_summaries(paths: Iterable[Path], keep: Callable[[RunSummary], bool]) -> tuple[list[RunSummary], list[str]]:
    """The summaries in ``paths`` that ``keep`` accepts, and a note for each file that could not be read (a folder
    being written into: the next read gets it)."""
    found, notes = [], []
    for path in paths:
        try:
            summary = RunSummary.from_json(path)
        except SummaryError as error:
            notes.append(f"a rank's summary could not be read: {error}")
            continue
        if keep(summary):
            found.append(summary)
    return found, notes


def summary_files(paths: Iterable[str | Path]) -> tuple[list[Path], list[tuple[str, str]]]:
    """The summary files named by ``paths`` (a folder: the ``*.json`` directly in it, sorted), each once, in the
    order given; and (path, why) for each path that gave none: it does not exist, or is a folder without any."""
    files: list[Path] = []
    problems: list[tuple[str, str]] = []
    seen: set[Path] = set()
    for item in paths:
        text, path = str(item), Path(item)
        if path.is_dir():
            found = sorted(path.glob("*.json"))
            if not found:
                problems.append((text, f"{text} is a folder with no *.json file in it."))
        elif path.exists():
            found = [path]
        else:
            problems.append((text, f"{text}: no such file or folder."))
            found = []
        for file in found:
            if file.resolve() not in seen:
                seen.add(file.resolve())
                files.append(file)
    return files, problems


def _check_vocabulary(summary: RunSummary, source: str) -> None:
    if summary.verdict.bound not in BOUNDS:
        raise SummaryError(f"{source} has an unknown verdict bound {summary.verdict.bound!r} (one of {BOUNDS}).")
    for fix in summary.fixes:
        if fix.cost not in COSTS:
            raise SummaryError(f"{source}: fix {fix.id!r} has an unknown cost {fix.cost!r} (one of {COSTS}).")


class _Mismatch(ValueError):
    """A value of a loaded summary that does not fit its field's type; the message names the field's path."""


_NAMES = {float: "a number", int: "an integer", str: "a string", bool: "true or false"}


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _build(cls: type, data: Any, path: str) -> Any:
    """An instance of dataclass ``cls`` from a JSON object, every field checked against its type hint."""
    where = path or "the summary"
    if not isinstance(data, dict):
        raise _Mismatch(f"{where} should be an object ({cls.__name__}), got {_shown(data)}")
    hints = _hints(cls)
    unknown = sorted(set(data) - set(hints))
    if unknown:
        raise _Mismatch(f"{where} ({cls.__name__}) has unknown fields {unknown}")
    prefix = f"{path}." if path else ""
    values = {name: _typed(value, hints[name], prefix + name) for name, value in data.items()}
    try:
        return cls(**values)
    except TypeError as exc:  # a required field is missing: the constructor names it
        raise _Mismatch(f"{where}: {exc}") from None


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _typed(value: Any, hint: Any, path: str) -> Any:
    """``value`` checked against the type ``hint`` of the field at ``path`` (ints stand for floats, not bools)."""
    if hint is Any:
        return value
    origin = typing.get_origin(hint)
    if origin is typing.Union or origin is types.UnionType:
        if value is None and type(None) in typing.get_args(hint):
            return None
        (inner,) = [arg for arg in typing.get_args(hint) if arg is not type(None)]  # the schema's unions: X | None
        return _typed(value, inner, path)
    if origin is list:
        if not isinstance(value, list):
            raise _Mismatch(f"{path} should be a list, got {_shown(value)}")
        (item,) = typing.get_args(hint)
        return [_typed(v, item, f"{path}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise _Mismatch(f"{path} should be an object, got {_shown(value)}")
        _, item = typing.get_args(hint)  # keys are strings: JSON has no others
        return {key: _typed(v, item, f"{path}.{key}") for key, v in value.items()}
    if dataclasses.is_dataclass(hint):
        return _build(hint, value, path)
    kind = type(value)  # exact types: True is no number here, 1 no boolean
    if hint is float and (kind is float or kind is int):
        return float(value)
    if hint is int and kind is float and value.is_integer():  # JSON does not tell 5 from 5.0
        return int(value)
    if kind is hint:
        return value
    raise _Mismatch(f"{path} should be {_NAMES.get(hint, hint)}, got {_shown(value)}")


def _add_facts(data: dict[str, Any]) -> dict[str, Any]:
    return {**data, "facts": {}, "dataloader": {}, "schema_version": 2}


def _add_series(data: dict[str, Any]) -> dict[str, Any]:
    return {**data, "series": None, "pipeline": {}, "trace": {}, "schema_version": 3}


def _add_eval(data: dict[str, Any]) -> dict[str, Any]:
    return {**data, "eval": {}, "hotspots": {}, "schema_version": 4}


def _add_applied(data: dict[str, Any]) -> dict[str, Any]:
    return {**data, "applied": [], "schema_version": 5}  # Meta's node fields and Cluster's lists have defaults


def _add_wall(data: dict[str, Any]) -> dict[str, Any]:
    return {**data, "wall": None, "invariants": [], "schema_version": 6}  # Throughput's wall rates have defaults


def _add_loss_overhead(data: dict[str, Any]) -> dict[str, Any]:
    return {**data, "loss": None, "overhead": None, "schema_version": 7}


def _add_gpu_excess(data: dict[str, Any]) -> dict[str, Any]:
    return {**data, "schema_version": 8}  # Throughput.gpu_excess_ms has a default


# schema_version N -> N+1: each entry turns a loaded dict of version N into version N+1.
_UPGRADES: dict[int, Any] = {
    1: _add_facts,
    2: _add_series,
    3: _add_eval,
    4: _add_applied,
    5: _add_wall,
    6: _add_loss_overhead,
    7: _add_gpu_excess,
}
