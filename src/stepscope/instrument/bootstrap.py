"""Instruments a Python process that ``stepscope run`` started (directly, or through a launcher such as torchrun).

``stepscope run`` puts ``instrument/site/`` on PYTHONPATH and its RunConfig in ``STEPSCOPE_RUN``; the
``sitecustomize`` there calls ``activate()`` in every Python process of the command. Activation costs nothing
until the process imports torch; then the hooks go in, and at exit the process writes its summary into the run
folder, when it trained (or is the script itself). Rank files are named by rank, host and pid (see
identity.py), so they never overwrite each other, even in a folder the nodes of a job share. Anything that goes
wrong here is reported once on stderr, and the script runs on.
"""

from __future__ import annotations

import atexit
import dataclasses
import importlib.abc
import importlib.util
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from stepscope.instrument.collect import RANK_FILES
from stepscope.instrument.identity import identify, summary_name
from stepscope.summary import Exit

ENV_CONFIG = "STEPSCOPE_RUN"

_state: dict[str, Any] = {}


def _warn(what: str, error: BaseException, then: str = "the script runs on unmeasured") -> None:
    print(f"stepscope: {what} ({type(error).__name__}: {error}); {then}.", file=sys.stderr)


def activate() -> None:
    """Called from sitecustomize: instrument this process once it imports torch, if ``stepscope run`` asked."""
    raw = os.environ.get(ENV_CONFIG)
    if not raw or "active" in _state:
        return
    _state["active"] = True
    try:
        options = json.loads(raw)
        # Nothing heavy is imported before the script's own `import torch` (the tracker pulls in numpy and psutil):
        # a script that sets OMP_NUM_THREADS or OPENBLAS_NUM_THREADS before its imports must still get them, and a
        # process that never imports torch must stay as it would be.
        if "torch" in sys.modules:
            _start(options)
        else:
            sys.meta_path.insert(0, _AfterImport("torch", lambda: _start(options)))
    except Exception as error:
        _warn("could not set up instrumentation", error)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs a callback right after a module's first import completes (it removes itself on first use)."""

    def __init__(self, name: str, callback: Callable[[], None]) -> None:
        self._name = name
        self._callback = callback

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname != self._name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module
        callback = self._callback

        def exec_then_call(module: Any) -> None:
            exec_module(module)
            callback()

        spec.loader.exec_module = exec_then_call  # type: ignore[method-assign]
        return spec


def instrument(options: dict[str, Any]) -> tuple[Any, Callable[[], None]]:
    """The tracker of a process ``stepscope run`` started, from its RunConfig options, with the training hooks in
    torch; returns it and the undo of the hooks. Process-wide handlers (exit, signals, checkpoints) are ``_start``'s."""
    from stepscope.instrument.hooks import install
    from stepscope.instrument.profile import ProfileWindow
    from stepscope.instrument.tracker import RunConfig, Tracker
    from stepscope.scope import enabled_scope
    from stepscope.stream import ProcessStream

    config = RunConfig(**options)
    scope_options = {
        "warmup": config.warmup,
        "system_interval_s": config.system_interval_s,
        "stack_sample_hz": config.stack_sample_hz,
        "sinks": _sinks(config.sinks),
    }
    try:
        scope = enabled_scope(
            **scope_options,
            profile=ProfileWindow(**config.profile) if config.profile else None,
            nvtx=config.nvtx,
            nsys_window=config.nsys_window,
        )
    except ValueError as error:  # e.g. NVTX without CUDA: keep what can run rather than lose the measurement
        profile = ProfileWindow(**config.profile) if config.profile else None
        _warn(
            "could not set up the trace capture",
            error,
            then="measuring without " + ("NVTX and the Nsight window" if profile else "it"),
        )
        scope = enabled_scope(**scope_options, profile=profile)
    tracker = Tracker(scope, config)
    tracker.stream = ProcessStream(scope._recorder, scope._eval, Path(config.out_dir), lambda: _stream_meta(tracker))
    return tracker, install(tracker)


def _stream_meta(tracker: Any) -> dict[str, Any]:
    """Who the process is, for its step stream's header (read at its first kept step: its rank is known by then):
    the Meta its summary would carry, and the run's warm-up and steps."""
    config, meta = tracker.config, tracker.scope._meta()
    _identify(meta, config.launch_id)
    return {**dataclasses.asdict(meta), "warmup": config.warmup, "steps": config.steps if config.stop else None}


