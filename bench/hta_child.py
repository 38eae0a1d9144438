"""Child of bench/hta_reference.py: runs Holistic Trace Analysis on one job and writes its figures as JSON.

Runs inside the HTA venv (HolisticTraceAnalysis==0.5.0, pandas<3), so it imports only the standard library, pandas
and hta. Not part of the stepscope package.

    <venv>/bin/python bench/hta_child.py --trace-dir DIR --out FILE.json

DIR is handed to ``hta.trace_analysis.TraceAnalysis(trace_dir=DIR)`` as it is: HTA picks every ``*.gz`` / ``*.json``
file directly in it and finds each one's rank itself. Every HTA call is made with HTA's defaults except
``visualize=False``; a failing call is recorded as ``"<ErrorType>: <first line of message>"`` and the others go on.
"""

from __future__ import annotations

import argparse
import gzip
import json
import logging
import math
import sys
import time
import warnings
from typing import Any

import pandas as pd


def _num(x: Any, nd: int = 3) -> float | int | None:
    """A plain JSON number: None for NaN/None, ints kept, floats rounded to ``nd`` decimals."""
    if x is None:
        return None
    try:
        f = float(x)
    except (TypeError, ValueError):
        return None
    if math.isnan(f) or math.isinf(f):
        return None
    if f == int(f) and abs(f) < 2**53:
        return int(f)
    return round(f, nd)


def _sig(x: Any, digits: int = 6) -> float | None:
    """Rounded to ``digits`` significant digits (for ratios and percentages)."""
    if x is None:
        return None
    f = float(x)
    if math.isnan(f) or math.isinf(f):
        return None
    return float(f"{f:.{digits}g}")


def _err(e: BaseException) -> str:
    msg = str(e).strip().splitlines()
    return f"{type(e).__name__}: {msg[0][:300] if msg else ''}"


class _Collect(logging.Handler):
    """Keeps HTA's warnings (first line, deduplicated) instead of printing them."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.msgs: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        try:
            line = record.getMessage().strip().splitlines()[0][:200]
        except Exception:
            return
        # Timing chatter ("Parsed ... in 0.12 seconds", "leaving parse_traces duration=...") is not information.
        if " seconds" in line or "duration=" in line:
            return
        if line not in self.msgs:
            self.msgs.append(line)


def _raw_profiler_steps(path: str) -> dict[str, int] | None:
    """ProfilerStep# events in the raw file, by category (what the trace holds before HTA drops anything)."""
    try:
        op = gzip.open if path.endswith(".gz") else open
        with op(path, "rt") as fh:
            d = json.load(fh)
        out: dict[str, int] = {}
        for e in d.get("traceEvents", []) if isinstance(d, dict) else []:
            n = e.get("name")
            if isinstance(n, str) and n.startswith("ProfilerStep") and e.get("ph") == "X":
                c = str(e.get("cat"))
                out[c] = out.get(c, 0) + 1
        return out
    except Exception:
        return None


def _with_only_rank(t: Any, rank: int, fn: Any) -> Any:
    """Run an HTA call that iterates over ``t.traces`` on one rank only (HTA's own code, one rank's data)."""
    saved = t.traces
    t.traces = {rank: saved[rank]}
    try:
        return fn()
    finally:
        t.traces = saved


def _kernel_breakdown(ta: Any) -> dict[str, Any]:
    """get_gpu_kernel_breakdown (HTA defaults: num_kernels=10, duration_ratio=0.8, include_memory_kernels=True)."""
    type_df, all_df = ta.get_gpu_kernel_breakdown(visualize=False)
    total = float(type_df["sum"].sum()) if len(type_df) else 0.0
    types = {}
    for row in type_df.itertuples(index=False):
        types[str(row.kernel_type)] = {
            "us": _num(row.sum),
            "pct": _num(row.percentage, 1),  # HTA's own figure, rounded by HTA to 1 decimal
            "pct_exact": _sig(100.0 * float(row.sum) / total) if total else None,
        }
    rows = all_df[all_df["name"].ne("others")].sort_values("sum (us)", ascending=False).head(10)
    top = [
        {"name": str(r["name"])[:200], "kernel_type": str(r["kernel_type"]), "sum_us": _num(r["sum (us)"])}
        for _, r in rows.iterrows()
    ]
    others = {str(r["kernel_type"]): _num(r["sum (us)"]) for _, r in all_df[all_df["name"].eq("others")].iterrows()}
    n_named = {str(k): int(v) for k, v in all_df[all_df["name"].ne("others")].groupby("kernel_type").size().items()}
    return {"kernel_types": types, "top_kernels": top, "others_us": others, "named_kernels_per_type": n_named}


