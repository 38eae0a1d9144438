"""The ``stepscope`` command: one sub-command per job."""

from __future__ import annotations

import argparse
import gc
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from stepscope import __version__
from stepscope.instrument import DEFAULT_STACK_HZ, HANG_AFTER, MAX_STACK_HZ, MIN_HANG_S, PROGRESS_MODES

if TYPE_CHECKING:
    from stepscope.summary import RunSummary


def _show(args: argparse.Namespace) -> int:
    from stepscope.report.terminal import print_doctor, print_summary
    from stepscope.summary import RunSummary

    summary = RunSummary.from_json(args.summary)
    if summary.fixes:
        print_doctor(summary)  # a doctor's summary: the verdict's evidence and the ranked fixes too
    else:
        print_summary(summary)
    return 0


RUN_USAGE = "stepscope run [OPTIONS] SCRIPT.py [ARGS...] | -m MODULE [ARGS...] | -- COMMAND [ARGS...]"
PARAMS_USAGE = "stepscope params [OPTIONS] SCRIPT.py [ARGS...] | -m MODULE [ARGS...] | -- COMMAND [ARGS...]"
DOCTOR_USAGE = "stepscope doctor [OPTIONS] SCRIPT.py [ARGS...] | -m MODULE [ARGS...] | -- COMMAND [ARGS...]"
TUNE_USAGE = (
    "stepscope tune [--budget-s S] [--allow-numerics] [--json PATH] [--html PATH] SCRIPT.py [ARGS...] | "
    "-m MODULE [ARGS...] | -- COMMAND [ARGS...]"
)
LOADER_USAGE = "stepscope dataloader [OPTIONS] SCRIPT.py [ARGS...] | -m MODULE [ARGS...] | -- COMMAND [ARGS...]"
# Options of the verbs that run a script and take a value: the script's own arguments start after them.
_VALUED = {
    "--warmup",
    "--steps",
    "--json",
    "--html",
    "--batch-size",
    "--checkpoint-s",
    "--sample-hz",
    "--stack-hz",
    "--batches",
    "--budget-s",
    "--device",
    "--loader",
    "--against",
    "--ceiling-batches",
    "--metrics-jsonl",
    "--sink",
    "--py-spy",
    "--trace",
    "--trace-window",
    "--nsys-window",
    "--apply",
    "--out",
    "--out-wait-s",
    "--verify-repeats",
    "--verify-budget-s",
    "--run-timeout-s",
    "--sweep-budget-s",
    "--repeats",
    "--progress",
    "--hang-after",
}
# Options whose value may be left out: the next word is theirs only when it is a number (``--verify 2 train.py``).
_OPTIONAL_VALUE = {"--verify"}
_SCRIPT_VERBS = ("run", "params", "doctor", "dataloader", "tune")


def _split_run(argv: list[str]) -> tuple[list[str], list[str]]:
    """Split ``run``'s arguments into stepscope's options and the command: the command starts at the first
    word that is not one of stepscope's options (or its value), at ``-m``, or after ``--``; everything from
    there on belongs to the script, even words that look like stepscope's options."""
    i = 0
    while i < len(argv):
        word = argv[i]
        if word == "--" or word == "-m" or not word.startswith("-"):
            break
        if word in _VALUED or (word in _OPTIONAL_VALUE and i + 1 < len(argv) and argv[i + 1].isdigit()):
            i += 1
        i += 1
    return argv[:i], argv[i:]


def _target(command: list[str], usage: str) -> Any:
    from stepscope.instrument.launch import command_target, module_target, script_target

    if not command:
        raise UsageError(f"nothing to run. usage: {usage}")
    if command[0] == "--":
        return command_target(command[1:])
    if command[0] == "-m":
        if len(command) < 2:
            raise UsageError("-m needs a module name, e.g. -m package.train")
        return module_target(command[1], command[2:])
    return script_target(command[0], command[1:])


def _measure_config(args: argparse.Namespace, **extra: Any) -> Any:
    """The RunConfig of a measuring verb (run, doctor) from its shared options (see ``_measure_options``)."""
    from stepscope.instrument.tracker import RunConfig
    from stepscope.sinks import JsonlSink
    from stepscope.sinks.trackers import parse_spec, rank_file

    specs = list(args.sink or []) + ([f"jsonl:{args.metrics_jsonl}"] if args.metrics_jsonl else [])
    for spec in specs:  # checked before the script starts: a typo must not cost a training run
        try:
            kind, target = parse_spec(spec)
            if kind == "jsonl":
                JsonlSink(rank_file(target, 0))
        except (ValueError, ImportError, OSError) as error:
            raise UsageError(f"--sink {spec}: {error}") from None
    if args.nsys_window:
        from stepscope.instrument.profile import NsysWindow

        try:
            NsysWindow.parse(args.nsys_window)
        except ValueError as error:
            raise UsageError(f"--nsys-window: {error}") from None
    return RunConfig(
        out_dir="",
        warmup=args.warmup,
        steps=args.steps,
        batch_size=args.batch_size,
        checkpoint_s=args.checkpoint_s,
        system_interval_s=_interval(args.sample_hz),
        stack_sample_hz=args.stack_hz or None,
        sinks=specs,
        profile=_profile_window(args),
        nvtx=args.nvtx,
        nsys_window=args.nsys_window,
        apply=_fixes(args.apply or []),
        **extra,
    )


def _fixes(texts: list[str]) -> list[dict[str, Any]]:
    """``--apply`` words into validated fixes, before the script starts: a typo must not cost a training run."""
    from stepscope.instrument.apply import ApplyError, parse_fixes

    try:
        return parse_fixes(texts)
    except ApplyError as error:
        raise UsageError(str(error)) from None


def _trace_window(text: str) -> tuple[int, ...]:
    try:
        parts = tuple(int(part) for part in text.split(":"))
    except ValueError:
        parts = ()
    if len(parts) not in (3, 4) or min(parts) < 0 or parts[2] < 1:
        raise argparse.ArgumentTypeError(f"expected WAIT:WARMUP:ACTIVE[:REPEAT] like 1:1:3, got {text!r}")
    return parts if len(parts) == 4 else (*parts, 1)


def _profile_window(args: argparse.Namespace) -> dict[str, Any] | None:
    if not args.trace:
        return None
    wait, warmup, active, repeat = args.trace_window
    return {
        "dir": str(Path(args.trace).resolve()), "wait": wait, "warmup": warmup, "active": active, "repeat": repeat,
        "record_shapes": args.trace_shapes, "with_stack": args.trace_stack,
    }  # fmt: skip


