"""Truth generator (issue 24): ordinary training loops with injected, known costs, and how right stepscope is.

Each case is drawn from a seeded RNG (bench/truth_spec.py), written as a plain training script
(bench/truth_script.py) into a folder, run as ``stepscope doctor --warmup 5 --steps 40 --json OUT.json CASE.py``
(2-rank cases: ``... -- torchrun --standalone --nproc-per-node 2 CASE.py``, DDP over gloo on CPU) and scored
(bench/truth_score.py)::

    .venv/bin/python bench/truth.py --cases 40 --seed 1 --out /tmp/truth   # keep scripts, summaries, results
    .venv/bin/python bench/truth.py --seed 1 --only c007 --out /tmp/truth  # one case again
    .venv/bin/python bench/truth.py --ci                                   # the fixed CI subset
    .venv/bin/python bench/truth.py --cases 40 --seed 1 --out /tmp/truth --rescore   # score kept runs again

Building blocks: costs (sleep, or a busy CPU loop) in the data (a Dataset's ``__getitem__`` or a collate_fn),
forward (the model's forward), backward (a custom autograd Function), optimizer (an SGD subclass, or an Optimizer
wrapping an inner SGD) and other (plain Python in the loop body); a second model's forward without gradients
before (a teacher) or after the step (a metric or EMA model): step work; validation over its own loader every
K ≥ 5 steps; 1–3 loaders (map-style or iterable, each with its own Dataset class), fetched each per micro-batch
or in turn, by the training thread or (15% of cases) each by a prefetcher thread that hands its batches over
through a queue, as prefetch_generator's BackgroundGenerator does; gradient accumulation (2–4 micro-batches;
DDP: ``no_sync`` but the last); ``torch.save`` of a 6–12 MB state dict every step; a log line (print or logging)
formatting a tensor every step; a straggler rank (an extra 6–15 ms sleep in one phase on one rank, or rank 0 alone
saving/logging); 4–6 CPU-bound loader workers on 2 cores; busy-loop processes beside the run (``--load``: two on
every case).

Ground truth is the script's own timer: per optimizer step its end time (``perf_counter``), the time spent in
its own validation since the previous step's end, the time each phase's calls took (a timer around every
fetch, forward, backward, optimizer step and zero_grad: the injected cost plus the tiny model's own time and
stepscope's hooks, i.e. "expected = injected + base", the base measured) and the injected costs as spent (a
loaded machine stretches a busy loop, or a sleep's wake-up, for the script's clock as for stepscope's). The
scorer takes the measured window (``steps.warmup`` and ``steps.measured`` of the summary) from the end of the
last warm-up step, less the last measured step: the doctor does its own work (the loader ceiling) inside the
script's last ``optimizer.step()`` call, after stepscope closed the step, which the script's clock cannot tell
apart. Own step rate = steps / (wall − own validation time), own wall rate = steps / wall; own ``other`` = each
interval − validation − the timed calls. ``--plain`` runs the scripts without stepscope and prints their own
figures beside the injected ones: the generator's own check.

Scores (right / wrong / n/a per case; the table gives % right over the applicable cases):

1. **steps/s**: ``throughput.steps_per_s`` within ±5% of the own step rate (2-rank: the job's figure against the
   slowest rank's own rate); when the summary has ``throughput.wall_steps_per_s``, also that against the own
   wall rate (±5%).
2. **phases**: each phase an injected cost lands in has ``phases[p].mean_ms`` (2-rank: each rank's row in
   ``ranks``; backward there is ``backward + comms``, since the script's timer around ``loss.backward()`` holds
   DDP's all-reduce wait) within ±15% or ±0.3 ms (whichever is larger) of the own figure; with validation,
   the summary's (the job's) ``eval.passes`` within ±1 of the validations that ran in the window; without, no
   pass at all (per-step side work taken for validation fails here); a 2-rank straggler named in
   ``cluster.straggler`` (rank and phase; a rank-0-only checkpoint or log: rank 0, ``other``).
3. **bound**: ``verdict.bound`` is the group of the largest own time (data_wait/h2d → data, forward/backward →
   compute, optimizer/zero_grad/clip → optimizer, other/sync → host; 2-rank: each phase's mean over the ranks,
   backward the least rank's, which waited least in it; ``balanced`` is also right when that group is under 45%
   of the step, the runner-up group too when within 15% of it); with an injected straggler, the group of its
   phase; 2-rank, also the group of any phase where one rank's own time is ≥ 10% of the step above the other's
   (a real straggler, which load can make of symmetric costs); own-worker oversubscription → data (its
   data_wait dominates); with busy loops beside the run, also right: "the machine is oversubscribed" in the
   evidence with the confidence below high.
4. **first fix**: aimed at the cause of the verdict's bound when that bound is right (score 3), else at the
   cause of the expected bound. The fix ids aimed at each kind of cause:

   - data (loader costs): ``loader.num_workers``, ``loader.io_bound``, ``loader.transform_bound``,
     ``loader.prefetch``; the evidence must name the Dataset class of the loader with the most own data_wait among
     those given a cost (a free loader's wait is its workers' hand-over, which load stretches: not injected);
   - own oversubscription (4–6 CPU-bound workers on 2 cores): ``loader.too_many_workers``, ``host.threads``,
     ``loader.transform_bound`` (a ``loader.*`` one naming the Dataset class);
   - optimizer (its step sleeps/burns): ``optimizer.fused``, ``optimizer.foreach`` (the catalogue's only fixes of
     the optimizer step's time);
   - checkpoint every step: ``host.checkpoint_every_step``, naming ``CASE.py:LINE`` of the ``torch.save``;
   - log line every step: ``host.log_every_step``, naming ``CASE.py:LINE`` of the print/logging call;
   - validation (never the bound: it is not step time): ``eval.frequency``;
   - no catalogued fix: compute (sleeps/busy loops in forward or backward, side work; the catalogue's compute
     fixes are GPU ones, and DDP's are about gradient copies of a 68-parameter model) and plain Python in the
     loop body (``other``).

   Right when ``fixes[0]`` is aimed at that cause (its evidence naming the loader or line above, and for an
   injected straggler's cause the rank); or when it is aimed at another injected cause with a fix (data or
   optimizer ≥ 5% of the step, checkpoint/log ≥ 5%, any validation; a loader fix naming the right loader) and
   the cause has no catalogued fix, or its first aimed fix costs more (config < code < infra: the doctor ranks
   cheapest first); or, when the cause has no catalogued fix, when there is no fix or the first is bounded
   under 5% (the doctor's "noise" tail). Wrong otherwise: e.g. ``eval.frequency`` without validation, a loader
   fix when data_wait is small or not injected, ``host.threads`` without oversubscription.
5. **invariants**, computed from the JSON on the job and on every rank: each share ≤ 100% (+0.5%), each phase
   mean ≤ the step mean (+0.5%), the top-level phases' means (weighted by the steps they ran in) adding up to the
   step mean within 1%; 2-rank: the ranks' wall time per step (``wall.window_s`` over the measured steps; the
   step means without a window) within 10% of each other; no more validation passes than measured steps; and the
   product's own ``invariants`` list empty (absent: none).

A run that leaves no summary, or whose script's own records do not cover the window, scores wrong on every
score, with the reason. Cases are kept (``--out``) as script, ``*.json`` summary, ``*.truth*`` own records,
``*.out`` output; ``results.jsonl`` has one line per case.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from truth_score import (
    NA,
    RIGHT,
    SCORES,
    Expectation,
    OwnFigures,
    Score,
    TruthError,
    expect,
    expectation_dict,
    failed_run,
    own_figures,
    score_case,
    set_val_waits,
)
from truth_script import Script, write_script
from truth_spec import CaseSpec, Cost, LoaderSpec, SideSpec, StragglerSpec, ValSpec, ci_cases, draw_case

__all__ = [
    "CaseResult",
    "CaseSpec",
    "Cost",
    "Expectation",
    "LoaderSpec",
    "OwnFigures",
    "Score",
    "SideSpec",
    "StragglerSpec",
    "ValSpec",
    "busy_loops",
    "ci_cases",
    "doctor_command",
    "draw_case",
    "expect",
    "own_figures",
    "run_case",
    "score_case",
    "set_val_waits",
    "write_script",
]

CASE_TIMEOUT_S = 120.0
UNMEASURED = "the script runs on unmeasured"


@dataclass
class CaseResult:
    """One case run and scored."""

    spec: CaseSpec
    folder: Path
    command: list[str]
    returncode: int | None
    seconds: float
    scores: list[Score]
    expectation: Expectation | None = None
    notes: list[str] = field(default_factory=list)

    def score(self, name: str) -> Score:
        return next(s for s in self.scores if s.name == name)

    def to_dict(self) -> dict[str, Any]:
        return {
            "case": self.spec.case_id,
            "blocks": self.spec.blocks(),
            "spec": self.spec.to_dict(),
            "command": shlex.join(self.command),
            "folder": str(self.folder),
            "returncode": self.returncode,
            "seconds": round(self.seconds, 2),
            "scores": {s.name: {"status": s.status, "detail": s.detail} for s in self.scores},
            "expectation": expectation_dict(self.expectation) if self.expectation else None,
            "notes": self.notes,
        }


def doctor_command(spec: CaseSpec, script: Path, json_path: Path, truth_prefix: Path) -> list[str]:
    """``stepscope doctor`` on the case, under torchrun for 2 ranks. The loader ceiling is measured (20 batches)
    only where data is the question; elsewhere it would add seconds and change nothing scored."""
    data = spec.cause in ("data", "oversubscribed", "straggler:data_wait")
    cmd = [sys.executable, "-m", "stepscope.cli", "doctor", "--warmup", str(spec.warmup), "--steps", str(spec.steps)]
    cmd += ["--ceiling-batches", "20" if data else "0", "--json", str(json_path)]
    if spec.ranks == 1:
        return [*cmd, str(script), str(truth_prefix)]
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(spec.ranks)]
    return [*cmd, "--", *launcher, str(script), str(truth_prefix)]


def child_env() -> dict[str, str]:
    """The environment of a case: one intra-op thread per process (torch's default on 2 cores would oversubscribe
    every 2-rank case) and no STEPSCOPE/CI overrides."""
    env = dict(os.environ)
    env.pop("STEPSCOPE", None)
    env.pop("CI", None)
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    return env


@contextlib.contextmanager
def busy_loops(count: int) -> Iterator[list[int]]:
    """``count`` busy-loop processes beside the run, killed (by PID) on the way out."""
    procs = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"], stdin=subprocess.DEVNULL) for _ in range(count)
    ]
    try:
        yield [p.pid for p in procs]
    finally:
        for p in procs:
            p.kill()
            p.wait()


def _run(cmd: list[str], folder: Path, out_path: Path, timeout: float) -> tuple[int | None, str]:
    """Runs the command in its own session, so that its whole tree (torchrun, ranks, workers) can be ended: at
    the timeout, or as soon as stepscope says it could not instrument the script (which then trains forever)."""
    with open(out_path, "w") as out:
        proc = subprocess.Popen(
            cmd, cwd=folder, env=child_env(), stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        deadline = time.monotonic() + timeout
        why = ""
        while proc.poll() is None:
            if time.monotonic() > deadline:
                why = f"timed out after {timeout:.0f} s"
            elif UNMEASURED in out_path.read_text(errors="replace"):
                why = "stepscope could not instrument the script: " + _line_with(out_path, UNMEASURED)
            if why:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                return None, why
            time.sleep(0.25)
        return proc.returncode, why


def _line_with(path: Path, text: str) -> str:
    return next((line for line in path.read_text(errors="replace").splitlines() if text in line), "")


def _read_own(spec: CaseSpec, truth_prefix: Path, summary: dict[str, Any]) -> list[OwnFigures]:
    """The script's own figures over the summary's measured window, one per rank."""
    steps = summary.get("steps") or {}
    warmup, measured = int(steps.get("warmup") or 0), int(steps.get("measured") or 0)
    paths = [truth_prefix] if spec.ranks == 1 else [Path(f"{truth_prefix}.rank{r}") for r in range(spec.ranks)]
    own = []
    for rank, path in enumerate(paths):
        if not path.exists():
            raise TruthError(f"no own records at {path.name}")
        records = json.loads(path.read_text())["records"]
        rounds = warmup
        if spec.critic and len(records) < warmup + measured:
            # The round is learned while running: the first one, cut at each of its two optimizer steps, is two
            # warm-up steps. stepscope stops the script at its first event after the measured steps.
            rounds = len(records) - measured
        own.append(own_figures(records, rounds, measured, rank))
    if len(own) > 1:
        set_val_waits(own)
    return own


Runner = Callable[[list[str], Path, Path, float], tuple[int | None, str]]


def run_case(
    spec: CaseSpec,
    folder: Path,
    timeout: float = CASE_TIMEOUT_S,
    rescore: bool = False,
    runner: Runner | None = None,
    redoctor: bool = False,
) -> CaseResult:
    """Writes the case's script into ``folder``, runs the doctor on it (beside its busy loops) and scores it
    (``rescore``: scores what an earlier run left in ``folder``, without running; ``redoctor``: with the verdict
    and fixes of its summary made again by this code). ``runner(command, folder, output
    file, timeout)`` runs the doctor and returns (exit code, why it was cut short); by default a process of its own
    (the suite runs single-rank CI cases inside the test process instead)."""
    folder.mkdir(parents=True, exist_ok=True)
    script: Script = write_script(spec)
    path = folder / f"{spec.case_id}.py"
    json_path, truth_prefix = folder / f"{spec.case_id}.json", folder / f"{spec.case_id}.truth"
    cmd = doctor_command(spec, path, json_path, truth_prefix)
    rc, why, seconds = 0, "", 0.0
    if not rescore:
        path.write_text(script.text)
        for stale in [json_path, *folder.glob(f"{spec.case_id}.truth*")]:
            stale.unlink(missing_ok=True)
        start = time.perf_counter()
        with busy_loops(spec.bg_load):
            rc, why = (runner or _run)(cmd, folder, folder / f"{spec.case_id}.out", timeout)
        seconds = time.perf_counter() - start
    result = CaseResult(spec, folder, cmd, rc, seconds, [])
    if not json_path.exists():
        result.scores = failed_run(f"no summary (exit code {rc}{'; ' + why if why else ''})")
        return result
    summary = redoctored(json_path) if redoctor else json.loads(json_path.read_text())
    try:
        own = _read_own(spec, truth_prefix, summary)
    except TruthError as exc:
        result.scores = failed_run(f"own records: {exc} (exit code {rc})")
        return result
    lines = {"checkpoint": script.checkpoint_line, "log": script.log_line}
    if rescore and path.exists():  # the lines of the script the kept run ran: the template may have moved them since
        lines = _lines_in(path.read_text(), script.text, lines)
    result.expectation = expect(spec, own, lines)
    result.scores = score_case(summary, result.expectation, path.name)
    if rc != 0:
        result.notes.append(f"exit code {rc}")
    return result


def _lines_in(kept: str, current: str, lines: dict[str, int | None]) -> dict[str, int | None]:
    """``lines`` of the ``current`` script (1-based) where the same text stands in the ``kept`` one."""
    kept_lines, current_lines = kept.splitlines(), current.splitlines()
    moved = {}
    for name, line in lines.items():
        text = None if line is None else current_lines[line - 1]
        moved[name] = kept_lines.index(text) + 1 if text in kept_lines else line
    return moved


def redoctored(json_path: Path) -> dict[str, Any]:
    """The summary at ``json_path`` with its verdict and fixes made again by this code's doctor, from the lint
    hits and measurements it holds: what a change to the rules would have said on a kept run."""
    from stepscope.doctor.checkup import examine
    from stepscope.doctor.lint import LintHit
    from stepscope.summary import RunSummary

    summary = RunSummary.from_json(json_path)
    examine(summary, [LintHit(**hit) for hit in summary.facts.get("lint", [])])
    return summary.to_dict()


def nominal(spec: CaseSpec, rank: int = 0) -> dict[str, float]:
    """The injected ms per step that the spec asks for, by label (checkpoint and log: not known beforehand)."""
    s = spec.straggler
    extra = s.cost.ms if s is not None and s.cost is not None and s.rank == rank else 0.0
    out: dict[str, float] = {}
    for label, cost, calls in (
        ("forward", spec.forward, spec.accum),
        ("backward", spec.backward, spec.accum),
        ("optimizer", spec.optimizer, 1),
        ("other", spec.other, 1),
    ):
        out[label] = (cost.ms if cost else 0.0) * calls + (extra if s and s.phase == label else 0.0)
    if spec.side:
        out["side"] = spec.side.cost.ms * (spec.accum if spec.side.where == "before" else 1)
    share = 1.0 if spec.fetch == "each" else 1.0 / len(spec.loaders)  # alternate: each loader every n-th batch
    data = sum((ld.cost.ms if ld.cost else 0.0) * spec.accum * share for ld in spec.loaders if ld.workers == 0)
    out["data_wait"] = data + (extra * spec.accum * share if s and s.phase == "data_wait" else 0.0)
    return {k: v for k, v in out.items() if v}


def plain_check(spec: CaseSpec, folder: Path) -> str:
    """Runs the case's script without stepscope (the generator's own check): its own injected costs per step
    against the spec's, and its own step rate."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{spec.case_id}.py"
    path.write_text(write_script(spec).text)
    prefix = folder / f"{spec.case_id}.plain"
    cmd = [sys.executable, str(path), str(prefix)]
    if spec.ranks > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *cmd[1:]]
    env = {**child_env(), "TRUTH_MAX_STEPS": str(spec.warmup + spec.steps)}
    subprocess.run(cmd, cwd=folder, env=env, stdout=subprocess.DEVNULL, check=True, timeout=CASE_TIMEOUT_S)
    lines = []
    paths = [prefix] if spec.ranks == 1 else [Path(f"{prefix}.rank{r}") for r in range(spec.ranks)]
    for rank, p in enumerate(paths):
        own = own_figures(json.loads(p.read_text())["records"], spec.warmup, spec.steps, rank)
        want = nominal(spec, rank)
        got = {k: round(v, 2) for k, v in own.injected.items()}
        phases = {k: round(v, 2) for k, v in own.phases.items()}
        lines.append(f"rank {rank}: injected {got} (spec {want}); phases {phases}; {own.step_rate:.1f} steps/s")
    return "\n".join(lines)


