"""``stepscope ab``'s side that runs things: parse ``NAME=COMMAND`` variants and run them interleaved, each exactly
as ``stepscope run`` would (the same launcher, instrumentation and summary), then hand the summaries to
analyses/ab.py.

A variant's command is split as a shell would (shlex): its leading ``VAR=VALUE`` words set the command's
environment, the rest is what ``stepscope run`` takes — ``python SCRIPT.py ARGS`` or ``SCRIPT.py ARGS`` (run with
the Python that runs stepscope, as ``stepscope run SCRIPT.py`` does), ``python -m MODULE ARGS``, or any launcher
(``torchrun ...``). ``--apply FIX[=VALUE]`` words between the environment and the command inject fixes into
that variant's runs, as ``stepscope run --apply`` does: ``--variant 'w2=--apply loader.num_workers=2 train.py'``.
"""

from __future__ import annotations

import re
import shlex
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from stepscope.analyses.ab import ABResult, RunFigures, Settings, ab_result, run_figures, variant_result
from stepscope.instrument import LaunchError, launch
from stepscope.instrument.apply import ApplyError, parse_fixes
from stepscope.instrument.tracker import RunConfig

_ENV_WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=")
_PYTHON = re.compile(r"python[0-9.]*")  # a bare interpreter name: python, python3, python3.11
# A run that a person or a job manager stopped (its summary says so, or the shell's 128+SIGINT, 128+SIGTERM ended
# a process that wrote none): the A/B stops there.
_STOPPED_CODES = (130, 143)
# Host and GPU sampling period, s: 4 Hz, like `stepscope doctor`, so that a short run still has samples for its
# peak memory.
SAMPLE_INTERVAL_S = 0.25
# A run's default time limit: this many times the first run's duration, and never under TIMEOUT_MIN_S (a first
# run cut short by a fast failure must not make the limit of the others too tight to start torch).
TIMEOUT_FACTOR = 5.0
TIMEOUT_MIN_S = 60.0


@dataclass
class Variant:
    """One side of the comparison: its name, its command as given, the environment it sets, what to run."""

    name: str
    command: str
    env: dict[str, str]
    target: launch.Target
    apply: list[dict[str, Any]] = field(default_factory=list)  # `--apply` fixes injected into its runs


def parse_variant(text: str) -> Variant:
    """``NAME=[VAR=VALUE ...] COMMAND ...`` into a Variant; ValueError (bad form) or LaunchError (a script that
    does not exist, a launcher not on PATH) says what is wrong."""
    name, sep, command = text.partition("=")
    name = name.strip()
    if not sep or not name:
        raise ValueError(f"--variant {text!r} is not NAME=COMMAND, e.g. --variant 'base=python train.py --bs 16'.")
    try:
        words = shlex.split(command)
    except ValueError as error:
        raise ValueError(f"variant {name}: cannot split its command ({error}).") from None
    env = {}
    while words and _ENV_WORD.match(words[0]):
        key, _, value = words.pop(0).partition("=")
        env[key] = value
    fixes = []
    while words and (words[0] == "--apply" or words[0].startswith("--apply=")):  # `stepscope run --apply`'s
        word = words.pop(0)
        if word == "--apply" and not words:
            raise ValueError(f"variant {name}: --apply needs a fix, e.g. --apply loader.num_workers=2.")
        fixes.append(words.pop(0) if word == "--apply" else word.removeprefix("--apply="))
    if not words:
        raise ValueError(f"variant {name} has no command after its environment, e.g. {name}=python train.py.")
    try:
        applied = parse_fixes(fixes)
    except ApplyError as error:
        raise ValueError(f"variant {name}: {error}") from None
    try:
        target = _target(words)
    except LaunchError as error:
        raise LaunchError(f"variant {name}: {error}") from None
    return Variant(name, command.strip(), env, target, applied)


def _target(words: list[str]) -> launch.Target:
    """The Target ``stepscope run`` would build for these words."""
    if _PYTHON.fullmatch(words[0]) and len(words) > 1:
        first, rest = words[1], words[2:]
        if first == "-m":
            return _module(rest)
        if not first.startswith("-"):
            return launch.script_target(first, rest)
        return launch.command_target(words)  # interpreter options (python -X ...): the command as written
    first, rest = words[0], words[1:]
    if first == "-m":
        return _module(rest)
    if first.endswith(".py"):
        return launch.script_target(first, rest)
    return launch.command_target(words)