def _idle_breakdown(ta: Any, rank: int) -> dict[str, Any]:
    """get_idle_time_breakdown for one rank: HTA's per-stream rows and a rank-level sum over streams."""
    df, _ = ta.get_idle_time_breakdown(ranks=[rank], visualize=False)
    streams: dict[str, dict[str, Any]] = {}
    totals: dict[str, float] = {"host_wait": 0.0, "kernel_wait": 0.0, "other": 0.0}
    for r in df.itertuples(index=False):
        s = streams.setdefault(str(int(r.stream)), {})
        s[str(r.idle_category)] = {"us": _num(r.idle_time, 2), "ratio": _num(r.idle_time_ratio, 2)}
        totals[str(r.idle_category)] = totals.get(str(r.idle_category), 0.0) + float(r.idle_time)
    for s in streams.values():
        tot = sum(float(v["us"] or 0) for v in s.values())
        for v in s.values():
            v["pct"] = _sig(100.0 * float(v["us"] or 0) / tot) if tot else None
    grand = sum(totals.values())
    rank_level = {k: {"us": _num(v, 2), "pct": _sig(100.0 * v / grand) if grand else None} for k, v in totals.items()}
    return {"streams": streams, "rank_sum_over_streams": rank_level, "total_idle_us_sum_over_streams": _num(grand, 2)}


def _info(ta: Any, rank: int) -> dict[str, Any]:
    """Facts about a rank's data after HTA's load (alignment and last-step trimming)."""
    t = ta.t
    df = t.traces[rank]
    sym = t.symbol_table.get_sym_table()
    ids = t.symbol_table.get_sym_id_map()
    step_ids = {v for k, v in ids.items() if "ProfilerStep" in k}
    out: dict[str, Any] = {}
    gpu = df[df["stream"].ne(-1)]  # what the temporal breakdown / overlap / kernel breakdown use
    out["gpu_events_stream_ne_-1"] = len(gpu)
    if len(gpu):
        first = float(gpu["ts"].min())
        last = float((gpu["ts"] + gpu["dur"]).max())
        out["first_kernel_ts_us"] = _num(first + float(t.min_ts))
        out["last_kernel_end_us"] = _num(last + float(t.min_ts))
        out["kernel_span_us"] = _num(last - first)
        cats = gpu["cat"].map(lambda i: sym[i]).value_counts()
        out["gpu_event_cats"] = {str(k): int(v) for k, v in cats.items()}
        out["streams"] = sorted(int(s) for s in gpu["stream"].unique())
    cpu_steps = df[df["name"].isin(step_ids) & df["stream"].eq(-1)]
    out["profiler_steps_after_load"] = len(cpu_steps)
    out["profiler_step_names_in_symbol_table"] = len(step_ids)
    out["duplicate_rows"] = int(df.index.duplicated().sum())
    meta = t.meta_data.get(rank, {})
    di = meta.get("distributedInfo") if isinstance(meta, dict) else None
    out["distributedInfo_rank"] = di.get("rank") if isinstance(di, dict) else None
    devs = meta.get("deviceProperties") if isinstance(meta, dict) else None
    out["device_names"] = sorted({str(d.get("name")) for d in devs if isinstance(d, dict)}) if devs else []
    out["displayTimeUnit"] = meta.get("displayTimeUnit") if isinstance(meta, dict) else None
    out["ts_dtype"] = str(df["ts"].dtype)
    return out