def _run(args: argparse.Namespace) -> int:
    from stepscope.instrument.launch import run
    from stepscope.invariants import check
    from stepscope.report.terminal import print_summary

    target = _target(args.command, RUN_USAGE)
    config = _measure_config(args, stop=not args.no_stop)
    _check_outputs(args, json="summary", html="report")
    started = time.time()
    out = _out_folder(args.out)
    code, summary = run(
        target,
        config,
        py_spy=_py_spy_out(args.py_spy),
        out=out,
        out_wait_s=args.out_wait_s,
        progress=_progress(args.progress),
        hang_after=args.hang_after,
    )
    _attach_trace(args, summary, started)
    check(summary)
    _print_report(print_summary, summary, written=_save_summary(args, summary))
    return code


def _print_report(print_report: Callable[..., Any], *what: Any, written: Sequence[str] = ()) -> None:
    """Print a terminal report, then the ``written`` lines, after the files are written: a stdout closed early
    (``| head -1``) costs nothing then, and is no error."""
    try:
        sys.stdout.flush()
        print_report(*what)
        for line in written:
            print(line)
        sys.stdout.flush()
    except BrokenPipeError:
        # Python would fail again flushing stdout at exit: point it at /dev/null (the recipe of Python's docs).
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except SystemExit as leaving:  # rich's answer to a broken pipe: it has pointed stdout at /dev/null already
        if not isinstance(leaving.__context__, BrokenPipeError):
            raise


def _merge(args: argparse.Namespace) -> int:
    from stepscope.doctor.checkup import examine
    from stepscope.doctor.lint import LintHit
    from stepscope.doctor.verdict import classify
    from stepscope.instrument.collect import MergeError, check_one_job, gather
    from stepscope.instrument.merge import merge
    from stepscope.invariants import check
    from stepscope.report.terminal import print_doctor, print_summary

    _check_outputs(args, json="summary", html="report")
    try:
        found = gather(args.paths)
    except MergeError as error:
        for note in error.notes:  # why each file was skipped, before the sentence that counts them
            print(f"stepscope: {note}", file=sys.stderr)
        raise UsageError(str(error)) from None
    for note in found.notes:  # also when what was read is refused below: a skipped file may be the job's missing part
        print(f"stepscope: {note}", file=sys.stderr)
    try:
        world = check_one_job(found)
    except MergeError as error:
        raise UsageError(str(error)) from None
    summary = merge(found.ranks, expected_world=world)
    summary.notes += found.notes
    if found.lint is not None:  # doctor summaries: the job gets the doctor's verdict and fixes
        examine(summary, [LintHit(**hit) for hit in found.lint])
        check(summary)
        _print_report(print_doctor, summary, written=_save_summary(args, summary))
    else:
        summary.verdict = classify(summary)
        check(summary)
        _print_report(print_summary, summary, written=_save_summary(args, summary))
    return 0


def _report(args: argparse.Namespace) -> int:
    from stepscope.summary import RunSummary

    summary = RunSummary.from_json(args.summary)
    if args.trace and not Path(args.trace).exists():
        raise UsageError(f"--trace {args.trace}: no such file or folder.")
    _check_outputs(args, html="report")
    _attach_trace(args, summary)
    return 0 if _save("--html", args.html, "report", lambda path: _html_writer()(summary, path)) else 1


def _attach_trace(args: argparse.Namespace, summary: RunSummary, since: float | None = None) -> None:
    """Put the highlights of the traces in ``--trace DIR`` into the summary that ``--json``/``--html`` write (only
    ``since`` then: a run's own capture); when there are none, one sentence in its notes says why."""
    if not args.trace or not (getattr(args, "json", None) or args.html):
        return
    from stepscope.analyses.trace.highlights import trace_highlights

    summary.trace, note = trace_highlights(args.trace, since=since)
    if summary.trace:
        from stepscope.doctor.verdict import classify

        summary.verdict = classify(summary)  # the traces are evidence too (a late rank, say)
    if note:
        summary.notes.append(note)
        if since is None:
            print(f"stepscope: {note}", file=sys.stderr)


def _html_writer() -> Callable[[RunSummary, Path], Any]:
    from stepscope.report.html import write_html

    return write_html


def _save_summary(args: argparse.Namespace, summary: RunSummary) -> list[str]:
    """``--json`` and ``--html`` of a measuring verb, each on its own: one that fails does not stop the other.
    Returns the lines saying where they went, for ``_print_report``."""
    written: list[str] = []
    if args.json:
        _save("--json", args.json, "summary", summary.to_json, written)
    if args.html:
        _save("--html", args.html, "report", lambda path: _html_writer()(summary, path), written)
    return written


def _check_outputs(args: argparse.Namespace, **what: str) -> None:
    """Check, before anything runs, that each output option given (``json="summary"`` checks ``--json``) can be
    written: not a folder, its folder there or creatable, write permission. Raises UsageError naming the first
    that cannot; creates missing parent folders."""
    for name, thing in what.items():
        path_text = getattr(args, name, None)
        if not path_text:
            continue
        option, path = f"--{name.replace('_', '-')}", Path(path_text)
        fail = f"{option} {path_text}: cannot write the {thing}"
        if path.is_dir():
            raise UsageError(f"{fail}: it is a folder (give a file name, e.g. {path / f'stepscope.{name}'}).")
        blocker = next((p for p in path.parents if p.exists()), None)
        if blocker is not None and not blocker.is_dir():
            raise UsageError(f"{fail}: {blocker} is a file, not a folder.")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise UsageError(f"{fail}: its folder cannot be created ({error.strerror}).") from None
        if not os.access(path if path.exists() else path.parent, os.W_OK):
            raise UsageError(f"{fail}: no write permission.")


def _save(
    option: str, path_text: str, what: str, write: Callable[[Path], Any], written: list[str] | None = None
) -> bool:
    """Write one output after the work is done; returns whether it was written. A failure that the check before
    the run could not foresee (a full disk, /dev/full) is one sentence on stderr: the other outputs are still
    written and the exit code stays the script's. The line saying where it went is printed, or added to
    ``written`` for ``_print_report`` to print after the report."""
    try:
        write(Path(path_text))
    except OSError as error:
        reason = error.strerror or str(error)
        print(f"stepscope: {option} {path_text}: could not write the {what} ({reason}).", file=sys.stderr)
        return False
    line = f"{what} written to {path_text}"
    if written is None:
        _print_report(print, line)
    else:
        written.append(line)
    return True


