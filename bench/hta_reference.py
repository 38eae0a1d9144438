"""Reference figures from Holistic Trace Analysis (HTA 0.5.0) for every real trace in tests/data/traces/hta.

stepscope's own Kineto trace analyser is checked against these numbers (agreement within 0.5 percentage points).
HTA runs in a venv of its own (it needs neither torch nor stepscope), one child process per job
(bench/hta_child.py), so that a crash or a hang on bad input costs only that job.

    python bench/hta_reference.py [--venv PATH] [--out PATH] [--traces DIR] [--only SUBSTR] [--timeout-s 900]

Jobs: every file under --traces alone (symlinked into a temp folder of its own, since HTA takes a trace folder),
and every folder that directly holds more than one file, as HTA would see the job (HTA loads every *.gz / *.json
in the folder, one rank each). Output (--out, default tests/data/hta_reference.json): hta_version, pandas_version,
generated, machine, and `traces`, keyed by the path relative to the parent of --traces →
{"ranks": {"<rank>": {...}}, "errors": {call: "Type: first line"}, "load_s": s, ...}. Per rank: `temporal`
(get_temporal_breakdown), `idle_breakdown` (get_idle_time_breakdown, per stream and summed over streams),
`comm_comp_overlap_pct` (get_comm_comp_overlap), `kernel_breakdown` (get_gpu_kernel_breakdown on that rank alone),
and facts about the loaded data (kernel span after HTA's trimming, ProfilerStep counts, devices).
The definitions behind these numbers are documented in .scratch/hta_definitions.md (not in the repo).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
HTA_SPEC = ["HolisticTraceAnalysis==0.5.0", "pandas<3"]
CHILD = Path(__file__).resolve().parent / "hta_child.py"


def _default_traces() -> Path:
    return REPO / "tests" / "data" / "traces" / "hta"  # HTA's test traces, kept in the repository


def ensure_venv(venv: Path) -> Path:
    """The HTA venv's python, creating the venv and installing HTA when missing."""
    py = venv / "bin" / "python"
    if py.exists():
        ok = subprocess.run(
            [str(py), "-c", "import hta, pandas; assert hta.__version__ == '0.5.0' and int(pandas.__version__[0]) < 3"],
            capture_output=True,
        )
        if ok.returncode == 0:
            return py
    else:
        print(f"creating {venv}", file=sys.stderr)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    print(f"installing {' '.join(HTA_SPEC)} into {venv}", file=sys.stderr)
    subprocess.run([str(py), "-m", "pip", "install", "-q", *HTA_SPEC], check=True)
    return py


def venv_versions(py: Path) -> tuple[str, str]:
    out = subprocess.run(
        [str(py), "-c", "import hta, pandas; print(hta.__version__); print(pandas.__version__)"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    return out[0], out[1]


def find_jobs(traces: Path) -> list[tuple[str, str, list[Path]]]:
    """(key, kind, files): each file alone, then each folder directly holding more than one file."""
    base = traces.parent
    jobs: list[tuple[str, str, list[Path]]] = []
    folders: list[tuple[str, str, list[Path]]] = []
    for root, dirs, files in os.walk(traces):
        dirs.sort()
        fs = sorted(Path(root) / f for f in files if not f.startswith("."))
        for f in fs:
            jobs.append((str(f.relative_to(base)), "file", [f]))
        if len(fs) > 1:
            folders.append((str(Path(root).relative_to(base)), "folder", fs))
    return sorted(jobs) + sorted(folders)


def run_job(py: Path, kind: str, files: list[Path], timeout_s: float) -> dict:
    with tempfile.TemporaryDirectory(prefix="hta_ref_") as tmp:
        if kind == "file":
            trace_dir = Path(tmp) / "trace"
            trace_dir.mkdir()
            (trace_dir / files[0].name).symlink_to(files[0])
        else:
            trace_dir = files[0].parent  # HTA only reads it
        out = Path(tmp) / "result.json"
        t0 = time.perf_counter()
        try:
            p = subprocess.run(
                [str(py), str(CHILD), "--trace-dir", str(trace_dir), "--out", str(out)],
                capture_output=True,
                text=True,
                timeout=timeout_s,
                cwd=tmp,  # HTA also reads ./trace_analyzer.json; keep the repo's cwd out of it
            )
        except subprocess.TimeoutExpired:
            return {"ranks": {}, "errors": {"child": f"TimeoutExpired: over {timeout_s:.0f} s"}, "load_s": None}
        wall = time.perf_counter() - t0
        if not out.exists():
            tail = (p.stderr or "").strip().splitlines()[-1:] or [""]
            return {"ranks": {}, "errors": {"child": f"exit {p.returncode}: {tail[0][:300]}"}, "load_s": None}
        res = json.loads(out.read_text())
        res["child_wall_s"] = round(wall, 2)
        return res


def machine() -> dict:
    info = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "processor": platform.processor() or platform.machine(),
    }
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["processor"] = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return info


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--venv", type=Path, default=REPO / ".venv-hta")
    ap.add_argument("--out", type=Path, default=REPO / "tests" / "data" / "hta_reference.json")
    ap.add_argument("--traces", type=Path, default=_default_traces())
    ap.add_argument("--only", default="", help="run only the jobs whose key contains this")
    ap.add_argument("--timeout-s", type=float, default=900.0, help="per job")
    a = ap.parse_args()

    traces = a.traces.resolve()
    if not traces.is_dir():
        print(f"no trace folder at {traces}", file=sys.stderr)
        return 2
    py = ensure_venv(a.venv.absolute())
    hta_version, pandas_version = venv_versions(py)

    jobs = [j for j in find_jobs(traces) if a.only in j[0]]
    results: dict[str, dict] = {}
    for i, (key, kind, files) in enumerate(jobs, 1):
        res = run_job(py, kind, files, a.timeout_s)
        res = {"kind": kind, **res}
        if kind == "folder":
            res["files"] = [f.name for f in files]
        results[key] = res
        errs = res.get("errors", {})
        print(
            f"[{i}/{len(jobs)}] {key}: ranks={list(res.get('ranks', {}))} load_s={res.get('load_s')} "
            f"errors={len(errs)}{' ' + next(iter(errs.values()))[:80] if errs else ''}",
            file=sys.stderr,
        )

    doc = {
        "hta_version": hta_version,
        "pandas_version": pandas_version,
        "generated": datetime.date.today().isoformat(),
        "machine": machine(),
        "traces_root": str(traces.parent),
        "notes": (
            "HTA 0.5.0 with its defaults, visualize=False. Percentages are HTA's (rounded by HTA: temporal and overlap "
            "to 2 decimals, kernel types to 1, idle ratio to 2 decimals of a ratio); *_exact / idle 'pct' are "
            "recomputed from HTA's times. Times in us. See bench/hta_reference.py."
        ),
        "traces": results,
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(doc, indent=1, allow_nan=False) + "\n")
    print(f"wrote {a.out} ({len(results)} jobs)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
