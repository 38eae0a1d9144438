"""The input pipeline alone: how fast a DataLoader can deliver batches, and which settings make it fastest.

``measure_loader`` iterates a loader with no model, optimizer or collective attached: its rate is the *ceiling*
of the input pipeline, what it could feed a trainer that took no time. Fetch times are host time inside the
iterator's ``__next__``; with a device, each batch is also copied there (``non_blocking`` when the loader pins
memory), the copy timed with device events read at the end (this is not a training loop: one synchronisation
after the last batch is fine).

``sweep_loader`` rebuilds the loader around the same dataset, sampler, collate function and batch size with other
``num_workers`` / ``prefetch_factor`` / ``pin_memory`` settings, measures each within a time budget (after its
own warm-up; worker start-up reported apart), records the peak RSS of the process tree per setting, and names the
fastest setting that leaves memory to spare. A trial's window is complete: at the end of the data the loader
starts a new epoch (its restart cost counted), and a trial whose window could not be completed is flagged, never
named best. Worker counts stop at ``worker_cap`` (the rule the doctor's advice uses too) unless the workers are
measured to mostly wait.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from stepscope.clock import HOST_ONLY, CudaEvents, DeviceTimer, EventSource, HostOnly, cuda_available, now_ns
from stepscope.collectors.host import thread_busy_ns

if TYPE_CHECKING:
    from stepscope.summary import RunSummary

# A fetch-time distribution is bimodal (most batches wait for nothing, some block on a worker) when the median is
# below BIMODAL_MEDIAN of the mean and the p95 above BIMODAL_P95 times the median (and above 0.05 ms).
BIMODAL_MEDIAN = 0.2
BIMODAL_P95 = 4.0
BOTTLENECK_MARGIN = 1.1  # a ceiling at or below 1.1x the training rate leaves the trainer waiting on data
MEMORY_SAFETY = 0.8  # a setting is safe when its peak RSS stays under this share of the memory it could use
SWEEP_INTERVAL_S = 0.1  # RSS/CPU sampling period during a sweep trial
WAITING_WORKERS_CPU = 0.5  # workers using less than half a core each mostly wait: more of them than cores can help
MAX_WORKERS = 32
# Past the cap, the most workers so far are doubled while they keep within 10% of the fastest trial with workers.
KEEP_UP = 0.9
# Ranked by a training step's rate, settings within 2% of the fastest tie (the step sets their pace): the fewest
# workers among them is named best.
STEP_PACE_TIE = 0.02
# torch warns at DataLoader() of more workers than it suggests; the sweep builds such loaders on purpose (waiting
# workers), and the warning would speak of the sweep's trials as if they were the user's loader.
WORKER_COUNT_WARNING = "This DataLoader will create"


class LoaderError(ValueError):
    """A loader that cannot be measured or rebuilt, with the reason."""


class LoaderTimeout(LoaderError):
    """The time limit ran out before any batch past the warm-up was fetched."""


@dataclass
class LoaderSettings:
    """The DataLoader knobs a sweep varies."""

    num_workers: int
    prefetch_factor: int | None
    pin_memory: bool
    persistent_workers: bool

    def snippet(self) -> str:
        """The settings as DataLoader keyword arguments."""
        parts = [f"num_workers={self.num_workers}"]
        if self.num_workers > 0:
            parts += [f"prefetch_factor={self.prefetch_factor or 2}", f"persistent_workers={self.persistent_workers}"]
        parts.append(f"pin_memory={self.pin_memory}")
        return f"DataLoader(dataset, ..., {', '.join(parts)})"


@dataclass
class LoaderResult:
    """One loader measured alone. Rates are over the measured batches (after warm-up)."""

    samples_per_s: float | None
    batches_per_s: float
    fetch_ms: dict[str, float]  # mean, median, p95 of the host time inside __next__
    h2d_ms: float | None  # mean device time of the copy to ``device``; None without a device
    settings: LoaderSettings | None  # None when the iterable is not a DataLoader
    bimodal: bool
    batches: int  # measured batches
    warmup: int
    startup_s: float  # from iter(loader) to the first batch: worker start-up and the first fetch
    ended_early: bool = False  # the loader ran out before warmup + batches
    notes: list[str] = field(default_factory=list)
    epochs: int = 1  # iterators started: more than 1 when ``restart`` began new epochs to complete the window
    # the calling process's own time per measured batch (ms): with num_workers=0 the whole fetch (it loads the batch
    # itself); with workers its CPU time (receiving, unpickling, pinning), what a training step still pays for them
    main_ms: float | None = None
    # share of the measured window the calling thread was on a CPU or waiting for one (%): with num_workers=0 near
    # 100 when fetching computes, even on a busy machine, low when it waits (storage, network, a sleep); None where
    # the kernel does not report it (no /proc/thread-self/schedstat)
    busy_pct: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @property
    def meaning(self) -> str:
        """What the fetch-time distribution says, in one sentence."""
        if self.bimodal:
            return (
                "bimodal fetch times: most batches come straight from the prefetch buffer and some block on a "
                "worker; more workers or a deeper prefetch_factor smooth it"
            )
        if self.settings is not None and self.settings.num_workers == 0:
            meaning = "every batch is built in the calling process: the fetch time is the full cost of a batch"
            if self.busy_pct is None:
                return meaning
            if self.busy_pct < 100 * WAITING_WORKERS_CPU:
                return (
                    f"{meaning}; it kept the process busy {self.busy_pct:.0f}% of the time, so it mostly waits "
                    "(storage, network, a sleep): workers past the cores overlap the waits"
                )
            return (
                f"{meaning}; it kept the process busy {self.busy_pct:.0f}% of the time (on a CPU or waiting for one), "
                "so it computes: workers help up to the cores that can be spared"
            )
        return "steady fetch times: the workers keep up evenly, or are uniformly too slow"


@dataclass
class SweepTrial:
    """One setting of a sweep: its rate, start-up, memory, or why it could not be measured."""

    settings: LoaderSettings
    samples_per_s: float | None = None
    batches_per_s: float | None = None
    startup_s: float | None = None
    peak_rss_mb: float | None = None
    workers_cpu_pct: float | None = None
    # % of wall time the workers were runnable but waiting for a CPU (summed over them; None: not measured): CPU they
    # wanted, as much as what they used
    workers_cpu_wait_pct: float | None = None
    safe: bool = True  # peak RSS leaves memory to spare
    error: str | None = None
    incomplete: str | None = None  # why the measured window is partial (out of data, budget): listed, never best
    main_ms: float | None = None  # the training process's own time per batch (LoaderResult.main_ms)
    # samples/s a trainer taking ``SweepResult.trainer_ms_per_sample`` besides its data would reach with this setting
    train_samples_per_s: float | None = None


@dataclass
class SweepResult:
    """All trials, sorted by samples/s (fastest first), the best safe one, and what was not tried."""

    current: LoaderSettings
    trials: list[SweepTrial]
    best: SweepTrial | None
    gain: float | None  # best samples/s over the current setting's, minus 1 (0.5 = 50% faster)
    skipped: list[str] = field(default_factory=list)  # settings not tried, each with why
    budget_s: float = 0.0
    elapsed_s: float = 0.0
    notes: list[str] = field(default_factory=list)
    # the trainer's own time per sample besides data loading (ms), when known: trials are then ranked by the rate
    # that trainer would reach (``training_rate``), not by the loader's rate alone
    trainer_ms_per_sample: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def settings_of(loader: Any) -> LoaderSettings | None:
    """The sweepable settings of a DataLoader; None for any other iterable."""
    if not hasattr(loader, "num_workers"):
        return None
    workers = int(loader.num_workers)
    return LoaderSettings(
        num_workers=workers,
        prefetch_factor=loader.prefetch_factor if workers > 0 else None,
        pin_memory=bool(loader.pin_memory),
        persistent_workers=bool(loader.persistent_workers),
    )


def _batch_samples(batch: Any) -> int | None:
    from stepscope.analyses.batches import batch_samples

    return batch_samples(batch) or None


def _to_device(batch: Any, device: Any, non_blocking: bool) -> Any:
    import torch

    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=non_blocking)
    if isinstance(batch, (list, tuple)):
        moved = [_to_device(x, device, non_blocking) for x in batch]
        return type(batch)(*moved) if hasattr(batch, "_fields") else type(batch)(moved)  # namedtuples too
    if isinstance(batch, dict):
        return {k: _to_device(v, device, non_blocking) for k, v in batch.items()}
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        names = [f.name for f in dataclasses.fields(batch) if f.init]  # what replace() takes
        return dataclasses.replace(batch, **{n: _to_device(getattr(batch, n), device, non_blocking) for n in names})
    return batch


def is_bimodal(fetch_ms: list[float]) -> bool:
    """True when the fetch times split into buffer hits (≈0) and blocking waits (see BIMODAL_*)."""
    if len(fetch_ms) < 10:
        return False
    mean = statistics.fmean(fetch_ms)
    median = statistics.median(fetch_ms)
    p95 = _quantile(fetch_ms, 0.95)
    return median < BIMODAL_MEDIAN * mean and p95 > BIMODAL_P95 * max(median, 0.05)


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    position = q * (len(ordered) - 1)
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def _shut_down(iterator: Iterator[Any]) -> None:
    """Stop a failed iterator's workers now. The exception's traceback holds the iterator (torch's frames refer to
    it), so its workers would live until a garbage collection, whose join then waits 5 s for each of them."""
    shutdown = getattr(iterator, "_shutdown_workers", None)
    if shutdown is not None:
        shutdown()


def measure_loader(
    loader: Any,
    batches: int = 300,
    warmup: int = 20,
    device: str | None = None,
    time_limit_s: float | None = None,
    clock: Callable[[], int] = now_ns,
    events: EventSource | None = None,
    restart: bool = False,
) -> LoaderResult:
    """Iterate ``loader`` alone: ``warmup`` batches, then up to ``batches`` measured ones (fewer when it ends or
    ``time_limit_s`` runs out, said in ``notes``). ``device`` ("cuda", "cuda:1") also copies each batch there and
    times the copy with device events (``events`` is a seam for tests). With ``restart``, the end of the data
    starts a new epoch (``iter(loader)`` again) so that the window holds ``batches`` batches; the restart happens
    inside the fetch of the next batch, so its cost (new workers without persistent_workers, an emptied prefetch
    pipeline either way) is in the window; it ends early only when a new epoch yields nothing. Rates in samples/s
    and batches/s."""
    if batches < 1 or warmup < 0:
        raise LoaderError(f"batches must be >= 1 and warmup >= 0, got batches={batches}, warmup={warmup}")
    settings = settings_of(loader)
    timer: HostOnly | DeviceTimer = HOST_ONLY
    if device is not None:
        timer = DeviceTimer(events if events is not None else _cuda_events(device))
    non_blocking = settings is not None and settings.pin_memory
    t_iter = clock()
    cpu_start, busy_start, wall_start = 0.0, None, 0
    iterator: Iterator[Any] = iter(loader)
    fetch_ns: list[int] = []
    samples: list[int | None] = []
    startup_ns = 0
    measured_start = 0
    seen = 0
    deadline = None if time_limit_s is None else t_iter + int(time_limit_s * 1e9)
    ended = False
    epochs = 1
    while len(fetch_ns) < batches:
        if seen == warmup:
            cpu_start, busy_start, wall_start = time.process_time(), thread_busy_ns(), time.perf_counter_ns()
        t0 = clock()
        try:
            batch = next(iterator)
        except StopIteration:
            if not restart:
                ended = True
                break
            epochs += 1
            iterator = iter(loader)
            try:
                batch = next(iterator)
            except StopIteration:  # a new epoch with nothing in it: the data cannot fill the window
                ended = True
                break
            except BaseException:
                _shut_down(iterator)
                raise
        except BaseException:
            _shut_down(iterator)
            raise
        t1 = clock()
        if seen == 0:
            startup_ns = t1 - t_iter
        seen += 1
        if seen == warmup + 1:
            measured_start = t0
        if device is not None:
            start = timer.start()
            batch = _to_device(batch, device, non_blocking)
            timer.stop("h2d", start)
            timer.close_step(seen)
        if seen > warmup:
            fetch_ns.append(t1 - t0)
            samples.append(_batch_samples(batch))
        if deadline is not None and clock() > deadline:
            break
    measured_end = clock()
    cpu_s = time.process_time() - cpu_start
    busy_end, wall_ns = thread_busy_ns(), time.perf_counter_ns() - wall_start
    del iterator  # shuts the workers down (unless persistent)
    notes = []
    if not fetch_ns:
        if not ended:
            raise LoaderTimeout(f"the time limit ran out after {seen} batch(es), within the {warmup} warm-up batches.")
        raise LoaderError(
            f"the loader ended after {seen} batch(es), within the {warmup} warm-up batches: nothing was measured "
            "(lower --warmup)."
        )
    if ended and len(fetch_ns) < batches:
        notes.append(f"the loader ended after {seen} batches: {len(fetch_ns)} measured instead of {batches}")
    elif len(fetch_ns) < batches:
        notes.append(f"the time limit ended the measurement after {len(fetch_ns)} of {batches} batches")
    elapsed_s = (measured_end - measured_start) / 1e9
    fetch_ms = [ns / 1e6 for ns in fetch_ns]
    known = [s for s in samples if s is not None]
    h2d = [done.seconds["h2d"] for done in timer.drain() if "h2d" in done.seconds]
    in_process = settings is None or settings.num_workers == 0
    return LoaderResult(
        samples_per_s=sum(known) / elapsed_s if known and len(known) == len(samples) and elapsed_s > 0 else None,
        batches_per_s=len(fetch_ns) / elapsed_s if elapsed_s > 0 else math.inf,
        fetch_ms={
            "mean": statistics.fmean(fetch_ms),
            "median": statistics.median(fetch_ms),
            "p95": _quantile(fetch_ms, 0.95),
        },
        h2d_ms=1e3 * statistics.fmean(h2d[-len(fetch_ns) :]) if h2d else None,
        settings=settings,
        bimodal=is_bimodal(fetch_ms),
        batches=len(fetch_ns),
        warmup=warmup,
        startup_s=startup_ns / 1e9,
        ended_early=ended and len(fetch_ns) < batches,
        notes=notes,
        epochs=epochs,
        main_ms=statistics.fmean(fetch_ms) if in_process else 1e3 * max(cpu_s, 0.0) / len(fetch_ns),
        busy_pct=None
        if busy_start is None or busy_end is None or wall_ns <= 0
        else min(100.0, 100 * (busy_end - busy_start) / wall_ns),
    )


def _cuda_events(device: str) -> EventSource:
    import torch

    if not device.startswith("cuda") or not torch.cuda.is_available():
        raise LoaderError(
            f"cannot time copies to {device!r}: only CUDA devices are timed, and torch sees "
            f"{'no CUDA device' if not torch.cuda.is_available() else 'CUDA, but this is not one'}."
        )
    return CudaEvents()


# -- rebuilding and sweeping ---------------------------------------------------------------------------------------


def rebuild_loader(loader: Any, settings: LoaderSettings) -> Any:
    """A new DataLoader over the same dataset, sampler/batch sampler, collate function and batch size, with
    ``settings``; raises LoaderError when the loader cannot be rebuilt that way."""
    from torch.utils.data import BatchSampler, DataLoader

    common: dict[str, Any] = {
        "dataset": loader.dataset,
        "collate_fn": loader.collate_fn,
        "timeout": loader.timeout,
        "worker_init_fn": loader.worker_init_fn,
        "generator": loader.generator,
        "num_workers": settings.num_workers,
        "pin_memory": settings.pin_memory,
    }
    if settings.num_workers > 0:  # torch refuses these options without worker processes
        common["prefetch_factor"] = settings.prefetch_factor or 2
        common["persistent_workers"] = settings.persistent_workers
        common["multiprocessing_context"] = loader.multiprocessing_context
    if loader._dataset_kind == 1:  # an IterableDataset: no sampler to carry over
        return DataLoader(batch_size=loader.batch_size, drop_last=loader.drop_last, **common)
    batch_sampler = loader.batch_sampler
    if loader.batch_size is None and batch_sampler is None:  # automatic batching off: one sample per "batch"
        return DataLoader(batch_size=None, sampler=loader.sampler, **common)
    if type(batch_sampler) is BatchSampler and batch_sampler.sampler is loader.sampler:
        return DataLoader(batch_size=loader.batch_size, sampler=loader.sampler, drop_last=loader.drop_last, **common)
    return DataLoader(batch_sampler=batch_sampler, **common)  # a custom batch sampler, reused as it is


def worker_cap(cores: float, ranks_per_machine: int = 1) -> int:
    """Loader workers per rank the machine can run busy: the usable cores (cgroup quota, else CPU affinity) shared by
    the ranks on this machine, less one core for the training process itself; at least 1. The doctor's
    ``loader.num_workers`` advice and the sweep's worker counts both stop here (the sweep goes further only when
    the workers are measured to mostly wait)."""
    return max(1, int(cores // max(ranks_per_machine, 1)) - 1)


WAITING_WORKERS_MAX = 8  # workers that mostly sleep cost memory (a dataset copy, prefetched batches) but no core


def waiting_workers(fetch_ms: float, compute_ms: float, cap: int = WAITING_WORKERS_MAX) -> int:
    """Loader workers that hide a fetch that mostly waits (storage, network, a sleep) behind the rest of the step:
    each worker delivers a batch every ``fetch_ms``, the step takes one every ``compute_ms``, so ``fetch_ms /
    compute_ms`` workers keep up; at least 2, at most ``cap``. Cores do not bound them: waiting workers use none."""
    return max(2, min(cap, math.ceil(fetch_ms / max(compute_ms, 0.5))))


def machine_worker_cap() -> tuple[int, str]:
    """``worker_cap`` for this process (its cgroup quota, else its CPU affinity; torchrun's LOCAL_WORLD_SIZE ranks
    sharing them), and the figures it rests on, in words."""
    import os

    from stepscope.collectors.host import cgroup_cpu_quota, usable_cores

    quota = cgroup_cpu_quota()
    cores: float = quota if quota else usable_cores()
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE") or 1)
    what = f"{cores:g} {'cores of cgroup quota' if quota else 'usable cores'}"
    return worker_cap(cores, ranks), what + (f" for {ranks} ranks" if ranks > 1 else "")


def candidate_settings(current: LoaderSettings, max_workers: int, cuda: bool) -> list[LoaderSettings]:
    """The settings a sweep tries, in order: the current one first, then worker counts 0, 1, 2, 4, ... up to
    ``max_workers`` (``worker_cap``) and the current count, each with prefetch_factor 2 and then 4; pinned memory
    only when CUDA exists."""
    top = max(max_workers, 1)
    counts = sorted({0, current.num_workers, *(2**i for i in range(int(math.log2(top)) + 1)), top})
    pins = (False, True) if cuda else (False,)
    found = [current]
    for pin in pins:
        for factor in (2, 4):
            for workers in counts:
                if workers == 0 and factor == 4:
                    continue
                candidate = LoaderSettings(
                    num_workers=workers,
                    prefetch_factor=factor if workers > 0 else None,
                    pin_memory=pin,
                    persistent_workers=workers > 0,
                )
                if not any(_same(candidate, seen) for seen in found):
                    found.append(candidate)
    return found


def _same(a: LoaderSettings, b: LoaderSettings) -> bool:
    """Equal for throughput: persistent_workers changes the cost of each epoch's start, not the rate."""

    def key(x: LoaderSettings) -> tuple[int, int, bool]:
        return x.num_workers, x.prefetch_factor or 2, x.pin_memory

    return key(a) == key(b)