def _identify(meta: Any, launch_id: str | None) -> Any:
    """Put who this process is in its job (rank, node, job, host, pid) and its launch into ``meta``; returns that
    Identity."""
    who = identify()
    meta.rank, meta.local_rank, meta.world_size = who.rank, who.local_rank, who.world_size
    meta.node_rank, meta.job_id, meta.hostname, meta.pid = who.node_rank, who.job_id, who.hostname, who.pid
    meta.launch_id = launch_id
    return who


def _start(options: dict[str, Any]) -> None:
    try:
        tracker, _ = instrument(options)
    except Exception as error:
        _warn("could not install the training hooks", error)
        return
    _state["tracker"] = tracker
    _start_checkpoints(tracker)
    atexit.register(_write, tracker, True)
    _chain_excepthook(tracker)
    # Only where nobody else handles them, and only from the main thread (signal() refuses elsewhere).
    if threading.current_thread() is threading.main_thread():
        if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
            signal.signal(signal.SIGTERM, _on_sigterm)
        if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            signal.signal(signal.SIGINT, _on_sigint)


def _start_checkpoints(tracker: Any) -> None:
    """Checkpoints every --checkpoint-s seconds from a thread, at a step boundary when one comes in time."""
    try:
        from stepscope.instrument.checkpoint import Checkpoints

        checkpoints = Checkpoints(
            tracker, lambda: _write(tracker, final=False), tracker.config.checkpoint_s, threading.main_thread().ident
        )
        tracker.on_checkpoint = checkpoints.on_step
        checkpoints.start()
        _state["checkpoints"] = checkpoints
    except Exception as error:
        _warn("could not start the checkpoints", error, "the summary is written at exit only")


# A SIGINT this soon after the last, with no optimizer step between, is a copy of the same request.
SIGINT_REPEAT_S = 2.0


def _on_sigint(signum: int, frame: Any) -> None:
    """Python's KeyboardInterrupt, once per request. A group SIGINT reaches the script twice (directly, and the
    copy `stepscope run` passes on when it has no terminal), and schedulers repeat theirs: a second
    KeyboardInterrupt would land in the script's exit path (its finally blocks, the exit hook, the summary
    write) and lose the figures. A script that catches the interrupt and trains on, or a Ctrl-C
    SIGINT_REPEAT_S later, gets the next one as Python would give it."""
    tracker = _state.get("tracker")
    steps = tracker.seen["optimizer_steps"] if tracker is not None else 0
    now = time.monotonic()
    last = _state.get("interrupted")
    if last is not None and last[0] == steps and now - last[1] < SIGINT_REPEAT_S:
        return
    _state["interrupted"] = (steps, now)
    raise KeyboardInterrupt


def _on_sigterm(signum: int, frame: Any) -> None:
    # Later copies of the request are ignored: a signal to the process group reaches this process and
    # `stepscope run`, which passes its own on. The process is on its way out; raising again would cut its exit
    # handlers (the summary write among them) short.
    _ignore_exit_signals()
    tracker = _state.get("tracker")
    if tracker is not None and tracker.outcome is None:
        tracker.outcome = Exit(reason="terminated", code=128 + signum, error="SIGTERM")
    raise SystemExit(128 + signum)


def _chain_excepthook(tracker: Any) -> None:
    previous = sys.excepthook

    def excepthook(kind: type[BaseException], value: BaseException, tb: Any) -> None:
        if issubclass(kind, KeyboardInterrupt):
            # Ctrl-C or a group SIGINT: the process exits after this hook. A repeated signal (the copy
            # `stepscope run` passes on, a scheduler's repeat) would raise again inside this hook or an exit
            # handler before the summary is written, so from here on both exit signals are ignored.
            _ignore_exit_signals()
            tb = _without_own_frames(tb)
        if tracker.outcome is None:
            if issubclass(kind, KeyboardInterrupt):
                tracker.outcome = Exit(reason="interrupted", code=130, error="KeyboardInterrupt", at=time.time())
            else:
                tracker.outcome = Exit(reason="error", code=1, error=f"{kind.__name__}: {value}", at=time.time())
        previous(kind, value, tb)  # the script's traceback, printed as Python prints it

    sys.excepthook = excepthook