def rerun_command(spec: CaseSpec, args: argparse.Namespace) -> str:
    """The command that runs one case again, alone."""
    if spec.case_id.startswith("ci-"):
        return f"{sys.executable} bench/truth.py --ci --only {spec.case_id}"
    extra = " --load" if args.load else ""
    return (
        f"{sys.executable} bench/truth.py --seed {args.seed} --ranks-share {args.ranks_share}{extra} "
        f"--only {spec.case_id} --out /tmp/truth-{spec.case_id}"
    )


def table(results: list[CaseResult]) -> str:
    """% right per score over the cases where it applies."""
    lines = [f"{'score':<12} {'right':>7} {'n':>4}", "-" * 25]
    for name in SCORES:
        applicable = [r.score(name) for r in results if r.score(name).status != NA]
        right = sum(1 for s in applicable if s.status == RIGHT)
        pct = f"{100 * right / len(applicable):.1f}%" if applicable else "-"
        lines.append(f"{name:<12} {pct:>7} {len(applicable):>4}")
    return "\n".join(lines)


def failures(results: list[CaseResult], args: argparse.Namespace) -> str:
    """Every wrong score: case, blocks, expected against measured, and how to run the case again."""
    out = []
    for r in results:
        wrong = [s for s in r.scores if s.status not in (RIGHT, NA)]
        if not wrong:
            continue
        out.append(f"{r.spec.case_id} ({r.spec.ranks} rank(s), {r.seconds:.1f} s): {r.spec.blocks()}")
        out += [f"  {s.name}: {s.detail}" for s in wrong]
        out.append(f"  rerun: {rerun_command(r.spec, args)}")
        out.append(f"  doctor: (cd {r.folder} && {shlex.join(r.command)})")
    return "\n".join(out)


