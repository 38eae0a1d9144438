"""Does `stepscope tune` find what works? Two scripts with known answers, on the machine as it is (these need
free cores: a benchmark, not a test; the suite checks the search on a model and on a sleep-based script).

- cpu_loader: tests/scripts/contention_loader.py, a loader that burns 0.5 ms of CPU per sample, without workers,
  beside torch's default intra-op threads (one per core). On 2 cores one worker is slower and the doctor's advice
  alone does not help; tune must find a combination >= 1.2x with its 95% interval above 1.1.
- three: bench/workloads/three_slowdowns.py, with anomaly mode left on, Adam looping over 300 tensors and a
  loader without workers over 1 ms reads. Tune must keep each setting that measurably helps (debug.anomaly, the
  optimizer's kernels, workers), and its speedup must be within 10% of the same settings applied by hand in an
  A/B (`stepscope ab`, 3 runs a side).

    python bench/tune.py [--case cpu_loader|three] [--budget-s 600] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CASES = {
    "cpu_loader": [str(ROOT / "tests" / "scripts" / "contention_loader.py")],
    "three": [str(ROOT / "bench" / "workloads" / "three_slowdowns.py")],
}
STEPS, WARMUP, REPEATS = "60", "10", "3"


def tune(command: list[str], budget_s: float, folder: Path) -> tuple[dict, float, str]:
    out = folder / "tune.json"
    cmd = [sys.executable, "-m", "stepscope.cli", "tune", "--json", str(out), "--budget-s", str(budget_s)]
    cmd += ["--steps", STEPS, "--warmup", WARMUP, "--repeats", REPEATS, *command]
    started = time.perf_counter()
    done = subprocess.run(cmd, cwd=folder, capture_output=True, text=True, timeout=budget_s * 2 + 300)
    wall_s = time.perf_counter() - started
    if done.returncode != 0 or not out.exists():
        raise RuntimeError(f"tune exited {done.returncode}: {done.stderr[-1500:]}")
    return json.loads(out.read_text()), wall_s, done.stdout


def by_hand(command: list[str], apply: list[str], folder: Path) -> dict:
    """The best settings applied by hand: baseline against them in an A/B of 3 runs a side."""
    out = folder / "ab.json"
    script = " ".join(command)
    tuned = " ".join(f"--apply {a}" for a in apply)
    cmd = [sys.executable, "-m", "stepscope.cli", "ab", "--json", str(out), "--repeats", REPEATS, "--steps", STEPS]
    cmd += ["--warmup", WARMUP, "--variant", f"base={script}", "--variant", f"tuned={tuned} {script}"]
    done = subprocess.run(cmd, cwd=folder, capture_output=True, text=True, timeout=1800)
    if not out.exists():
        raise RuntimeError(f"ab exited {done.returncode}: {done.stderr[-1500:]}")
    return json.loads(out.read_text())["comparison"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", choices=sorted(CASES), action="append")
    parser.add_argument("--budget-s", type=float, default=600.0)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    print(f"# {platform.node()} · {os.cpu_count()} cores · load {os.getloadavg()[0]:.1f} · {time.strftime('%F')}")
    results, right = {}, True
    for name in args.case or sorted(CASES):
        with tempfile.TemporaryDirectory() as tmp:
            data, wall_s, stdout = tune(CASES[name], args.budget_s, Path(tmp))
            best = data["best"]
            print(f"\n## {name}: {wall_s:.0f} s (budget {args.budget_s:g} s)\n{stdout}")
            result = {"wall_s": round(wall_s), "best": best, "trials": len(data["trials"])}
            if name == "cpu_loader":
                ok = (best["speedup"] or 0) >= 1.2 and (best["ci_low"] or 0) > 1.1
            else:
                hand = by_hand(CASES[name], best["apply"], Path(tmp))
                result["by_hand"] = {"speedup": hand["speedup"], "ci": hand["speedup_ci"]}
                found = " ".join(best["apply"])
                kinds = ("debug.anomaly", "optimizer.", "loader.num_workers")
                ok = all(kind in found for kind in kinds) and abs(best["speedup"] / hand["speedup"] - 1) <= 0.10
                low, high = hand["speedup_ci"]
                print(f"by hand: {hand['speedup']:.2f}x (95% CI {low:.2f}-{high:.2f})")
            ok = ok and wall_s <= args.budget_s * 1.1
            print(f"{name}: {'right' if ok else 'WRONG'}")
            result["right"] = ok
            results[name] = result
            right = right and ok
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0 if right else 1


if __name__ == "__main__":
    sys.exit(main())