def run(trace_dir: str) -> dict[str, Any]:
    coll = _Collect()
    log = logging.getLogger("hta")
    log.handlers = [coll]
    log.setLevel(logging.WARNING)
    log.propagate = False
    warnings.simplefilter("ignore")  # pandas FutureWarnings from inside HTA

    import hta
    from hta.trace_analysis import TraceAnalysis

    res: dict[str, Any] = {"ranks": {}, "errors": {}, "load_s": None}
    t0 = time.perf_counter()
    try:
        ta = TraceAnalysis(trace_dir=trace_dir)
    except BaseException as e:  # HTA raises many types on bad input (KeyError, AttributeError, AssertionError, ...)
        res["load_s"] = round(time.perf_counter() - t0, 3)
        res["errors"]["load"] = _err(e)
        res["hta_warnings"] = coll.msgs[:12]
        return res
    res["load_s"] = round(time.perf_counter() - t0, 3)
    ranks = sorted(ta.t.traces.keys())
    res["rank_files"] = {str(r): ta.t.trace_files[r].rsplit("/", 1)[-1] for r in ranks}
    res["trimmed_last_step"] = (
        len({v for k, v in ta.t.symbol_table.get_sym_id_map().items() if "ProfilerStep" in k}) > 1
    )
    res["hta_version"] = getattr(hta, "__version__", None)
    res["ns_rounding_applied"] = any(m.startswith("Rounding down ns resolution") for m in coll.msgs)
    rk: dict[str, dict[str, Any]] = {str(r): {} for r in ranks}

    for r in ranks:
        rk[str(r)]["raw_profiler_steps"] = _raw_profiler_steps(ta.t.trace_files[r])
        try:
            rk[str(r)].update(_info(ta, r))
        except BaseException as e:
            res["errors"][f"info@rank{r}"] = _err(e)

    def call(name: str, fn: Any) -> Any:
        try:
            return fn()
        except BaseException as e:
            res["errors"][name] = _err(e)
            return None

    # Temporal breakdown: one call over all ranks, as HTA is used; fall back to one rank at a time on failure.
    tb = call("get_temporal_breakdown", lambda: ta.get_temporal_breakdown(visualize=False))
    if tb is None and len(ranks) > 1:
        frames = []
        for r in ranks:
            f = call(
                f"get_temporal_breakdown@rank{r}",
                lambda r=r: _with_only_rank(ta.t, r, lambda: ta.get_temporal_breakdown(visualize=False)),
            )
            if f is not None:
                frames.append(f)
        tb = pd.concat(frames) if frames else None
    if tb is not None:
        for row in tb.to_dict("records"):
            rk[str(int(row["rank"]))]["temporal"] = {
                "idle_us": _num(row["idle_time(us)"]),
                "compute_us": _num(row["compute_time(us)"]),
                "non_compute_us": _num(row["non_compute_time(us)"]),
                "kernel_time_us": _num(row["kernel_time(us)"]),
                "idle_pct": _num(row["idle_time_pctg"], 2),
                "compute_pct": _num(row["compute_time_pctg"], 2),
                "non_compute_pct": _num(row["non_compute_time_pctg"], 2),
            }

    for r in ranks:
        ib = call(f"get_idle_time_breakdown@rank{r}", lambda r=r: _idle_breakdown(ta, r))
        if ib is not None:
            rk[str(r)]["idle_breakdown"] = ib

    ov = call("get_comm_comp_overlap", lambda: ta.get_comm_comp_overlap(visualize=False))
    if ov is None and len(ranks) > 1:
        frames = []
        for r in ranks:
            f = call(
                f"get_comm_comp_overlap@rank{r}",
                lambda r=r: _with_only_rank(ta.t, r, lambda: ta.get_comm_comp_overlap(visualize=False)),
            )
            if f is not None:
                frames.append(f)
        ov = pd.concat(frames) if frames else None
    if ov is not None:
        for row in ov.to_dict("records"):
            rk[str(int(row["rank"]))]["comm_comp_overlap_pct"] = _num(row["comp_comm_overlap_pctg"], 2)

    # Kernel breakdown: HTA sums the kernel-type shares over all ranks; run it on each rank alone for per-rank figures.
    for r in ranks:
        kb = call(
            f"get_gpu_kernel_breakdown@rank{r}", lambda r=r: _with_only_rank(ta.t, r, lambda: _kernel_breakdown(ta))
        )
        if kb is not None:
            rk[str(r)]["kernel_breakdown"] = kb
    if len(ranks) > 1:
        kb_all = call("get_gpu_kernel_breakdown", lambda: _kernel_breakdown(ta))
        if kb_all is not None:
            res["kernel_types_all_ranks"] = kb_all["kernel_types"]

    res["ranks"] = rk
    res["hta_warnings"] = coll.msgs[:12]
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace-dir", required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    try:
        res = run(a.trace_dir)
    except BaseException as e:  # never leave the parent without an answer
        res = {"ranks": {}, "errors": {"child": _err(e)}, "load_s": None}
    with open(a.out, "w") as fh:
        json.dump(res, fh, indent=1, allow_nan=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