def trial_counts(loader: Any, settings: LoaderSettings, batches: int, warmup: int) -> tuple[int, int]:
    """(batches, warmup) of one sweep trial. The warm-up covers at least the batches the workers fetch ahead at
    ``iter()``, so that worker start-up and the first full prefetch buffer stay out of the window. When an epoch
    is no longer than the window, both are rounded up to whole epochs: the window then starts and ends with an
    empty pipeline, so every batch counted in it was loaded in it (a window that starts on a full buffer counts
    batches loaded before it, up to workers × prefetch_factor of them)."""
    warmup = max(warmup, settings.num_workers * (settings.prefetch_factor or 2))
    try:
        epoch = len(loader)
    except TypeError:  # an IterableDataset without __len__: no epoch length to align to
        return batches, warmup
    if 0 < epoch <= batches:
        return math.ceil(batches / epoch) * epoch, math.ceil(warmup / epoch) * epoch
    return batches, warmup


def sweep_loader(
    loader: Any,
    budget_s: float = 120.0,
    batches: int = 100,
    warmup: int = 10,
    device: str | None = None,
    cores: float | None = None,
    trainer_ms_per_sample: float | None = None,
) -> SweepResult:
    """Try the settings of ``candidate_settings`` on rebuilt copies of ``loader`` until ``budget_s`` seconds are
    spent; each trial measures at least ``batches`` batches after at least ``warmup`` (see ``trial_counts``),
    starting new epochs when the data runs out. Worker counts stop at ``worker_cap`` of ``cores`` (default: this
    process's cgroup quota, else its affinity) unless the workers mostly wait. Returns every trial (samples/s,
    start-up, peak RSS of the process tree, workers' CPU), the fastest safe complete one and its gain over the
    current setting.

    ``trainer_ms_per_sample``: the training step's own time per sample besides waiting for data (ms), when known
    (`stepscope dataloader --against RUN.json`). Trials are then ranked by the rate that trainer would reach
    (``training_rate``): with num_workers=0 the training process loads each batch itself, so its loading adds to
    the step instead of overlapping it; of the settings within ``STEP_PACE_TIE`` of the fastest, the one with the
    fewest workers is named best. Without it they are ranked by the loader's rate alone, and a note says from
    which step time a worker setting would beat num_workers=0 when that is the fastest alone."""
    from stepscope.collectors import start_collectors

    started = time.monotonic()
    current = settings_of(loader)
    if current is None:
        raise LoaderError(f"a {type(loader).__name__} is not a DataLoader: there are no loader settings to sweep.")
    if cores is None:
        cap, cap_basis = machine_worker_cap()
    else:
        cap, cap_basis = worker_cap(cores), f"{cores:g} usable cores"
    cuda = cuda_available()
    candidates = candidate_settings(current, cap, cuda)
    notes = []
    if not cuda:
        notes.append("pin_memory was not tried: torch sees no CUDA device, so pinned memory would change nothing")
    if loader._dataset_kind == 1:
        notes.append(
            "an IterableDataset: with several workers each worker iterates the whole dataset unless its __iter__ "
            "splits the work with get_worker_info(); the rates assume it does"
        )
    trials: list[SweepTrial] = []
    skipped: list[str] = []
    index = 0
    while True:
        if index == len(candidates):
            widest = _widest(trials)  # workers that mostly wait: try more of them than the cap
            more = [] if widest is None else _beyond_cores(widest, candidates)
            if not more:
                break
            if all(c.num_workers <= cap for c in candidates):
                notes.append(_beyond_note(widest, cap, cap_basis))
            candidates += more
        settings = candidates[index]
        index += 1
        trial_batches, trial_warmup = trial_counts(loader, settings, batches, warmup)
        left = budget_s - (time.monotonic() - started)
        if left <= 0 or (index > 1 and _expected_cost(trials, trial_warmup + trial_batches) > left):
            skipped += [f"{s.snippet()}: the {budget_s:g} s budget ran out" for s in candidates[index - 1 :]]
            break
        trial = SweepTrial(settings)
        collectors = None
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=WORKER_COUNT_WARNING)
                try:
                    rebuilt = loader if index == 1 else rebuild_loader(loader, settings)
                except Exception as error:
                    skipped.append(
                        f"{settings.snippet()}: the loader cannot be rebuilt ({type(error).__name__}: {error})"
                    )
                    continue
                collectors = start_collectors(SWEEP_INTERVAL_S)
                result = measure_loader(
                    rebuilt,
                    batches=trial_batches,
                    warmup=trial_warmup,
                    device=device,
                    time_limit_s=left,
                    restart=True,
                )
            trial.samples_per_s, trial.batches_per_s = result.samples_per_s, result.batches_per_s
            trial.startup_s, trial.main_ms = result.startup_s, result.main_ms
            if trainer_ms_per_sample is not None:
                trial.train_samples_per_s = training_rate(trial, trainer_ms_per_sample)
            trial.incomplete = _incomplete(result, trial_batches, trial_warmup, budget_s)
        except LoaderTimeout:
            skipped.append(f"{settings.snippet()}: the {budget_s:g} s budget ran out during its warm-up")
            continue
        except Exception as error:  # a worker crash or a pickling failure: this setting only
            trial.error = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}".rstrip(": ")
        finally:
            host = collectors.stop().get("host", {}) if collectors is not None else {}
        trial.peak_rss_mb = host.get("peak_rss_mb")
        trial.workers_cpu_pct = host.get("workers_cpu_util_pct")
        trial.workers_cpu_wait_pct = host.get("run_delay_workers_pct")
        available = host.get("mem_available_min_mb")
        if trial.peak_rss_mb is not None and available is not None:
            # The tree's RSS at its peak must fit in what was free plus what the tree already held.
            trial.safe = trial.peak_rss_mb <= MEMORY_SAFETY * (available + trial.peak_rss_mb)
        trials.append(trial)
    measured = [t for t in trials if _complete(t)]
    flagged = [t for t in trials if t.error is None and t.batches_per_s is not None and t not in measured]
    rate = _rate
    ranked = sorted(measured, key=lambda t: -rate(t)) + flagged + [t for t in trials if t.error is not None]
    safe = [t for t in ranked if t in measured and t.safe]
    best = safe[0] if safe else None
    if best is not None and trainer_ms_per_sample is not None:
        # once the step sets the pace, more workers or a deeper prefetch buy nothing but memory
        pace = [t for t in safe if rate(t) >= (1 - STEP_PACE_TIE) * rate(best)]
        best = min(pace, key=lambda t: (t.settings.num_workers, t.settings.prefetch_factor or 0))
    baseline = trials[0] if trials and _complete(trials[0]) else None
    gain = rate(best) / rate(baseline) - 1 if best is not None and baseline is not None and rate(baseline) > 0 else None
    if trainer_ms_per_sample is None and best is not None:
        notes += _overlap_note(best, measured)
    return SweepResult(
        current=current,
        trials=ranked,
        best=best,
        gain=gain,
        skipped=skipped,
        budget_s=budget_s,
        elapsed_s=time.monotonic() - started,
        notes=notes,
        trainer_ms_per_sample=trainer_ms_per_sample,
    )