def _out_folder(path_text: str | None) -> Path | None:
    """``run --out DIR``, checked before the script starts: a folder (created when missing) stepscope can write."""
    if path_text is None:
        return None
    path = Path(path_text)
    if path.exists() and not path.is_dir():
        raise UsageError(f"--out {path_text} is a file: give a folder the job's nodes share.")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise UsageError(f"--out {path_text}: cannot create the folder ({error.strerror}).") from None
    if not os.access(path, os.W_OK):
        raise UsageError(f"--out {path_text}: no write permission.")
    return path


def _py_spy_out(path_text: str | None) -> Path | None:
    """``--py-spy OUT.svg``, checked before the script starts: py-spy installed, on Linux, a folder to write to."""
    if path_text is None:
        return None
    from stepscope.instrument.pyspy import PySpyError, find_pyspy

    if not sys.platform.startswith("linux"):
        raise UsageError(
            "--py-spy records on Linux only; elsewhere run py-spy yourself: "
            "sudo py-spy record -o OUT.svg --subprocesses -- python train.py"
        )
    try:
        find_pyspy()
    except PySpyError as error:
        raise UsageError(f"--py-spy: {error}") from None
    path = Path(path_text)
    if path.is_dir():
        raise UsageError(f"--py-spy {path_text} is a folder: give a file name, e.g. {path / 'flame.svg'}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise UsageError(f"--py-spy {path_text}: cannot create its folder ({error.strerror}).") from None
    if not os.access(path.parent, os.W_OK):
        raise UsageError(f"--py-spy {path_text}: its folder is not writable.")
    return path


def _watch(args: argparse.Namespace) -> int:
    from stepscope.instrument.watch import WatchError, watch
    from stepscope.report.terminal import print_summary

    _check_outputs(args, json="summary")
    try:
        summary, ended = watch(Path(args.folder), _progress(args.progress), args.hang_after)
    except WatchError as error:
        raise UsageError(str(error)) from None
    if summary is None:
        print(f"stepscope watch: no step was written into {args.folder} before Ctrl-C.")
        return 130
    written = ["stepscope watch: stopped by Ctrl-C; the job runs on, and these are its figures so far."]
    if args.json:
        _save("--json", args.json, "summary", summary.to_json, written)
    _print_report(print_summary, summary, written=written if not ended else written[1:])
    return 0 if ended else 130


def _dump(args: argparse.Namespace) -> int:
    import dataclasses

    from stepscope.instrument.pyspy import PySpyError
    from stepscope.instrument.stackdump import dump, format_report

    _check_outputs(args, json="dump")
    try:
        report = dump(args.pid, samples=args.samples, interval_s=args.interval_s)
    except PySpyError as error:
        raise UsageError(str(error)) from None
    print(format_report(report))
    if args.json:
        _write_json(args.json, dataclasses.asdict(report), "dump")
    return 1 if report.verdict == "hung" else 0


def _write_json(path_text: str, data: Any, what: str, written: list[str] | None = None) -> bool:
    """``--json``: ``data`` as indented JSON (see ``_save``); returns whether it was written."""
    import orjson

    def write(path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(orjson.dumps(data, option=orjson.OPT_INDENT_2) + b"\n")

    return _save("--json", path_text, what, write, written)


def _params(args: argparse.Namespace) -> int:
    from stepscope.analyses.params import combine
    from stepscope.instrument.launch import run
    from stepscope.instrument.tracker import RunConfig
    from stepscope.report.terminal import print_params

    target = _target(args.command, PARAMS_USAGE)
    _check_outputs(args, json="audit")
    config = RunConfig(
        out_dir="",
        warmup=0,
        steps=0,
        stop=False,
        params_steps=args.steps,
        include_zero_grad=args.include_zero_grad,
        system_interval_s=None,
    )
    code, summary = run(target, config)
    ranks = summary.ranks or [summary]
    result = combine({r.meta.rank or 0: r.params for r in ranks})
    written: list[str] = []
    if args.json:
        _write_json(args.json, result, "audit", written)
    _print_report(lambda: print_params(result, summary, include_zero_grad=args.include_zero_grad), written=written)
    return code


def _doctor(args: argparse.Namespace) -> int:
    from stepscope.doctor.checkup import examine, lint_script, script_path
    from stepscope.instrument.launch import STOPPED_REASONS, ignore_stops, run, stop_requested
    from stepscope.invariants import check
    from stepscope.report.terminal import print_doctor

    target = _target(args.command, DOCTOR_USAGE)
    lint, notes = lint_script(script_path(target.argv[1:]))
    config = _measure_config(
        args,
        # The parameter audit's hooks run during the first warm-up passes only, then come off.
        params_steps=max(1, min(3, args.warmup)),
        audit_continue=True,
        ceiling_batches=args.ceiling_batches or None,
        ceiling_sweep_s=args.sweep_budget_s if args.sweep else None,
    )
    _check_outputs(args, json="summary", html="report")
    started = time.time()
    # With --verify, a stop asked for during the run or the diagnosis is recorded, and no verify run starts.
    code, summary = run(
        target,
        config,
        py_spy=_py_spy_out(args.py_spy),
        more_runs=bool(args.verify),
        progress=_progress(args.progress),
        hang_after=args.hang_after,
    )
    summary.notes += notes
    _attach_trace(args, summary, started)
    examine(summary, lint)
    if args.verify:
        stopped = summary.exit.reason in STOPPED_REASONS or stop_requested()
        if stopped:  # at a terminal, Ctrl-C reaches the script alone: its exit says so
            summary.notes.append("--verify: nothing was measured: the run was stopped before it.")
        else:
            _verify(args, target, summary)
        ignore_stops()  # what is left is the report
    check(summary)
    _print_report(print_doctor, summary, written=_save_summary(args, summary))
    return _stopped_code(code) if args.verify else code


def _verify(args: argparse.Namespace, target: Any, summary: RunSummary) -> None:
    """``doctor --verify N``: measure the top N appliable fixes against the baseline, interleaved (see verify.py)."""
    from stepscope.analyses.ab import Settings
    from stepscope.instrument.launch import stop_requested
    from stepscope.instrument.tune import verify_neighbours
    from stepscope.instrument.verify import plan, verify

    started = time.monotonic()
    chosen = plan(summary.fixes, args.verify, args.allow_numerics)
    settings = Settings(repeats=args.verify_repeats, steps=args.steps, warmup=args.warmup)
    result = verify(target, summary, chosen, settings, args.verify_budget_s, run_timeout_s=args.run_timeout_s)
    left_s = args.verify_budget_s - (time.monotonic() - started)
    if result is not None and not result.stopped and not stop_requested() and left_s > 0:
        # An advised count that measured no faster: its neighbouring values, so the flag says what does work.
        verify_neighbours(target, summary, settings, left_s, run_timeout_s=args.run_timeout_s)


def _tune(args: argparse.Namespace) -> int:
    """``stepscope tune``: the doctor's diagnosis, then a measured search of the settings (see tune.py)."""
    import dataclasses

    from stepscope.analyses.ab import Settings
    from stepscope.doctor.checkup import examine, lint_script, script_path
    from stepscope.instrument.apply import parse_fixes
    from stepscope.instrument.launch import STOPPED_REASONS, ignore_stops, run, stop_requested
    from stepscope.instrument.tracker import RunConfig
    from stepscope.instrument.tune import Search, search
    from stepscope.report.tune import print_tune, progress

    target = _target(args.command, TUNE_USAGE)
    lint, notes = lint_script(script_path(target.argv[1:]))
    _check_outputs(args, json="tune results", html="tune page")
    config = RunConfig(
        out_dir="",
        warmup=args.warmup,
        steps=args.steps,
        system_interval_s=0.25,  # as doctor: a short run still has host samples
        params_steps=max(1, min(3, args.warmup)),
        audit_continue=True,
        ceiling_batches=100,
    )

    def diagnosed(arguments: list[str]) -> tuple[int, RunSummary]:
        code, summary = run(target, dataclasses.replace(config, apply=parse_fixes(arguments)), more_runs=True)
        summary.notes += notes
        examine(summary, lint)
        return code, summary

    started = time.monotonic()  # the budget counts the doctor's first run too
    code, summary = diagnosed([])
    plan = Search(
        target=target,
        settings=Settings(repeats=args.repeats, steps=args.steps, warmup=args.warmup),
        budget_s=args.budget_s,
        allow_numerics=args.allow_numerics,
        diagnose=lambda arguments: diagnosed(arguments)[1],
        run_timeout_s=args.run_timeout_s,
        started=started,
    )
    if summary.exit.reason in STOPPED_REASONS or stop_requested():
        result = None
    elif code != 0 or not summary.throughput or not summary.throughput.steps_per_s:
        result = None
        print(f"stepscope: tune has nothing to search from: {_no_baseline(code, summary)}", file=sys.stderr)
    else:
        with progress(args.budget_s, started) as plan.log:
            result = search(plan, summary)
    ignore_stops()  # what is left is the report
    written: list[str] = []
    if args.json and result is not None:
        _write_json(args.json, result.to_dict(), "tune results", written)
    if args.html and result is not None:
        from stepscope.report.tune_html import write_tune_html

        _save("--html", args.html, "tune page", lambda path: write_tune_html(result, args.command, path), written)
    _print_report(print_tune, result, summary, args.command, written=written)
    return _stopped_code(0 if result is not None else (code or 1))


def _no_baseline(code: int, summary: RunSummary) -> str:
    if code != 0:
        return f"the script exited with code {code} ({summary.exit.reason}) in the doctor's run."
    return "the doctor's run measured no training step."


NO_LOADER = (
    "the script never iterated a torch DataLoader before it ended. For a hand-rolled batch source (a get_batch() "
    "function, a generator), measure it in your code: stepscope.measure_loader(iterable, batches=300)."
)


def _dataloader(args: argparse.Namespace) -> int:
    from stepscope.analyses.loader import combine_ranks, sweep_trials, trainer_ms_per_sample
    from stepscope.instrument.launch import run
    from stepscope.instrument.tracker import RunConfig
    from stepscope.report.terminal import print_loader
    from stepscope.summary import RunSummary

    target = _target(args.command, LOADER_USAGE)
    train_rate = trainer_ms = None
    if args.against:
        against = RunSummary.from_json(args.against)
        train_rate = against.throughput.samples_per_s
        if train_rate is None:
            raise UsageError(f"{args.against} has no samples/s (no batch size was known): nothing to compare with.")
        trainer_ms = trainer_ms_per_sample(against)
    device = None if args.device == "cpu" else args.device
    if device is not None:
        import torch

        if not device.startswith("cuda"):
            raise UsageError(f"--device {device}: copies are timed on CUDA devices only (cuda, cuda:1, ...).")
        if not torch.cuda.is_available():
            raise UsageError(f"--device {device}: torch sees no CUDA device on this machine.")
    job = {
        "batches": args.batches,
        "warmup": args.warmup,
        "device": device,
        "sweep": args.sweep,
        "budget_s": args.budget_s,
        **sweep_trials(args.batches, args.warmup),
        "loader": args.loader,
        "trainer_ms_per_sample": trainer_ms,
    }
    _check_outputs(args, json="loader figures")
    config = RunConfig(out_dir="", warmup=0, steps=0, stop=False, system_interval_s=None, loader_job=job)
    code, summary = run(target, config)
    ranks = summary.ranks or [summary]
    results = {r.meta.rank or 0: r.dataloader for r in ranks if r.dataloader}
    result = combine_ranks(results, train_rate)
    summary.dataloader = result
    written: list[str] = []
    if args.json:
        _write_json(args.json, result, "loader figures", written)
    if not results:
        print(f"stepscope: {NO_LOADER}", file=sys.stderr)
    elif "loader" not in result:
        failures = [f"rank {r['rank']}: {r['error']}" for r in result["ranks"] if "error" in r]
        print(f"stepscope: the loader could not be measured ({'; '.join(failures)}).", file=sys.stderr)
    _print_report(print_loader, result, summary, written=written)
    if not results:
        return code or 1
    return 0 if code == 0 and "loader" in result else code or 1


def _interval(sample_hz: float) -> float | None:
    return None if sample_hz == 0 else 1.0 / sample_hz


def _rate_hz(maximum: float) -> Callable[[str], float]:
    """An argparse type: a rate in Hz (ASCII digits), 0 (off) or in (0, ``maximum``]."""

    def parse(text: str) -> float:
        value = float(text) if text.isascii() else math.nan
        if not (value == 0 or 0 < value <= maximum):
            raise argparse.ArgumentTypeError(f"must be 0 (off) or in (0, {maximum:g}] Hz, got {text}")
        return value

    return parse


# Each checkpoint builds and writes a whole summary: more often than this, writing would become a cost of its own.
MIN_CHECKPOINT_S = 1.0


def _finite(minimum: float = 0.0, *, zero: bool = False, unit: str = "seconds") -> Any:
    """An argparse type: a finite number of ``unit`` in ASCII (no NaN, no infinity), above ``minimum`` (or at it
    where ``zero``: a wait of 0 s means "do not wait"; a budget or interval of 0 means nothing)."""
    relation = ">=" if zero else ">"

    def parse(text: str) -> float:
        try:
            value = float(text) if text.isascii() else math.nan
        except ValueError:
            value = math.nan
        if not (math.isfinite(value) and (value >= minimum if zero else value > minimum)):
            raise argparse.ArgumentTypeError(f"must be a finite number of {unit} {relation} {minimum:g}, got {text!r}")
        return value

    return parse


_checkpoint_seconds = _finite(MIN_CHECKPOINT_S, zero=True)
_positive_seconds = _finite(0.0)
_seconds_or_zero = _finite(0.0, zero=True)


def _progress(mode: str) -> Any:
    from stepscope.report.progress import make_progress

    return make_progress(mode)


RUN_TIMEOUT_HELP = (
    "end a run still going after this many seconds, with its whole process tree, and leave it out (default: 5x the "
    "first run, at least 60 s)"
)


class UsageError(Exception):
    """Bad command-line input: printed as one sentence, exit code 2."""


def _int_at_least(minimum: int) -> Any:
    """An argparse type: an integer no smaller than ``minimum``."""

    def parse(text: str) -> int:
        if not text.strip().isascii():  # int() reads other scripts' digits ('١' as 1)
            raise argparse.ArgumentTypeError(f"must be a whole number in digits 0-9, got {text!r}")
        value = int(text)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value

    return parse


def _follow_options(verb: argparse.ArgumentParser) -> None:
    """The options of following a run's steps while it runs (run, doctor, watch)."""
    verb.add_argument(
        "--progress",
        choices=PROGRESS_MODES,
        default="auto",
        help="while the script runs: a live status line (live), a line every 5 s for logs (plain) or nothing (none); "
        "default: live on a terminal, plain otherwise",
    )
    verb.add_argument(
        "--hang-after",
        type=_finite(1.0),
        default=HANG_AFTER,
        metavar="N",
        help=f"a process that closes no step for N times its median step (and at least {MIN_HANG_S:g} s) is reported "
        f"as stalled (default {HANG_AFTER:g})",
    )


def _measure_options(verb: argparse.ArgumentParser, sample_hz: float, sample_hz_why: str) -> None:
    """The options of the verbs that measure a run (run, doctor); ``sample_hz_why`` says why the verb's default
    sampling rate is what it is."""
    verb.add_argument("--warmup", type=_int_at_least(0), default=20, help="steps to skip before measuring (default 20)")
    verb.add_argument("--steps", type=_int_at_least(1), default=200, help="steps to measure, then stop (default 200)")
    verb.add_argument("--json", metavar="PATH", help="write the RunSummary here")
    verb.add_argument("--html", metavar="PATH", help="write a self-contained HTML report here")
    verb.add_argument("--batch-size", type=_int_at_least(1), help="samples per step when the script has no DataLoader")
    verb.add_argument(
        "--checkpoint-s",
        type=_checkpoint_seconds,
        default=30.0,
        help=f"each process writes its figures so far this often (s, at least {MIN_CHECKPOINT_S:g}; default 30), so "
        "a killed process still leaves them",
    )
    _follow_options(verb)
    verb.add_argument(
        "--sink",
        action="append",
        metavar="KIND:TARGET",
        help="send each measured step's metrics to tensorboard:DIR, mlflow:URI, wandb:PROJECT or jsonl:PATH "
        "(repeatable; under a launcher TensorBoard and JSONL write per rank, MLflow and W&B from rank 0)",
    )
    verb.add_argument(
        "--metrics-jsonl",
        metavar="PATH",
        help="write each measured step's perf/ and sys/ metrics here, one JSON line per step ('{rank}' in the path "
        "names each rank's file; without it ranks get a .rankN suffix)",
    )
    verb.add_argument(
        "--sample-hz",
        type=_rate_hz(20),
        default=sample_hz,
        help=f"host CPU and GPU (NVML) samples per second over the measured steps; 0 turns sampling off "
        f"(default {sample_hz:g}; {sample_hz_why})",
    )
    verb.add_argument(
        "--stack-hz",
        type=_rate_hz(MAX_STACK_HZ),
        default=DEFAULT_STACK_HZ,
        help="training-thread stack samples per second while host sampling runs, naming the lines behind time no phase "
        f"owns (hotspots); each takes the GIL from the training thread; 0 turns it off (default {DEFAULT_STACK_HZ:g})",
    )
    verb.add_argument(
        "--py-spy",
        metavar="OUT.svg",
        help="also record a py-spy flame graph of every process of the command (ranks, loader workers) into one SVG; "
        "needs the py-spy package: pip install 'stepscope[pyspy]'",
    )
    verb.add_argument(
        "--trace",
        metavar="DIR",
        help="record torch.profiler traces of a few measured steps into DIR (one file per rank and window; "
        "analyse them with `stepscope trace DIR`)",
    )
    verb.add_argument(
        "--trace-window",
        type=_trace_window,
        default=(1, 1, 3, 1),
        metavar="WAIT:WARMUP:ACTIVE[:REPEAT]",
        help="the profiler's schedule in steps from the first measured step (default 1:1:3:1)",
    )
    verb.add_argument("--trace-shapes", action="store_true", help="record input shapes in the trace (larger)")
    verb.add_argument("--trace-stack", action="store_true", help="record Python stacks in the trace (much larger)")
    verb.add_argument("--nvtx", action="store_true", help="mark phases as NVTX ranges, for Nsight Systems (CUDA)")
    verb.add_argument(
        "--nsys-window",
        metavar="START:STOP",
        help="call cudaProfilerStart/Stop around steps START..STOP-1 (from 0, warm-up included), for "
        "nsys profile --capture-range=cudaProfilerApi",
    )
    verb.add_argument(
        "--apply",
        action="append",
        metavar="FIX[=VALUE]",
        help="apply a fix of the catalogue to the unmodified script at runtime, e.g. loader.num_workers=2, "
        "optimizer.foreach, debug.anomaly=off (repeatable, or joined by commas as the doctor gives them: "
        "loader.num_workers=8,loader.persistent_workers; see docs/run.md); the summary records where it applied",
    )


def _rank_list(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected ranks like 0,1,8, got {text!r}") from None


def _trace_options(trace: argparse.ArgumentParser) -> None:
    trace.add_argument("paths", nargs="+", metavar="PATH_OR_DIR", help="trace files (.json, .json.gz) or folders")
    trace.add_argument("--json", metavar="PATH", help="write the analysis here")
    trace.add_argument("--ranks", type=_rank_list, help="only these ranks, e.g. 0,1,8")
    trace.add_argument("--top", type=_int_at_least(1), default=10, help="kernels listed per rank (default 10)")
    trace.add_argument(
        "--jobs", type=_int_at_least(0), default=0,
        help="processes reading files in parallel, or a large file together (0: one per core, two on a large file "
        "when a core is idle; 1: one process)",
    )  # fmt: skip
    trace.set_defaults(func=_trace)


def _trace_parser() -> argparse.ArgumentParser:
    """The parser of `stepscope trace` alone, the same as `build_parser`'s sub-parser: building every verb's costs
    ~8 ms of the ~0.2 s a small trace takes."""
    trace = argparse.ArgumentParser(prog="stepscope trace")
    _trace_options(trace)
    return trace


def _trace(args: argparse.Namespace) -> int:
    # The analysis uses no BLAS: OpenBLAS's start-up of a thread per core is ~40 ms of the ~0.2 s a small trace takes.
    # Only this process (and its readers) see it, never a training script's.
    if "numpy" not in sys.modules:
        os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    from stepscope.analyses.trace.analyze import analyze_trace
    from stepscope.report.trace import print_trace

    _check_outputs(args, json="trace analysis")
    missing = [p for p in args.paths if not Path(p).exists()]
    for path in missing:
        print(f"stepscope: {path}: no such file or folder", file=sys.stderr)
    present = [p for p in args.paths if p not in missing]
    if not present:
        return 1  # each path was named above; there is nothing to analyse
    analysis = analyze_trace(present, ranks=args.ranks, top=args.top, jobs=args.jobs)
    print_trace(analysis)
    if args.json:
        _write_json(args.json, analysis.to_dict(), "trace analysis")
    return 0 if analysis.ranks else 1


def _scale(args: argparse.Namespace) -> int:
    from stepscope.analyses.scale import ScaleError, analyze_scale
    from stepscope.report.scale import print_scale, read_runs

    _check_outputs(args, json="scaling table", html="scaling report")
    try:
        runs, skipped = read_runs(args.paths, args.by)
        report = analyze_scale(runs, by=args.by, skipped=skipped)
    except ScaleError as error:
        for skip in error.skipped:
            print(f"stepscope: skipped: {skip.reason}", file=sys.stderr)
        raise UsageError(f"{error}.") from None
    print_scale(report)
    written = True
    if args.json:
        written &= _write_json(args.json, report.to_dict(), "scaling table")
    if args.html:
        from stepscope.report.scale_html import write_scale_html

        written &= _save("--html", args.html, "scaling report", lambda path: write_scale_html(report, path))
    return 0 if written else 1


AB_USAGE = (
    "stepscope ab [--repeats 5] [--steps 100] [--warmup 20] [--json PATH] [--fail-if-slower PCT] "
    "--variant 'NAME=[VAR=VALUE ...] COMMAND' --variant 'NAME=...' [--variant ...]"
)


def _ab(args: argparse.Namespace) -> int:
    from stepscope.analyses.ab import Settings, exit_status
    from stepscope.instrument.ab import parse_variants, run_ab
    from stepscope.report.ab import print_ab

    pct = args.fail_if_slower
    if pct is not None and not (math.isfinite(pct) and pct >= 0):
        raise UsageError(f"--fail-if-slower must be a finite percentage >= 0, got {pct:g}.")
    try:
        variants = parse_variants(args.variant or [])
    except ValueError as error:
        raise UsageError(str(error)) from None
    _check_outputs(args, json="A/B results")
    settings = Settings(repeats=args.repeats, steps=args.steps, warmup=args.warmup)
    result = run_ab(variants, settings, run_timeout_s=args.run_timeout_s)
    written: list[str] = []
    if args.json:
        _write_json(args.json, result.to_dict(), "A/B results", written)
    _print_report(print_ab, result, written=written)
    code, sentences = exit_status(result, args.fail_if_slower)
    for sentence in sentences:
        print(f"stepscope: {sentence}", file=sys.stderr)
    return _stopped_code(code)


def _stopped_code(code: int) -> int:
    """A command stopped by SIGINT or SIGTERM exits as the shell says a signal ended it (130, 143), after
    reporting what it measured."""
    from stepscope.instrument.launch import stop_requested

    signum = stop_requested()
    return code if signum is None else 128 + signum


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="stepscope", description="Where does my PyTorch training step time go, and what to fix first."
    )
    parser.add_argument("--version", action="version", version=f"stepscope {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    show = commands.add_parser("show", help="print the phase table of a saved summary JSON")
    show.add_argument("summary", help="path to a summary written by Scope.summary().to_json() or --json")
    show.set_defaults(func=_show)
    report = commands.add_parser("report", help="write the HTML report of a saved summary JSON")
    report.add_argument("summary", help="path to a summary written by --json or Scope.summary().to_json()")
    report.add_argument("--html", metavar="PATH", required=True, help="write the self-contained HTML page here")
    report.add_argument("--trace", metavar="DIR", help="add the highlights of the torch.profiler traces in DIR")
    report.set_defaults(func=_report)
    merged = commands.add_parser(
        "merge",
        help="merge the summaries of one job's nodes or ranks (files, or folders of them) into one",
        description="Merges per-node (`run --json` on each node) or per-rank (`run --out DIR`) summaries of one "
        "job: a global rank table with each rank's node, a per-node table, cluster samples/s, the straggler rank "
        "and node, and the job's verdict. Summaries of different jobs are refused. Exit code 2 for bad input.",
    )
    merged.add_argument("paths", nargs="+", metavar="SUMMARY_OR_DIR", help="summary files, or folders of them")
    merged.add_argument("--json", metavar="PATH", help="write the merged summary here")
    merged.add_argument("--html", metavar="PATH", help="write the merged report here")
    merged.set_defaults(func=_merge)

    run = commands.add_parser(
        "run",
        help="profile an unmodified training script (or a torchrun/accelerate command) and name the bottleneck",
        usage=RUN_USAGE,
        description="Runs the script (or the launcher command and all its ranks) unmodified, times each training "
        "step's phases after --warmup steps for --steps steps, then stops it (--no-stop lets it finish), and prints "
        "the phase table, the throughput and the bottleneck. Exit code: the script's own; 2 for bad options.",
    )
    _measure_options(run, sample_hz=1.0, sample_hz_why="doctor samples at 4 Hz, for a short run's peak memory")
    run.add_argument("--no-stop", action="store_true", help="let the script run to its end")
    run.add_argument(
        "--out",
        metavar="DIR",
        help="a folder every node of the job can write (a shared filesystem): each rank writes its summary there, "
        "and once the command ends this node merges the job's ranks it finds (see docs/multi-node.md)",
    )
    run.add_argument(
        "--out-wait-s",
        type=_seconds_or_zero,
        default=30.0,
        help="with --out: how long to wait for the other nodes' ranks to write their summaries (s, 0: do not wait; "
        "default 30)",
    )
    run.set_defaults(func=_run)

    params = commands.add_parser(
        "params",
        help="which parameters get no gradient (can DDP's find_unused_parameters be False?)",
        usage=PARAMS_USAGE,
    )
    params.add_argument(
        "--steps",
        type=_int_at_least(1),
        default=1,
        help="backward passes to audit (more find conditional ones; default 1)",
    )
    params.add_argument(
        "--include-zero-grad", action="store_true", help="also list parameters whose gradient is all zeros"
    )
    params.add_argument("--json", metavar="PATH", help="write the audit here")
    params.set_defaults(func=_params)

    doctor = commands.add_parser(
        "doctor",
        help="run the script, name the bottleneck with its evidence and rank the fixes by cost and gain",
        usage=DOCTOR_USAGE,
        description="Measures the script as `stepscope run` does, audits its parameters in the first warm-up steps, "
        "measures its DataLoader alone (--ceiling-batches), reads its settings and source, then names the "
        "bottleneck with the figures that show it and ranks the fixes by the time each can save for its cost (those "
        "that can save under 5% of the step last). Exit code: the script's own; "
        "2 for bad options.",
    )
    _measure_options(doctor, sample_hz=4.0, sample_hz_why="run samples at 1 Hz; 4 gives a short run its peak memory")
    doctor.add_argument(
        "--ceiling-batches",
        type=_int_at_least(0),
        default=100,
        help="after the measured steps, iterate the loader alone this many batches (at most 20 s) for its "
        "ceiling; 0 skips it (default 100)",
    )
    doctor.add_argument(
        "--sweep",
        action="store_true",
        help="after the loader's ceiling, sweep its settings (as `stepscope dataloader --sweep`), ranked by the rate "
        "the measured steps would reach with each; loader.num_workers then advises the sweep's best, which --verify "
        "measures",
    )
    doctor.add_argument(
        "--sweep-budget-s",
        type=_positive_seconds,
        default=60.0,
        help="seconds the sweep may take (default 60)",
    )
    doctor.add_argument(
        "--verify",
        type=_int_at_least(1),
        nargs="?",
        const=3,
        default=None,
        metavar="N",
        help="then apply each of the top N fixes that --apply can make (default 3) and measure its speedup against "
        "the baseline in interleaved runs (--warmup/--steps each), with a 95%% interval; fixes re-ranked by it",
    )
    doctor.add_argument(
        "--verify-repeats", type=_int_at_least(2), default=3, help="runs of the baseline and of each fix (default 3)"
    )
    doctor.add_argument(
        "--verify-budget-s",
        type=_positive_seconds,
        default=900.0,
        help="start no verification run that would end past this many seconds (default 900)",
    )
    doctor.add_argument(
        "--run-timeout-s",
        type=_positive_seconds,
        help=RUN_TIMEOUT_HELP,
    )
    doctor.add_argument(
        "--allow-numerics",
        action="store_true",
        help="also verify fixes that change numerics (bf16, TF32): their runs compute a slightly different model",
    )
    doctor.set_defaults(func=_doctor)

    loader = commands.add_parser(
        "dataloader",
        help="measure the script's DataLoader alone (its ceiling) and sweep its settings",
        usage=LOADER_USAGE,
    )
    loader.add_argument("--batches", type=_int_at_least(1), default=300, help="batches to measure (default 300)")
    loader.add_argument("--warmup", type=_int_at_least(0), default=20, help="batches to skip first (default 20)")
    loader.add_argument("--sweep", action="store_true", help="also try other num_workers/prefetch/pin settings")
    loader.add_argument(
        "--budget-s", type=_positive_seconds, default=120.0, help="time limit of the sweep, s (default 120)"
    )
    loader.add_argument("--device", default="cpu", help="also copy each batch there and time the copy (cuda, cuda:1)")
    loader.add_argument("--loader", type=_int_at_least(0), help="measure the N-th loader the script iterates (0-based)")
    loader.add_argument(
        "--against",
        metavar="SUMMARY",
        help="a `stepscope run` summary of the script: loader ceiling vs training, and the sweep ranked by the "
        "rate that run's step would reach with each setting",
    )
    loader.add_argument("--json", metavar="PATH", help="write the loader figures here")
    loader.set_defaults(func=_dataloader)

    _trace_options(
        commands.add_parser(
            "trace",
            help="analyse torch.profiler (Kineto) traces: GPU idle/compute/communication, idle causes, top kernels",
        )
    )

    dump = commands.add_parser(
        "dump",
        help="print every thread's stack of a live run (py-spy) and say whether it looks hung or busy",
        description="Samples the process and its descendants with py-spy dump. Exit code: 0 busy or idle, 1 looks "
        "hung, 2 py-spy is missing or may not read the process.",
    )
    dump.add_argument("pid", type=_int_at_least(1), help="the run's pid: stepscope's, the launcher's or one rank's")
    dump.add_argument("--samples", type=_int_at_least(2), default=5, help="dumps to compare (default 5)")
    dump.add_argument(
        "--interval-s", type=_positive_seconds, default=0.5, help="seconds between two dumps (default 0.5)"
    )
    dump.add_argument("--json", metavar="PATH", help="write the threads, stacks and verdict here")
    dump.set_defaults(func=_dump)

    watch = commands.add_parser(
        "watch",
        help="follow a running job from its --out folder (another terminal or node): live progress, then its summary",
        description="Follows the step streams the job's processes write into DIR (`stepscope run --out DIR`), with "
        "the same progress as `stepscope run`, and prints the job's summary when it ends. It needs no connection to "
        "the job; Ctrl-C ends the watch, never the job. Exit code: 0 when the job ended, 130 on Ctrl-C.",
    )
    watch.add_argument("folder", metavar="DIR", help="the job's run folder (its --out)")
    _follow_options(watch)
    watch.add_argument("--json", metavar="PATH", help="write the job's summary here")
    watch.set_defaults(func=_watch)

    scale = commands.add_parser(
        "scale",
        help="compare run summaries across world sizes: samples/s, speedup, efficiency, and the phase that grows",
    )
    scale.add_argument("paths", nargs="+", metavar="SUMMARY", help="summary files (--json of run) or folders of them")
    scale.add_argument(
        "--by",
        metavar="LABEL",
        help="also group by LABEL: --LABEL VALUE or LABEL=VALUE in the run's command, else a LABEL=VALUE folder or "
        "file name; 'folder' groups by the folder that holds each summary",
    )
    scale.add_argument("--json", metavar="PATH", help="write the scaling table here")
    scale.add_argument("--html", metavar="PATH", help="write a self-contained HTML page with the table and charts")
    scale.set_defaults(func=_scale)
    tune = commands.add_parser(
        "tune",
        help="search the settings --apply can make by measuring them, and hand back the fastest combination",
        usage=TUNE_USAGE,
        description="Diagnoses the script as `stepscope doctor` does, then measures the settings the diagnosis makes "
        "plausible (worker counts on both sides of the core cap, prefetch, intra-op threads, the optimizer's "
        "kernels, the debug modes; bf16 and TF32 with --allow-numerics) against the best so far: short runs first, "
        "then full interleaved runs of the fastest third, keeping a setting only when its 95%% interval says "
        "faster, and diagnosing again after each. Ends with the best against the baseline, and how to keep it.",
    )
    tune.add_argument("--warmup", type=_int_at_least(0), default=20, help="steps skipped per run (default 20)")
    tune.add_argument("--steps", type=_int_at_least(1), default=100, help="steps measured per full run (default 100)")
    tune.add_argument(
        "--repeats", type=_int_at_least(2), default=3, help="full runs of each promoted setting (default 3)"
    )
    tune.add_argument(
        "--budget-s",
        type=_positive_seconds,
        default=600.0,
        help="start no run that would end past this many seconds from the start (default 600); the search "
        "leaves time for the last A/B of the best against the baseline",
    )
    tune.add_argument(
        "--allow-numerics",
        action="store_true",
        help="also try settings that change numerics (bf16, TF32): their runs compute a slightly different model",
    )
    tune.add_argument("--json", metavar="PATH", help="write the baseline, the trials and the best combination here")
    tune.add_argument("--html", metavar="PATH", help="write the search as a self-contained HTML page (trials charted)")
    tune.add_argument("--run-timeout-s", type=_positive_seconds, help=RUN_TIMEOUT_HELP)
    tune.set_defaults(func=_tune)

    ab = commands.add_parser(
        "ab",
        help="did my change help? run variants interleaved and compare sec/step with a confidence interval",
        usage=AB_USAGE,
    )
    ab.add_argument(
        "--variant",
        action="append",
        metavar="NAME=COMMAND",
        help="a variant: its name, '=', then its command as in a shell (leading VAR=VALUE words set its "
        "environment); the first is the baseline; repeat for each variant",
    )
    ab.add_argument("--repeats", type=_int_at_least(1), default=5, help="runs of each variant (default 5)")
    ab.add_argument("--steps", type=_int_at_least(1), default=100, help="steps measured per run (default 100)")
    ab.add_argument("--warmup", type=_int_at_least(0), default=20, help="steps skipped per run (default 20)")
    ab.add_argument("--json", metavar="PATH", help="write the variants, runs and comparisons here")
    ab.add_argument("--run-timeout-s", type=_positive_seconds, help=RUN_TIMEOUT_HELP)
    ab.add_argument(
        "--fail-if-slower",
        type=float,  # checked in _ab: a usage error of ab is one "stepscope: " sentence
        metavar="PCT",
        help="exit 1 when a variant is slower than the first by more than PCT%% with confidence (a CI gate)",
    )
    ab.set_defaults(func=_ab)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the process exit code (2 for bad input)."""
    argv = sys.argv[1:] if argv is None else argv
    command: list[str] = []
    bad_input: tuple[type[Exception], ...] = (UsageError,)
    if argv[:1] == ["trace"]:
        # The trace verb reads no summary and launches nothing: its own parser, and none of the others' modules.
        parser, argv = _trace_parser(), argv[1:]
    else:
        from stepscope.instrument import LaunchError
        from stepscope.summary import SummaryError

        bad_input = (SummaryError, LaunchError, UsageError)
        if argv[:1] and argv[0] in _SCRIPT_VERBS:
            options, command = _split_run(argv[1:])
            argv = [argv[0], *options]
        parser = build_parser()
    args = parser.parse_args(argv)
    if not hasattr(args, "func"):
        parser.print_help()
        return 2
    args.command = command
    try:
        return args.func(args)
    except bad_input as error:
        print(f"stepscope: {error}", file=sys.stderr)
        return 2


def entry_point() -> None:
    """The ``stepscope`` command (and ``python -m stepscope``): `main`, then the process exits.

    What `main` made is frozen out of the collector first: the interpreter's collections while it shuts down walk
    every object left (numpy's and the other libraries' modules, a trace's names), ~10-15 ms of the ~0.2 s a small
    trace takes, to free memory the process is about to give back whole. Exit handlers still run."""
    code = main()
    gc.freeze()
    sys.exit(code)


if __name__ == "__main__":
    entry_point()
