"""Stack sampler: names the source lines that host time without a phase of its own is spent on.

A daemon thread reads the training thread's current frame (``sys._current_frames()``: no ptrace, no py-spy) about
``rate_hz`` times a second, asks the recorder which phase is open at that instant, and, for the phases whose host
time has no name (``other``, ``sync``, a main-process ``data_wait``), walks the frame to the innermost line of the
user's own code: the line, and the library function it called (``torch.save`` at ``train.py:42``). Counts are kept
per (phase, line, callee) in a bounded dict; ``hotspots()`` turns them into the summary's ``hotspots`` field.

Each sample takes the GIL from the training thread: two thread switches, which on a small VM cost the training
thread ~0.1-0.3 ms a sample, far more than the sample itself (~15 µs). So the sampler runs at ``rate_hz`` for its
first ``FULL_RATE_S`` seconds, enough for a short run's hotspots, then at a ``slowdown``-th of it (about
``SLOW_HZ``), each later sample counting ``slowdown`` times: the counts stay an even measure of time, and a long
run pays a fifth of the wakes. A line's ``samples`` in the summary are the samples taken there (what a rule's
trust rests on); its ``share`` is of the weighted counts.

Limits: only the training thread is sampled; a C extension's time shows as the Python line that called it; a
sample is taken when the sampler gets the GIL, so code that never releases it for long is seen at its switch
points (every 5 ms by default) rather than anywhere.
"""

from __future__ import annotations

import linecache
import logging
import os
import random
import site
import sys
import sysconfig
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import CodeType, FrameType
from typing import Any

from stepscope.instrument import DEFAULT_STACK_HZ, MAX_STACK_HZ
from stepscope.record import OTHER_PHASE, TOTAL
from stepscope.summary import PhaseStats

log = logging.getLogger("stepscope")

FULL_RATE_S = 2.0  # seconds sampled at the full rate, then at about SLOW_HZ
SLOW_HZ = 20.0
ATTRIBUTED = frozenset({OTHER_PHASE, "sync", "data_wait"})  # phases whose host time has no name of its own
MAX_SITES = 2048  # distinct (phase, line, callee) keys kept; later new ones are counted as unnamed
TOP_LINES = 5  # lines kept per phase in the summary
MIN_LINE_SHARE = 0.02  # of a phase's samples: below this a line is noise

USER, LIBRARY, LOADER, OWN = 0, 1, 2, 3  # the user's code, a library's, torch's data loading, stepscope's hooks

# phase, file, line, function, callee (None: a C function, or nothing), inside the DataLoader
Site = tuple[str, str, int, str, "str | None", bool]
PhaseOf = Callable[[FrameType], "str | None"]


def slowdown(rate_hz: float) -> int:
    """How many times slower than ``rate_hz`` the sampler runs after its first ``FULL_RATE_S``: the whole number that
    brings it to about ``SLOW_HZ`` (1: a rate at or below it stays)."""
    return max(1, round(rate_hz / SLOW_HZ))


def check_rate(rate_hz: float) -> float:
    """``rate_hz`` as a float; ValueError unless 0 < rate_hz <= 1000."""
    rate = float(rate_hz)
    if not 0 < rate <= MAX_STACK_HZ:
        raise ValueError(f"stack_sample_hz must be in (0, {MAX_STACK_HZ:g}] samples per second, got {rate_hz!r}")
    return rate


def library_roots() -> tuple[str, ...]:
    """Folders whose code is not the user's: the standard library, site-packages, torch and stepscope."""
    schemes = [
        sysconfig.get_paths(),
        sysconfig.get_paths(vars={"base": sys.base_prefix, "platbase": sys.base_exec_prefix}),
    ]
    roots = {paths[key] for paths in schemes for key in ("stdlib", "platstdlib", "purelib", "platlib") if key in paths}
    roots.update([*site.getsitepackages(), site.getusersitepackages()])
    roots.add(str(Path(__file__).resolve().parents[1]))  # stepscope itself, wherever it is imported from
    torch = sys.modules.get("torch")
    if torch is not None and getattr(torch, "__file__", None):
        roots.add(str(Path(torch.__file__).resolve().parent))
    return tuple(sorted({os.path.normcase(os.path.realpath(r)) + os.sep for r in roots if r}))