def _specs(args: argparse.Namespace) -> list[CaseSpec]:
    drawn = (draw_case(args.seed, i, args.ranks_share, args.load) for i in range(args.cases))
    specs = ci_cases() if args.ci else list(drawn)
    if args.rescore and args.out and (args.out / "results.jsonl").exists():
        # the cases as they were run: a block added to the draw since changes some of a seed's cases
        with open(args.out / "results.jsonl") as f:
            kept = {row["case"]: CaseSpec.from_dict(row["spec"]) for row in map(json.loads, f)}
        specs = [kept.get(spec.case_id, spec) for spec in specs]
    if args.only:
        wanted = set(args.only.split(","))
        specs = [s for s in specs if s.case_id in wanted or str(s.index) in wanted]
        if not args.ci and not specs:  # a case past --cases: draw it directly
            specs = [draw_case(args.seed, int(w.lstrip("c")), args.ranks_share, args.load) for w in sorted(wanted)]
    return specs


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", type=int, default=200, help="cases to draw (default 200)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ranks-share", type=float, default=0.15, help="fraction of 2-rank cases (default 0.15)")
    parser.add_argument("--load", action="store_true", help="run every case beside a busy loop on each core")
    parser.add_argument("--out", type=Path, help="keep scripts, summaries and results.jsonl here")
    parser.add_argument("--only", help="comma-separated case ids (c007) or indices")
    parser.add_argument("--jobs", type=int, default=1, help="cases at once (1: others would skew the timings)")
    parser.add_argument("--ci", action="store_true", help="run the CI subset's fixed cases instead")
    parser.add_argument("--rescore", action="store_true", help="score what an earlier run left in --out again")
    parser.add_argument(
        "--redoctor",
        action="store_true",
        help="with --rescore: the kept summaries' verdict and fixes made again by this code's doctor (the same "
        "measurements, the current rules); the files are left as they are",
    )
    parser.add_argument("--plain", action="store_true", help="run the scripts without stepscope: own figures only")
    parser.add_argument("--timeout", type=float, default=CASE_TIMEOUT_S, help="seconds per case")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    specs = _specs(args)
    with contextlib.ExitStack() as stack:
        root = args.out or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="truth-")))
        root.mkdir(parents=True, exist_ok=True)
        if args.plain:
            for spec in specs:
                print(f"{spec.case_id} {spec.blocks()}\n{plain_check(spec, root / spec.case_id)}", flush=True)
            return 0
        results = _run_all(specs, root, args)
        if args.out:
            name = "results.rescored.jsonl" if args.rescore else "results.jsonl"  # keep the run's timings
            with open(root / name, "w") as f:
                f.writelines(json.dumps(r.to_dict()) + "\n" for r in results)
        print(table(results))
        wrong = failures(results, args)
        if wrong:
            print("\nfailures:\n" + wrong)
    return 0


def _run_all(specs: list[CaseSpec], root: Path, args: argparse.Namespace) -> list[CaseResult]:
    """Runs the cases, ``--jobs`` at a time, printing one line per case as it ends."""
    from concurrent.futures import ThreadPoolExecutor

    def one(spec: CaseSpec) -> CaseResult:
        result = run_case(spec, root / spec.case_id, args.timeout, rescore=args.rescore, redoctor=args.redoctor)
        marks = "".join("." if s.status == RIGHT else "-" if s.status == NA else "x" for s in result.scores)
        print(f"{spec.case_id} {marks} {result.seconds:5.1f}s {spec.blocks()}", flush=True)
        return result

    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        return list(pool.map(one, specs))


if __name__ == "__main__":
    sys.exit(main())