def _complete(trial: SweepTrial) -> bool:
    return trial.error is None and trial.batches_per_s is not None and trial.incomplete is None


def _incomplete(result: LoaderResult, batches: int, warmup: int, budget_s: float) -> str | None:
    """Why a trial's window is partial, or None when it holds all its batches."""
    if result.batches >= batches:
        return None
    if result.ended_early:
        return f"ran out of data after {warmup + result.batches} batches ({result.batches} of {batches} measured)"
    return f"the {budget_s:g} s budget ended its window after {result.batches} of {batches} batches"


def _beyond_cores(widest: SweepTrial, tried: list[LoaderSettings]) -> list[LoaderSettings]:
    """More workers than the cap, when the most workers tried so far keep up with the fastest trial (within
    ``KEEP_UP``) and mostly wait (reads from disk or network, not CPU; ``widest``, see ``_widest``): double the
    count, up to ``MAX_WORKERS``. On a machine busy with other work, CPU-bound workers also use little CPU, but they
    wait for a CPU the rest of the time (``_cpu_wanted_pct``): they are not doubled past the cores."""
    if 2 * widest.settings.num_workers > MAX_WORKERS:
        return []
    more = dataclasses.replace(widest.settings, num_workers=2 * widest.settings.num_workers)
    return [] if any(_same(more, seen) for seen in tried) else [more]


