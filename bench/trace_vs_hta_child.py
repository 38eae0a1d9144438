"""Child of bench/trace_vs_hta.py: the HTA side of the benchmark, run in the HTA venv (stdlib, pandas and hta only).

Does exactly the work being timed, with HTA's defaults except ``visualize=False``: ``TraceAnalysis(trace_dir=DIR)``,
``get_temporal_breakdown``, ``get_idle_time_breakdown`` for each rank, ``get_comm_comp_overlap`` and
``get_gpu_kernel_breakdown``; then writes the per-rank figures that the parent compares with stepscope's.

    <venv>/bin/python bench/trace_vs_hta_child.py --trace-dir DIR --out FILE.json

A failing call is recorded as ``"<ErrorType>: <first line>"`` and the others go on (a MemoryError under the
parent's address-space cap included).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import time
import warnings
from typing import Any


def _num(x: Any) -> float | None:
    """A plain JSON float, None for NaN/inf/None."""
    try:
        f = float(x)
    except (TypeError, ValueError):
        return None
    return None if math.isnan(f) or math.isinf(f) else f


def _err(e: BaseException) -> str:
    """``Type: first line of the message``."""
    msg = str(e).strip().splitlines()
    return f"{type(e).__name__}: {msg[0][:300] if msg else ''}"


def run(trace_dir: str) -> dict[str, Any]:
    """Run the timed HTA calls on one trace folder; per-rank figures and errors."""
    logging.getLogger("hta").setLevel(logging.ERROR)  # HTA logs a timing line per file at INFO/WARNING
    warnings.simplefilter("ignore")  # pandas FutureWarnings from inside HTA
    t0 = time.perf_counter()
    from hta.trace_analysis import TraceAnalysis

    res: dict[str, Any] = {"ranks": {}, "errors": {}, "import_s": round(time.perf_counter() - t0, 3)}
    t0 = time.perf_counter()
    try:
        ta = TraceAnalysis(trace_dir=trace_dir)
    except BaseException as e:
        res["errors"]["load"] = _err(e)
        return res
    res["load_s"] = round(time.perf_counter() - t0, 3)
    ranks = sorted(ta.t.traces.keys())
    rk: dict[str, dict[str, Any]] = {str(r): {} for r in ranks}

    def call(name: str, fn: Any) -> Any:
        try:
            return fn()
        except BaseException as e:
            res["errors"][name] = _err(e)
            return None

    t0 = time.perf_counter()
    tb = call("get_temporal_breakdown", lambda: ta.get_temporal_breakdown(visualize=False))
    if tb is not None:
        for row in tb.to_dict("records"):
            rk[str(int(row["rank"]))].update(
                idle_pct=_num(row["idle_time_pctg"]),
                compute_pct=_num(row["compute_time_pctg"]),
                non_compute_pct=_num(row["non_compute_time_pctg"]),
            )
    for r in ranks:
        call(f"get_idle_time_breakdown@rank{r}", lambda r=r: ta.get_idle_time_breakdown(ranks=[r], visualize=False))
    ov = call("get_comm_comp_overlap", lambda: ta.get_comm_comp_overlap(visualize=False))
    if ov is not None:
        for row in ov.to_dict("records"):
            rk[str(int(row["rank"]))]["overlap_pct"] = _num(row["comp_comm_overlap_pctg"])
    call("get_gpu_kernel_breakdown", lambda: ta.get_gpu_kernel_breakdown(visualize=False))
    res["analyses_s"] = round(time.perf_counter() - t0, 3)
    res["ranks"] = rk
    return res


def main() -> int:
    """Parse arguments, run, write the JSON (always, so the parent gets an answer)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace-dir", required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    try:
        res = run(a.trace_dir)
    except BaseException as e:
        res = {"ranks": {}, "errors": {"child": _err(e)}}
    with open(a.out, "w") as fh:
        json.dump(res, fh, allow_nan=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