class CodeKinds:
    """What each code object is (USER, LIBRARY, LOADER, OWN), cached: code objects are few."""

    def __init__(self, roots: tuple[str, ...] | None = None, limit: int = 50_000) -> None:
        self._roots = library_roots() if roots is None else roots
        self._loader = os.sep + os.path.join("torch", "utils", "data") + os.sep
        self._own = os.path.normcase(os.path.realpath(Path(__file__).resolve().parents[1])) + os.sep
        self._kinds: dict[CodeType, int] = {}
        self._limit = limit

    def kind(self, code: CodeType) -> int:
        kind = self._kinds.get(code)
        if kind is None:
            kind = self._classify(code.co_filename)
            if len(self._kinds) < self._limit:  # bounded: a program that generates code forever stays bounded
                self._kinds[code] = kind
        return kind

    def _classify(self, filename: str) -> int:
        if filename.startswith("<"):  # <frozen importlib._bootstrap>, <string>: not a line the user can edit
            return LIBRARY
        path = os.path.normcase(os.path.realpath(filename))
        if self._loader in path:
            return LOADER
        if path.startswith(self._own):
            return OWN
        return LIBRARY if path.startswith(self._roots) else USER


def qualified_name(frame: FrameType) -> str:
    """``module.qualname`` of the function running in ``frame``, e.g. ``torch.serialization.save``."""
    module = frame.f_globals.get("__name__") or "?"
    return f"{module}.{frame.f_code.co_qualname}"


def frame_site(frame: FrameType | None, kinds: CodeKinds) -> tuple[str, int, str, str | None, bool] | None:
    """Where ``frame`` (a thread's innermost frame) is in the user's code: (file, line, function, the library
    function that line called or None, whether the DataLoader called that code). None when no frame of the stack
    is the user's."""
    # Read the chain before classifying: classifying a new file stats it, which releases the GIL, and the sampled
    # thread would then move on and change the frames' line numbers under the walk.
    chain: list[tuple[CodeType, int, FrameType]] = []
    while frame is not None:
        chain.append((frame.f_code, frame.f_lineno, frame))
        frame = frame.f_back
    called: FrameType | None = None
    for index, (code, line, current) in enumerate(chain):
        kind = kinds.kind(code)
        if kind != USER:
            if kind != OWN:  # stepscope's hook around a torch function is not what the line called
                called = current
            continue
        in_loader = any(kinds.kind(outer) == LOADER for outer, _, _ in chain[index + 1 :])
        callee = qualified_name(called) if called is not None else None
        return code.co_filename, line, code.co_qualname, callee, in_loader
    return None