def _widest(trials: list[SweepTrial]) -> SweepTrial | None:
    """The fastest trial with the most workers, when its workers mostly wait and it keeps up with the fastest trial
    with workers: the one to double; None otherwise. Loading in the training process (num_workers=0) is no measure:
    one waiting worker does the same waits in turn plus a hand-over, so it can read slower than none (on a loaded
    machine 10% slower and more) while two overlap twice the waits."""
    measured = [t for t in trials if _complete(t) and t.workers_cpu_pct is not None and t.settings.num_workers > 0]
    if not measured:
        return None
    most = max(t.settings.num_workers for t in measured)
    widest = max((t for t in measured if t.settings.num_workers == most), key=_rate)
    keeps_up = _rate(widest) >= KEEP_UP * max(_rate(t) for t in measured)
    waiting = _cpu_wanted_pct(widest) < WAITING_WORKERS_CPU * 100 * most
    return widest if keeps_up and waiting else None


def _cpu_wanted_pct(trial: SweepTrial) -> float:
    """The CPU a trial's workers wanted, % of one core summed over them: what they used, and the time they were
    runnable but waiting for a CPU. On a machine busy with other work a CPU-bound worker uses half a core and waits
    for the other half: it computes, and more workers than cores take CPU from training."""
    return (trial.workers_cpu_pct or 0.0) + (trial.workers_cpu_wait_pct or 0.0)


