"""Helpers for the end-to-end tests of ``stepscope run``: launch it as a subprocess, read back its summary."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from stepscope.invariants import broken
from stepscope.summary import RunSummary

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
SRC = REPO / "src"
SCRIPTS = TESTS / "scripts"

# Every phase the run command may time on its own; `total` is the whole step.
PHASES = ("data_wait", "h2d", "forward", "backward", "comms", "clip", "optimizer", "zero_grad", "sync", "other")
OWN_PHASE = "stepscope"  # stepscope's own time outside the phases (record.OWN_PHASE)


def run_env(extra: dict[str, str] | None = None, pythonpath: tuple[str, ...] = ()) -> dict[str, str]:
    """The current environment with stepscope importable (then ``pythonpath``), one thread per process, and no
    STEPSCOPE/CI overrides."""
    env = dict(os.environ)
    env.pop("STEPSCOPE", None)
    env.pop("CI", None)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(SRC), *pythonpath, env.get("PYTHONPATH", "")) if p)
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    if extra:
        env.update(extra)
    return env


def stepscope_cmd(
    json_path: Path | None, *args: str, warmup: int | None = 3, steps: int | None = 20, verb: str = "run"
) -> list[str]:
    """``python -m stepscope.cli VERB [--warmup W] [--steps S] [--json PATH] ARGS...`` (VERB: run or doctor)."""
    cmd = [sys.executable, "-m", "stepscope.cli", verb]
    if warmup is not None:
        cmd += ["--warmup", str(warmup)]
    if steps is not None:
        cmd += ["--steps", str(steps)]
    if json_path is not None:
        cmd += ["--json", str(json_path)]
    return [*cmd, *args]


def script(name: str) -> str:
    return str(SCRIPTS / name)


@dataclass
class RunResult:
    cmd: list[str]
    returncode: int
    stdout: str
    stderr: str
    json_path: Path

    @property
    def summary(self) -> RunSummary:
        assert self.json_path.exists(), f"no summary written at {self.json_path}\n{self.describe()}"
        return RunSummary.from_json(self.json_path)

    def describe(self) -> str:
        """Everything needed to understand a failure, for assertion messages."""
        return (
            f"command: {' '.join(self.cmd)}\nexit code: {self.returncode}\n"
            f"--- stdout ---\n{self.stdout[-6000:]}\n--- stderr ---\n{self.stderr[-6000:]}"
        )


def stepscope_run(
    tmp_path: Path,
    *args: str,
    warmup: int | None = 3,
    steps: int | None = 20,
    cwd: Path | None = None,
    timeout: float = 120,
    env: dict[str, str] | None = None,
    pythonpath: tuple[str, ...] = (),
    verb: str = "run",
) -> RunResult:
    """Run ``stepscope run`` (or ``doctor``) to completion with ``--json tmp_path/s.json``."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    json_path = tmp_path / "s.json"
    cmd = stepscope_cmd(json_path, *args, warmup=warmup, steps=steps, verb=verb)
    proc = subprocess.run(
        cmd,
        cwd=cwd or tmp_path,
        env=run_env(env, pythonpath),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return RunResult(cmd, proc.returncode, proc.stdout, proc.stderr, json_path)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(nproc: int = 2) -> list[str]:
    """The command prefix of a one-machine torchrun with ``nproc`` processes on a free local port."""
    return [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(nproc),
        "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
    ]  # fmt: skip


def line_starting(text: str, word: str) -> str | None:
    """The first line whose first whitespace-separated field is ``word`` (None when there is none)."""
    for line in text.splitlines():
        if line.split()[:1] == [word]:
            return line
    return None


def check_consistent(summary: RunSummary, result: RunResult | None = None) -> None:
    """Invariants every single-rank summary with measured steps must hold (the product's own, and these)."""
    msg = result.describe() if result is not None else ""
    assert broken(summary) == [], f"{broken(summary)}\n{msg}"
    phases = summary.phases
    assert "total" in phases, msg
    assert phases["total"].share == 1.0 or abs(phases["total"].share - 1.0) < 1e-9, msg
    shares = sum(p.share for name, p in phases.items() if name != "total" and not p.nested)
    assert abs(shares - 1.0) < 0.02, f"phase shares sum to {shares:.4f}, not ~1 (exclusive time): {phases}\n{msg}"
    for name, stats in phases.items():
        assert stats.mean_ms >= 0, (name, stats)
        assert stats.steps >= 1, f"phase {name} is listed but ran in no measured step\n{msg}"
        assert name in PHASES or name in ("total", OWN_PHASE), f"unexpected phase name {name!r}\n{msg}"
    assert phases["total"].steps == summary.steps.measured, msg
    mean_sum = sum(p.mean_ms * p.steps for n, p in phases.items() if n != "total") / phases["total"].steps
    assert abs(mean_sum - phases["total"].mean_ms) <= 0.02 * phases["total"].mean_ms + 0.01, (
        f"exclusive phase times add up to {mean_sum:.3f} ms per step, step is {phases['total'].mean_ms:.3f} ms\n{msg}"
    )
    assert summary.verdict.bound in {"data", "compute", "comms", "optimizer", "host", "balanced", "unknown"}, msg
    assert summary.verdict.confidence in {"high", "medium", "low"}, msg