def _module(words: list[str]) -> launch.Target:
    if not words:
        raise ValueError("-m needs a module name, e.g. python -m package.train.")
    return launch.module_target(words[0], words[1:])


def parse_variants(texts: list[str]) -> list[Variant]:
    """At least two variants with distinct names; the first is the baseline."""
    if not texts:
        raise ValueError("no variant: give two or more, e.g. --variant 'base=python train.py' --variant 'new=...'.")
    variants = [parse_variant(text) for text in texts]
    if len(variants) < 2:
        raise ValueError(f"only one variant ({variants[0].name}): an A/B needs a second to compare it with.")
    names = [v.name for v in variants]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"variant names must differ: {', '.join(twice)} is given more than once.")
    return variants


def run_timeout(first_run_s: float | None) -> float | None:
    """The default time limit of a run, s: ``TIMEOUT_FACTOR`` × the first run's duration, at least
    ``TIMEOUT_MIN_S``; None (no limit) for the first run itself."""
    return None if first_run_s is None else max(TIMEOUT_MIN_S, TIMEOUT_FACTOR * first_run_s)


def run_ab(
    variants: list[Variant],
    settings: Settings,
    log: Callable[[str], None] = lambda line: print(line, file=sys.stderr, flush=True),
    budget_s: float | None = None,
    run_timeout_s: float | None = None,
) -> ABResult:
    """Run every variant ``settings.repeats`` times interleaved (A B A B ...), so that a drift of the machine
    (clocks, thermals, a neighbour's load) falls on both alike; then compare. Each run measures ``settings.steps``
    steps after ``settings.warmup``, then stops. A run interrupted (Ctrl-C, SIGTERM to stepscope or to the run)
    ends the A/B there: what was measured is still compared. With ``budget_s``, no run starts that would likely end
    past it (the runs so far give its likely length): what ran within the budget is compared.

    Each run has a process group of its own and a time limit: ``run_timeout_s``, else ``run_timeout`` of the
    first run's duration. A run past it is ended with its whole tree and left out with the reason; the A/B goes
    on."""
    config = RunConfig(out_dir="", warmup=settings.warmup, steps=settings.steps, system_interval_s=SAMPLE_INTERVAL_S)
    runs: list[list[RunFigures]] = [[] for _ in variants]
    total, stopped = settings.repeats * len(variants), None
    started = time.monotonic()
    first_run_s = None
    try:
        for order in range(1, total + 1):
            index = (order - 1) % len(variants)
            variant = variants[index]
            elapsed = time.monotonic() - started
            if launch.stop_requested():
                stopped = f"the A/B was stopped after {order - 1} of {total} runs; compared what ran."
                break
            if budget_s is not None and order > 1 and elapsed * order / (order - 1) > budget_s:
                stopped = (
                    f"the budget of {budget_s:.3g} s ran out after {order - 1} of {total} runs ({elapsed:.0f} s); "
                    "compared what ran."
                )
                break
            log(f"stepscope ab: run {order}/{total}: {variant.name}")
            limit = run_timeout_s if run_timeout_s is not None else run_timeout(first_run_s)
            run_started = time.monotonic()
            code, summary = launch.run(
                variant.target, replace(config, apply=variant.apply), env=variant.env, own_group=True, timeout_s=limit
            )
            first_run_s = first_run_s or time.monotonic() - run_started
            figures = run_figures(summary, code, order)
            runs[index].append(figures)
            if figures.failure:
                log(f"stepscope ab: run {order} ({variant.name}) is left out: {figures.failure}")
            signalled = code in _STOPPED_CODES and figures.exit_reason != "timeout"
            if launch.stop_requested() or figures.exit_reason in launch.STOPPED_REASONS or signalled:
                stopped = f"the A/B was stopped during run {order} of {total} (exit code {code}); compared what ran."
                break
    except KeyboardInterrupt:
        stopped = f"the A/B was interrupted after {sum(map(len, runs))} of {total} runs; compared what ran."
    finally:
        launch.ignore_stops()  # what is left is the report
    results = [variant_result(v.name, v.command, v.env, r) for v, r in zip(variants, runs, strict=True)]
    return ab_result(settings, results, stopped)