def _beyond_note(widest: SweepTrial, cap: int, basis: str) -> str:
    """Why the sweep went past the cap: the workers of ``widest`` (see ``_widest``) mostly wait."""
    per_worker = _cpu_wanted_pct(widest) / widest.settings.num_workers
    return (
        f"more workers than the cap of {cap} ({basis}, one kept for training) were tried: at "
        f"{widest.settings.num_workers} worker(s) each used or waited for {per_worker:.0f}% of a core, so they "
        "mostly wait (storage, network, sleep) and more of them overlap the waits"
    )


def _rate(trial: SweepTrial) -> float:
    """The training rate when the trainer's time is known; else samples/s when the batches have a size, batches/s
    otherwise (the same ordering for one batch size)."""
    if trial.train_samples_per_s is not None:
        return trial.train_samples_per_s
    return trial.samples_per_s if trial.samples_per_s is not None else trial.batches_per_s or 0.0


def training_rate(trial: SweepTrial, trainer_ms_per_sample: float) -> float | None:
    """Samples/s a trainer that spends ``trainer_ms_per_sample`` per sample besides its data reaches with this
    setting: it takes a batch every max(the loader's interval, its own time plus the loader's time in the training
    process). With num_workers=0 that process loads the batch itself (``main_ms`` is the whole fetch), so the two
    add up; workers overlap the step and leave it only their hand-over. None when the trial has no rate."""
    if not trial.samples_per_s or not trial.batches_per_s or trial.main_ms is None:
        return None
    batch = trial.samples_per_s / trial.batches_per_s
    interval_ms = 1e3 / trial.batches_per_s
    step_ms = trainer_ms_per_sample * batch + trial.main_ms
    return batch * 1e3 / max(interval_ms, step_ms)