class StackSampler:
    """Samples one thread's stack ``rate_hz`` times a second (jittered) on a daemon thread.

    Args:
        thread_id: the thread to sample (``threading.get_ident()`` of the training thread).
        phase_of: the phase open in that thread, given its innermost frame; None while not measuring.
        rate_hz: samples per second, in (0, 1000].
        max_sites: distinct (phase, line, callee) keys kept; samples at new keys past it count as unnamed.
    """

    def __init__(
        self,
        thread_id: int,
        phase_of: PhaseOf,
        rate_hz: float = DEFAULT_STACK_HZ,
        max_sites: int = MAX_SITES,
        kinds: CodeKinds | None = None,
    ) -> None:
        self.rate_hz = check_rate(rate_hz)
        self._thread_id = thread_id
        self._phase_of = phase_of
        self._max_sites = max_sites
        self._kinds = kinds or CodeKinds()
        self.sites: dict[Site, int] = {}  # weighted counts (each sample counts ``weight``)
        self.observed: dict[Site, int] = {}  # samples taken at each site
        self.phase_samples: dict[str, int] = {}
        self.unnamed: dict[str, int] = {}  # per phase: samples with no user frame, or past the key cap
        self.samples = 0
        self.notes: list[str] = []
        # What a sample counts for: 1 at the full rate, ``slowdown(rate_hz)`` once the sampler slowed down
        self.weight = 1
        self._stop_event = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> StackSampler:
        """Start sampling on a daemon thread."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="stepscope-stacks", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        """Stop sampling (joins the thread, at most one interval + 1 s); idempotent."""
        self._stop_event.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(1 / self.rate_hz + 1.0)

    def sample(self) -> None:
        """Take one sample of the training thread now (what the thread does each interval)."""
        frame = sys._current_frames().get(self._thread_id)
        if frame is None:
            return
        try:
            phase = self._phase_of(frame)
            if phase is None:
                return
            weight = self.weight
            self.samples += 1
            self.phase_samples[phase] = self.phase_samples.get(phase, 0) + weight
            if phase not in ATTRIBUTED:
                return
            site = frame_site(frame, self._kinds)
        finally:
            del frame  # a frame kept alive keeps every local of the training step alive
        if site is None:
            self.unnamed[phase] = self.unnamed.get(phase, 0) + weight
            return
        key = (phase, *site)
        sites = self.sites
        count = sites.get(key)
        if count is not None:
            sites[key] = count + weight
            self.observed[key] += 1
        elif len(sites) < self._max_sites:
            sites[key] = weight
            self.observed[key] = 1
        else:
            self.unnamed[phase] = self.unnamed.get(phase, 0) + weight

    def table(self) -> dict[str, Any]:
        """The counts so far (copies): rate_hz, samples (taken), phase_samples, unnamed and sites (weighted counts),
        observed (samples taken at each site), notes."""
        return {
            "rate_hz": self.rate_hz,
            "samples": self.samples,
            "phase_samples": dict(self.phase_samples),
            "unnamed": dict(self.unnamed),
            "sites": dict(self.sites),
            "observed": dict(self.observed),
            "notes": list(self.notes),
        }

    def _run(self) -> None:
        interval = 1 / self.rate_hz
        jitter = random.Random(self._thread_id)
        slow_from = time.monotonic() + FULL_RATE_S
        try:
            # Jittered waits: a fixed period would alias with a periodic step and see the same instant every time.
            while not self._stop_event.wait(interval * (0.5 + jitter.random())):
                self.sample()
                if self.weight == 1 and time.monotonic() >= slow_from:
                    self.weight = slowdown(self.rate_hz)
                    interval *= self.weight
        except Exception as error:
            self.notes.append(f"the stack sampler stopped after an error ({type(error).__name__}: {error}).")
            log.warning("stepscope: the stack sampler stopped (%s); training continues.", error)


class NoStacks:
    """No stack sampling: the null object ``Collectors`` hold when ``stack_sample_hz`` is None."""

    def start(self) -> NoStacks:
        return self

    def stop(self) -> None:
        return None

    def table(self) -> dict[str, Any]:
        return {}


NO_STACKS = NoStacks()


def hotspots(table: dict[str, Any], phases: dict[str, PhaseStats], top: int = TOP_LINES) -> dict[str, Any]:
    """The summary's ``hotspots`` from a sampler's ``table()`` and the run's phase statistics.

    Per attributed phase, the ``top`` lines by samples (rows under MIN_LINE_SHARE of the phase's samples left
    out): file (relative to the working directory when inside it), line, function, code (the source line),
    calls (the library function it called, or null), share (of the phase's weighted samples, 0..1), samples (taken
    on that line), ms_per_step (share × the phase's measured time per step), and ``in_loader`` when the DataLoader
    ran that code. {} when nothing was sampled."""
    if not table or not table.get("samples"):
        return {}
    phase_samples: dict[str, int] = table["phase_samples"]
    observed: dict[Site, int] = table.get("observed") or table["sites"]  # a sampler that never slowed: the same
    lines: dict[tuple[str, str, int, str], dict[str | None, int]] = {}
    taken: dict[tuple[str, str, int, str], int] = {}
    loader_lines: set[tuple[str, str, int, str]] = set()
    for sampled, count in table["sites"].items():
        phase, file, line, function, callee, in_loader = sampled
        key = (phase, file, line, function)
        callees = lines.setdefault(key, {})
        callees[callee] = callees.get(callee, 0) + count
        taken[key] = taken.get(key, 0) + observed.get(sampled, count)
        if in_loader:
            loader_lines.add(key)
    total = phases.get(TOTAL)
    step_ms = total.mean_ms if total is not None else 0.0
    by_phase: dict[str, list[dict[str, Any]]] = {}
    for key, callees in sorted(lines.items(), key=lambda item: -sum(item[1].values())):
        phase, file, line, function = key
        count = sum(callees.values())
        share = count / phase_samples[phase]
        rows = by_phase.setdefault(phase, [])
        if share < MIN_LINE_SHARE or len(rows) >= top:
            continue
        stats = phases.get(phase)
        phase_ms = stats.share * step_ms if stats is not None and not stats.nested else 0.0
        row = {
            "file": _display_path(file),
            "line": line,
            "function": function,
            "code": linecache.getline(file, line).strip(),
            "calls": max(callees.items(), key=lambda item: item[1])[0],  # the line's most sampled callee
            "share": round(share, 4),
            "samples": taken[key],
            "ms_per_step": round(share * phase_ms, 3),
        }
        if key in loader_lines:
            row["in_loader"] = True
        rows.append(row)
    out: dict[str, Any] = {
        "rate_hz": table["rate_hz"],
        "samples": table["samples"],
        "phase_samples": dict(phase_samples),
        "phases": {phase: rows for phase, rows in by_phase.items() if rows},
    }
    if table.get("notes"):
        out["notes"] = list(table["notes"])
    return out


def _display_path(file: str) -> str:
    try:
        relative = os.path.relpath(file)
    except ValueError:  # another drive (Windows)
        return file
    return file if relative.startswith("..") else relative


def describe_line(row: dict[str, Any], width: int = 60) -> str:
    """A hotspot row in words: ``train.py:42 torch.save(state, path) [torch.serialization.save]``."""
    code = row.get("code") or row.get("function", "")
    if len(code) > width:
        code = code[: width - 1] + "…"
    calls = row.get("calls")
    return f"{row['file']}:{row['line']} {code}" + (f" [{calls}]" if calls else "")
