"""Does `stepscope doctor --verify` measure CPU-bound fixes as faster? (The suite's sleep-based verify tests check the
logic; these fixes need free cores, so they are a benchmark.)

Ground truth: tests/scripts/doctor_optimizer.py updates 600 small Adam parameters one by one (foreach=False), so the
fused or foreach kernel is faster; tests/scripts/doctor_anomaly.py leaves anomaly mode on, so turning it off is faster.
Each script is diagnosed and its top fixes verified with interleaved runs (`--verify N`, 3 runs a side); the
measured speedup, its 95% interval and the verdict of each verified fix are printed, and whether the expected fix
was verified faster and ranked first.

    python bench/verify_cpu.py [--verify 2] [--steps 15] [--warmup 3] [--json out.json]
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

SCRIPTS = Path(__file__).resolve().parent.parent / "tests" / "scripts"
CASES = {
    "doctor_optimizer.py": ("optimizer.fused", "optimizer.foreach"),
    "doctor_anomaly.py": ("debug.anomaly",),
}


def verify_case(name: str, expected: tuple[str, ...], verify: int, steps: int, warmup: int) -> dict:
    """Run `stepscope doctor --verify` on one script; its verified fixes and whether the expected one came first."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "s.json"
        cmd = [sys.executable, "-m", "stepscope.cli", "doctor", "--json", str(out), "--ceiling-batches", "0"]
        cmd += ["--verify", str(verify), "--warmup", str(warmup), "--steps", str(steps), str(SCRIPTS / name)]
        started = time.perf_counter()
        done = subprocess.run(cmd, cwd=tmp, capture_output=True, text=True, timeout=900)
        wall_s = time.perf_counter() - started
        if done.returncode != 0 or not out.exists():
            return {"script": name, "error": f"exit {done.returncode}: {done.stderr.strip()[-400:]}"}
        summary = json.loads(out.read_text())
    fixes = summary.get("fixes") or []
    verified = {f["id"]: f["measured"] for f in fixes if f.get("measured")}
    first = fixes[0]["id"] if fixes else None
    hits = [fix_id for fix_id in expected if fix_id in verified]
    right = bool(hits) and all(verified[h]["verdict"] == "faster" for h in hits) and first in hits
    return {"script": name, "wall_s": round(wall_s, 1), "first": first, "verified": verified, "right": right}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--verify", type=int, default=2, help="fixes to verify per script (default 2)")
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    load = os.getloadavg()[0]
    print(f"# {platform.node()} · {os.cpu_count()} cores · load {load:.1f} · Python {platform.python_version()}")
    results = []
    for name, expected in CASES.items():
        result = verify_case(name, expected, args.verify, args.steps, args.warmup)
        results.append(result)
        if "error" in result:
            print(f"{name}: {result['error']}")
            continue
        print(f"{name} ({result['wall_s']} s): first fix {result['first']}; {'right' if result['right'] else 'WRONG'}")
        for fix_id, m in result["verified"].items():
            low, high = m.get("ci_low"), m.get("ci_high")
            interval = f" ({low:.2f}-{high:.2f})" if low is not None and high is not None else ""
            print(f"  {fix_id}: {m['speedup']:.2f}x{interval} {m['verdict']}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0 if all(r.get("right") for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