def _overlap_note(best: SweepTrial, measured: list[SweepTrial]) -> list[str]:
    """When num_workers=0 is the fastest loader alone, from which training step time a worker setting is faster:
    num_workers=0 takes L0 ms of the step per batch, workers deliver one every Lw ms in parallel with it, so past
    a step of Lw - L0 ms per batch (besides its data) the workers win."""
    with_workers = [t for t in measured if t.settings.num_workers > 0 and t.batches_per_s and t.main_ms is not None]
    if best.settings.num_workers > 0 or not with_workers or not best.batches_per_s or best.main_ms is None:
        return []
    fastest = max(with_workers, key=_rate)
    if fastest.main_ms is None or fastest.main_ms >= best.main_ms:
        return []
    step_ms = max(1e3 / fastest.batches_per_s - 1e3 / best.batches_per_s, 0.0)
    batch = best.samples_per_s / best.batches_per_s if best.samples_per_s else None
    per_sample = f" ({step_ms / batch:.3f} ms per sample)" if batch else ""
    return [
        f"num_workers=0 is the fastest loader alone, but it loads in the training process, so each step also waits "
        f"for its {best.main_ms:.2f} ms per batch; a training step that takes more than {step_ms:.2f} ms per "
        f"batch{per_sample} besides its data is faster with {fastest.settings.snippet()}, whose loading overlaps "
        "it: rerun with --against RUN.json (a `stepscope run` of the script) to rank the settings by your step"
    ]