def _without_own_frames(tb: Any) -> Any:
    """The traceback without stepscope's SIGINT handler, where the KeyboardInterrupt was raised (Python's own
    handler raises from C): the script's Ctrl-C traceback ends at the script's line, as it does without
    stepscope."""
    entries = []
    while tb is not None:
        entries.append(tb)
        tb = tb.tb_next
    while entries and entries[-1].tb_frame.f_code is _on_sigint.__code__:
        entries.pop()
    if not entries:
        return None
    entries[-1].tb_next = None
    return entries[0]


def _sinks(specs: list[str]) -> list[Any]:
    """The sinks of ``--sink`` / ``--metrics-jsonl`` for this process; one that cannot start is reported and left
    out, and the run goes on."""
    from stepscope.sinks.trackers import sink_from_spec

    rank = identify().rank
    sinks = []
    for spec in specs:
        try:
            sink = sink_from_spec(spec, rank)
        except Exception as error:
            _warn(f"the sink {spec!r} could not start", error, "measuring goes on without it")
            continue
        if sink is not None:
            sinks.append(sink)
    return sinks


def _write(tracker: Any, final: bool) -> None:
    """Write this process's summary into the run folder (atomically: a reader never sees half a file). The final
    write ignores SIGTERM and SIGINT while it runs: the process is exiting already, and a second signal (the copy a
    process-group signal sends through `stepscope run`, a scheduler's repeat) would otherwise lose the figures."""
    config = tracker.config
    is_script = not config.launcher and os.getppid() == config.parent_pid
    if not (tracker.trained or is_script):
        return  # a launcher, a loader worker, a compile worker: nothing to say
    if not tracker.trained and _others_wrote(Path(config.out_dir)):
        # The script started the processes that trained (torch.multiprocessing.spawn): it launched the ranks and is
        # none of them; the checkpoint it may have written goes too
        (Path(config.out_dir) / summary_name(identify())).unlink(missing_ok=True)
        return
    shielded = _ignore_exit_signals() if final else {}
    try:
        _write_summary(tracker, final)
    finally:
        for signum, handler in shielded.items():
            signal.signal(signum, handler)


def _others_wrote(out: Path) -> bool:
    """Whether another process of the run wrote its summary into ``out``."""
    own = f"-pid{os.getpid()}.json"
    return any(not path.name.endswith(own) for path in out.glob(RANK_FILES))


def _ignore_exit_signals() -> dict[int, Any]:
    """Ignore SIGTERM and SIGINT (from the main thread only: signal() refuses elsewhere); returns the handlers to
    put back. Ignored, not blocked: a signal that arrives meanwhile is dropped rather than delivered afterwards."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    previous = {}
    for signum in (signal.SIGTERM, signal.SIGINT):
        handler = signal.getsignal(signum)
        if handler is not None:  # None: set from outside Python, cannot be put back
            previous[signum] = signal.signal(signum, signal.SIG_IGN)
    return previous


def _mark_failure(end: Exit) -> None:
    """Where the training thread is stalled (``exit.hung``, while it is), and when the process failed (``exit.at``,
    Unix seconds) if the exit hook did not say."""
    if end.reason in ("finished", "stopped"):
        return  # it ended on its own: whatever it waited for came
    checkpoints = _state.get("checkpoints")
    end.hung = checkpoints.stall() if checkpoints is not None else None
    if end.at is None and end.reason != "running":
        end.at = time.time()


def _write_summary(tracker: Any, final: bool) -> None:
    config = tracker.config
    try:
        if final:
            tracker.end_window()  # stepscope's own cost is counted before its threads stop
            if "checkpoints" in _state:
                _state["checkpoints"].stop()  # no checkpoint may replace the final summary
            tracker.scope.close()  # the system sampler's last figures
        summary = tracker.summary(drain=final)
        who = _identify(summary.meta, config.launch_id)
        if not final:
            summary.exit = Exit(reason="running")
        _mark_failure(summary.exit)
        out = Path(config.out_dir)
        path = out / summary_name(who)
        tmp = path.with_suffix(".tmp")
        summary.to_json(tmp)
        tmp.replace(path)
        if final:
            tracker.stream.close()
    except Exception as error:
        print(f"stepscope: could not write the summary ({type(error).__name__}: {error}).", file=sys.stderr)