def _expected_cost(trials: list[SweepTrial], batches: int) -> float:
    """Seconds the next trial will probably take (start-up and ``batches`` batches): the median of the trials so
    far, so that a trial which cannot finish inside the budget is not started."""
    costs = [(t.startup_s or 0.0) + batches / t.batches_per_s for t in trials if t.error is None and t.batches_per_s]
    return statistics.median(costs) if costs else 0.0


def sweep_trials(batches: int, warmup: int) -> dict[str, int]:
    """A ``run_loader_job`` job's sweep trial sizes from its measurement's ``batches`` and ``warmup``: up to 100
    batches a trial (at least 20) after up to 10 of warm-up, so that a sweep of many settings fits its budget."""
    return {"sweep_batches": max(20, min(batches, 100)), "sweep_warmup": min(warmup, 10)}


def trainer_ms_per_sample(run: RunSummary) -> float | None:
    """A training run's own time per sample on one rank besides waiting for data (ms): per rank, its time per
    sample (1000 / its samples/s) less the share of its step spent waiting for the loader; the median over the
    ranks of a merged summary (whose top-level rate is the cluster's). None when no rank knows its rate."""
    from stepscope.record import DATA_PHASE

    found = []
    for rank in run.ranks or [run]:
        rate = rank.throughput.samples_per_s
        if not rate or rate <= 0:
            continue
        waiting = rank.phases.get(DATA_PHASE)
        share = min(max(waiting.share, 0.0), 1.0) if waiting is not None else 0.0
        found.append(1e3 / rate * (1.0 - share))
    return statistics.median(found) if found else None


def compare_with_training(ceiling_samples_per_s: float, train_samples_per_s: float) -> dict[str, Any]:
    """Loader ceiling against the training rate (both samples/s): the headroom, and whether the input pipeline is
    the bottleneck (ceiling at or below ``BOTTLENECK_MARGIN`` times the training rate)."""
    ratio = ceiling_samples_per_s / train_samples_per_s if train_samples_per_s > 0 else math.inf
    return {
        "loader_ceiling": ceiling_samples_per_s,
        "train_rate": train_samples_per_s,
        "headroom": ratio,
        "input_bound": ratio <= BOTTLENECK_MARGIN,
    }


def dataset_length(loader: Any) -> int | None:
    """Samples in a loader's dataset; None when unknown (an IterableDataset) or the loader is gone."""
    try:
        return len(loader.dataset)
    except (TypeError, AttributeError):
        return None


def run_loader_job(loader: Any, job: dict[str, Any], position: int) -> dict[str, Any]:
    """What `stepscope dataloader` does with the captured loader in each rank: measure it alone (and sweep when
    asked); the JSON-ready result, with ``error`` instead of figures when it could not be measured."""
    dataset = getattr(loader, "dataset", None)
    found: dict[str, Any] = {
        "index": position,
        "dataset": type(dataset).__name__,
        "dataset_length": dataset_length(loader),
    }
    try:
        result = measure_loader(
            loader,
            batches=job["batches"],
            warmup=job["warmup"],
            device=job.get("device"),
            time_limit_s=job.get("time_limit_s"),
        )
    except Exception as error:  # a worker crash, a dataset that raises: reported, not raised into the script
        found["error"] = f"{type(error).__name__}: {error}"
        return found
    found["loader"] = {**result.to_dict(), "meaning": result.meaning}
    if job.get("sweep"):
        try:
            sweep = sweep_loader(
                loader,
                budget_s=job["budget_s"],
                batches=job["sweep_batches"],
                warmup=job["sweep_warmup"],
                device=job.get("device"),
                trainer_ms_per_sample=job.get("trainer_ms_per_sample"),
            )
        except Exception as error:
            found["sweep_error"] = f"{type(error).__name__}: {error}"
        else:
            found["sweep"] = sweep.to_dict()
    return found


def combine_ranks(rank_results: dict[int, dict[str, Any]], train_samples_per_s: float | None) -> dict[str, Any]:
    """The JSON of `stepscope dataloader` from each rank's ``run_loader_job`` result: the lowest measured rank's
    loader, sweep and best setting at the top, every rank in ``ranks``, the cluster ceiling (sum of the ranks'
    samples/s, each rank feeding its own replica) and the synchronous one (ranks × the slowest rank: what
    synchronous data-parallel training can take), and the comparison of the synchronous one with the training
    rate when that is known."""
    measured = {r: x for r, x in sorted(rank_results.items()) if "loader" in x}
    out: dict[str, Any] = {"ranks": [{"rank": r, **x} for r, x in sorted(rank_results.items())]}
    if not measured:
        return out
    first = next(iter(measured.values()))
    out["loader"] = first["loader"]
    rates = [x["loader"]["samples_per_s"] for x in measured.values() if x["loader"]["samples_per_s"] is not None]
    if len(rates) == len(measured):
        out["cluster_samples_per_s"] = sum(rates)
        out["rank_samples_per_s"] = {"min": min(rates), "mean": statistics.fmean(rates), "max": max(rates)}
        # Synchronous data parallelism moves at its slowest rank: every rank waits for it at each all-reduce.
        out["cluster_sync_samples_per_s"] = len(rates) * min(rates)
    if "sweep" in first:
        sweep = first["sweep"]
        keys = ("settings", "samples_per_s", "startup_s", "peak_rss_mb", "workers_cpu_pct", "safe", "error")
        later = ("incomplete", "main_ms", "train_samples_per_s", "workers_cpu_wait_pct")  # absent from older ones
        out["sweep"] = [{**{k: t[k] for k in keys}, **{k: t.get(k) for k in later}} for t in sweep["trials"]]
        out["trainer_ms_per_sample"] = sweep.get("trainer_ms_per_sample")
        best = sweep["best"]
        if best is not None:
            out["best"] = {
                "settings": best["settings"], "samples_per_s": best["samples_per_s"],
                "train_samples_per_s": best.get("train_samples_per_s"), "gain": sweep["gain"],
                "snippet": LoaderSettings(**best["settings"]).snippet(),  # the report prints it as is
            }  # fmt: skip
        out["sweep_skipped"] = sweep["skipped"]
        out["sweep_notes"] = sweep["notes"]
    ceiling = out.get("cluster_sync_samples_per_s")
    if ceiling is not None and train_samples_per_s:
        out["against_training"] = compare_with_training(ceiling, train_samples_per_s)
    return out
