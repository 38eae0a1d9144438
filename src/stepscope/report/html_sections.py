"""The sections of the HTML report, one function each: a RunSummary in, an HTML ``<section>`` out ("" when the
summary carries nothing for it). All text from the run goes through ``esc``; charts come from ``report.svg``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from stepscope.analyses.loader import LoaderSettings
from stepscope.doctor.verdict import late_rank_lines
from stepscope.record import TOTAL
from stepscope.report.svg import bars, esc, fmt_number, line_chart, stacked_bars
from stepscope.report.terminal import (
    applied_line,
    exit_line,
    gain_text,
    measured_text,
    rank_list,
    shown_ranks,
    split_contention,
    wall_line,
)
from stepscope.summary import Fix, RunSummary

# What each verdict means for the person reading it (the vocabulary of DESIGN.md and docs/doctor.md).
MEANING = {
    "data": "The step waits for its input: the data loader (or the copy to the device) is the bottleneck.",
    "compute": "The model's own work (forward and backward) takes most of the step.",
    "optimizer": "The optimizer step (with gradient clipping and zeroing) takes most of the step.",
    "host": "Python, kernel launches or host-device syncs hold the step back: the device waits on the host.",
    "comms": "Communication between ranks takes most of the step.",
    "memory": "Memory pressure: the CUDA allocator keeps flushing its cache (each flush a device sync).",
    "inference": "In the pipeline, the inference side (the producer) limits the throughput.",
    "training": "In the pipeline, the training side (the consumer) limits the throughput.",
    "balanced": "No single part of the step dominates: there is no one thing to fix first.",
    "unknown": "The measurements are too thin for a verdict.",
}
# One colour per canonical phase, the same in every chart; custom phases take the extra ones in turn.
PHASE_COLORS = {
    "data_wait": "#f28e2b", "h2d": "#edc948", "forward": "#4e79a7", "backward": "#76b7b2", "clip": "#b07aa1",
    "optimizer": "#59a14f", "zero_grad": "#9c755f", "sync": "#e15759", "other": "#bab0ac", "stepscope": "#79706e",
}  # fmt: skip
EXTRA_COLORS = ("#ff9da7", "#86bcb6", "#d37295", "#a0cbe8", "#8cd17d", "#f1ce63")
ABNORMAL_EXITS = ("error", "killed", "terminated", "interrupted")
STEP_TIME_CAP = 2.0  # warm-up steps slower than this × the slowest measured point are drawn at the top edge


def verdict(summary: RunSummary) -> str:
    """The bound with its confidence, what it means, its evidence, the straggler, and the headline figures."""
    v = summary.verdict
    parts = [
        f'<div class="verdict-line"><span class="bound bound-{esc(v.bound)}">{esc(v.bound)}</span>'
        f'<span class="confidence">confidence {esc(v.confidence)}</span></div>',
        f'<p class="meaning">{esc(MEANING.get(v.bound, ""))}</p>',
    ]
    contention, evidence = split_contention(v.evidence)
    if contention:
        parts.append(f'<p class="warn contention">The machine is oversubscribed: {esc(contention)}</p>')
    if evidence:
        parts.append(_list(evidence))
    straggler = summary.cluster.straggler if summary.cluster else None
    if straggler:
        parts.append(
            f"<p>Straggler: rank {straggler.rank}{esc(f' on {straggler.node}' if straggler.node else '')}, "
            f"{esc(straggler.phase)} {straggler.excess_ms:+.1f} ms over the median of the other ranks.</p>"
        )
    if summary.exit and summary.exit.reason in ABNORMAL_EXITS:
        parts.append(f'<p class="warn">{esc(exit_line(summary))}.</p>')
    if not summary.fixes:
        parts.append('<p class="caption">No ranked fixes here: <code>stepscope doctor</code> ranks them.</p>')
    parts.append(_figures(summary))
    return _section("verdict", "Verdict", "".join(parts))


def _figures(summary: RunSummary) -> str:
    t = summary.throughput
    cards: list[tuple[str, str]] = []
    if t.step_time_ms is not None:
        cards.append((f"{fmt_number(t.step_time_ms)} ms", "mean step time"))
    if t.steps_per_s is not None:
        cards.append((fmt_number(t.steps_per_s), "steps/s"))
    if t.samples_per_s is not None:
        cards.append((fmt_number(t.samples_per_s), "samples/s" + (", all ranks" if summary.ranks else "")))
    if wall_line(summary) is not None:  # the wall rate differs: validation passes or time between steps
        rate = t.wall_samples_per_s if t.wall_samples_per_s is not None else t.wall_steps_per_s
        unit = "samples/s" if t.wall_samples_per_s is not None else "steps/s"
        cards.append((fmt_number(rate), f"{unit} over the wall window (validation included)"))
    if t.tflops is not None:
        achieved = f"{fmt_number(t.tflops)} TFLOP/s" if t.tflops >= 1 else f"{fmt_number(t.tflops * 1e3)} GFLOP/s"
        cards.append((achieved, "model FLOPs achieved"))
    if t.mfu is not None:
        cards.append((f"{100 * t.mfu:.1f}%", f"MFU of {t.mfu_peak or 'the peak'}"))
    steps = summary.steps
    cards.append((str(steps.measured), f"measured steps ({steps.warmup} warm-up)"))
    if summary.ranks:
        cards.append((str(len(summary.ranks)), "ranks reported"))
    items = "".join(f'<div class="figure"><b>{esc(value)}</b><span>{esc(label)}</span></div>' for value, label in cards)
    return f'<div class="figures">{items}</div>'


def fixes(summary: RunSummary) -> str:
    """The ranked fixes: cost, gain bound, why, the evidence seen, how, and what bounds the gain."""
    if not summary.fixes:
        return ""
    items = "".join(_fix(rank, fix) for rank, fix in enumerate(summary.fixes, 1))
    caption = '<p class="caption">Cheapest first, then by the most step time each can save (an upper bound).</p>'
    return _section("fixes", "Fixes, ranked", f'{caption}<ol class="fixes">{items}</ol>')


def _fix(rank: int, fix: Fix) -> str:
    gain = f"{gain_text(fix)} of {fix.gain_basis} time" if fix.gain_bound is not None else "gain not bounded"
    bar = ""
    if fix.gain_bound is not None:
        width = max(0.0, min(100.0, 100 * fix.gain_bound))
        bar = f'<span class="gainbar" title="{esc(gain)}"><i style="width:{width:.1f}%"></i></span>'
    numerics = '<span class="tag">changes numerics</span>' if fix.changes_numerics else ""
    measured = f'<span class="tag measured">measured {esc(measured_text(fix))}</span>' if fix.measured else ""
    head = (
        f'<div><span class="fix-title">{rank}. {esc(fix.title)}</span>'
        f'<span class="tag cost-{esc(fix.cost)}">{esc(fix.cost)}</span><span class="tag gain">{esc(gain)}</span>'
        f"{bar}{measured}{numerics} <code>{esc(fix.id)}</code></div>"
    )
    rows = [("why", esc(fix.why))]
    if fix.evidence:
        rows.append(("seen", _list(fix.evidence)))
    rows.append(("how", f"<code>{esc(fix.how)}</code>"))
    if fix.gain_reason:
        rows.append(("bound", esc(fix.gain_reason)))
    if fix.measured is not None:
        m = fix.measured
        rows.append(
            (
                "measured",
                f"{esc(measured_text(fix))} with <code>--apply {esc(m['applied'])}</code>: {m['runs'][1]} runs "
                f"against {m['runs'][0]} of the baseline, interleaved (95% interval)",
            )
        )
        if m.get("flag"):
            rows.append(("flag", esc(m["flag"])))
    if fix.changes_numerics:
        rows.append(("note", "This changes the numerics of training: check the loss curve."))
    details = "".join(f"<dt>{label}</dt><dd>{value}</dd>" for label, value in rows)
    return f'<li>{head}<dl class="fix">{details}</dl></li>'


def phases(summary: RunSummary) -> str:
    """Stacked phase shares (the merged figures and each rank), the phase table, and the per-rank table."""
    if not summary.phases:
        return ""
    shown = shown_ranks(summary)
    owners = [("all ranks (mean)", summary)] if summary.ranks else [("this run", summary)]
    owners += [(_rank_name(rank), rank) for rank in shown]
    names: list[str] = []
    for _, owner in owners:
        names += [n for n, p in owner.phases.items() if n != TOTAL and not p.nested and n not in names]
    values = [[100 * o.phases[n].share if n in o.phases else 0.0 for n in names] for _, o in owners]
    details = [[f"{_ms(o.phases[n].mean_ms)} ms per step" if n in o.phases else "" for n in names] for _, o in owners]
    chart = stacked_bars(
        [label for label, _ in owners],
        names,
        values,
        unit="%",
        details=details,
        colors=phase_colors(names),
        title="share of the step time by phase",
    )
    caption = (
        "Share of the measured step time (host wall clock) spent in each phase; the top-level phases and "
        "<code>other</code> (time no phase claimed) add up to 100%. Hover a segment for its time per step."
    )
    parts = [f'<p class="caption">{caption}</p>', chart, _phase_table(summary)]
    if len(shown) < len(summary.ranks):
        parts.insert(
            1,
            f'<p class="caption">Bars for the {len(shown)} of {len(summary.ranks)} ranks farthest from the median (the '
            "straggler first); the table below has every rank.</p>",
        )
    if summary.ranks:
        parts.append("<h3>Per rank</h3>" + _rank_table(summary))
    if summary.cluster and summary.cluster.nodes:
        parts.append("<h3>Per node</h3>" + _node_table(summary))
    return _section("phases", "Where the step time goes", "".join(parts))


def hotspots(summary: RunSummary) -> str:
    """The source lines the host phases' time went to (the stack sampler's ``hotspots``); "" when none."""
    hot = summary.hotspots
    rows = []
    for phase, lines in hot.get("phases", {}).items():
        for line in lines:
            rows.append(
                [
                    phase,
                    f"{line['file']}:{line['line']}",
                    line.get("code") or line.get("function", ""),
                    line.get("calls") or "-",
                    _pct(line["share"]),
                    _ms(line.get("ms_per_step")),
                ]
            )
    if not rows:
        return ""
    rank = f" of rank {hot['rank']}" if "rank" in hot else ""
    caption = (
        f"Where the host time{rank} that no phase names went, by source line: {hot.get('samples', 0):,} samples "
        f"of the training thread's stack at {hot.get('rate_hz', 0):g} Hz. Share is of the phase's samples; "
        "<code>calls</code> is the library function that line called."
    )
    table = _table(["phase", "line", "code", "calls", "share", "ms per step"], rows, numeric_from=4)
    return _section("hotspots", "Host time by source line", f'<p class="caption">{caption}</p>{table}')


def evaluation(summary: RunSummary) -> str:
    """The validation passes kept out of the step figures (``summary.eval``); "" when none."""
    passes = summary.eval
    if not passes:
        return ""
    caption = (
        f"{passes['passes']} validation pass(es) between training steps took {_pct(passes['share_of_wall'])} of "
        "wall time. They are kept out of the step figures above: their wall time is cut out of the step they fell "
        f"in. A pass ran {passes['forwards_per_pass']:.0f} forward(s) over {passes['batches_per_pass']:.0f} "
        "batch(es)."
    )
    figures = [["mean", _ms(passes["mean_ms"])], ["median", _ms(passes["median_ms"])], ["max", _ms(passes["max_ms"])]]
    figures += [[f"inside: {name}", _ms(ms)] for name, ms in passes["phases_ms"].items()]
    table = _table(["per pass", "ms"], figures, numeric_from=1)
    return _section("eval", "Validation passes", f'<p class="caption">{esc(caption)}</p>{table}')


def phase_colors(names: Sequence[str]) -> list[str]:
    """A colour per phase name: the canonical phases keep theirs, custom ones take the extra colours in turn."""
    custom = [n for n in names if n not in PHASE_COLORS]
    return [PHASE_COLORS.get(n) or EXTRA_COLORS[custom.index(n) % len(EXTRA_COLORS)] for n in names]


def _phase_table(summary: RunSummary) -> str:
    cuda = summary.meta.timing == "cuda"
    headers = ["phase", "mean ms", "median ms", "p95 ms", "share"] + (["GPU mean ms", "GPU share"] if cuda else [])
    rows, classes = [], []
    for name, p in summary.phases.items():
        label = f"↳ {name}" if p.nested else name  # inside the phase above it: its share is already counted there
        row = [label, _ms(p.mean_ms), _ms(p.median_ms), _ms(p.p95_ms), _pct(p.share)]
        if cuda:
            row += [_ms(p.device_mean_ms), _pct(p.device_share)]
        rows.append(row)
        classes.append("total" if name == TOTAL else "")
    return _table(headers, rows, numeric_from=1, classes=classes)


def _rank_table(summary: RunSummary) -> str:
    names = [n for n in summary.phases if n != TOTAL]
    nodes = bool(summary.cluster and summary.cluster.nodes)
    headers = ["rank", *(["node"] if nodes else []), "step ms", *(f"{n} ms" for n in names), "samples/s"]
    rows = []
    for rank in summary.ranks:
        p = rank.phases
        row = [
            _rank_name(rank),
            *([esc(rank.meta.node)] if nodes else []),
            _ms(p[TOTAL].mean_ms) if TOTAL in p else "-",
        ]
        row += [_ms(p[n].mean_ms) if n in p else "-" for n in names]
        row.append(_rate(rank.throughput.samples_per_s))
        rows.append(row)
    return _table(headers, rows, numeric_from=2 if nodes else 1)


def _node_table(summary: RunSummary) -> str:
    rows = [
        [row["node"], rank_list(row["ranks"]), _rate(row["samples_per_s"]), _ms(row["step_ms"]),
         _ms(row.get("comms_ms"))]
        for row in summary.cluster.nodes  # type: ignore[union-attr]
    ]  # fmt: skip
    return _table(["node", "ranks", "samples/s", "step ms", "comms ms"], rows, numeric_from=2)


def step_time(summary: RunSummary) -> str:
    """Host step time over the whole run, per rank, warm-up shaded; "" without a step-time series."""
    owners = [(_rank_name(r), r, r.series) for r in shown_ranks(summary) if r.series] if summary.ranks else []
    if not summary.ranks and summary.series:
        owners = [("step time", summary, summary.series)]
    if not owners:
        return ""
    series, warm_max, measured_max = [], 0.0, 0.0
    for name, owner, s in owners:
        # Point i averages steps i*stride+1 .. (i+1)*stride (1-based): place it at their middle.
        xs = [i * s.stride + (s.stride + 1) / 2 for i in range(len(s.step_ms))]
        series.append((name, xs, s.step_ms))
        for i, value in enumerate(s.step_ms):
            if i * s.stride < owner.steps.warmup:
                warm_max = max(warm_max, value)
            else:
                measured_max = max(measured_max, value)
    warmup = max(owner.steps.warmup for _, owner, _ in owners)
    capped = measured_max > 0 and warm_max > STEP_TIME_CAP * measured_max
    chart = line_chart(
        series,
        x_label="step",
        y_label="step time",
        y_unit="ms",
        shades=[(0.5, warmup + 0.5, "warm-up")] if warmup else [],
        y_max=measured_max * 1.25 if capped else None,
        title="step time over the run",
    )
    strides = sorted({s.stride for _, _, s in owners})
    stride = "one step" if strides == [1] else f"the mean of {' or '.join(map(str, strides))} consecutive steps"
    caption = f"Host wall time of every step from the first, warm-up shaded; each point is {stride}."
    if capped:
        caption += (
            f" Warm-up steps up to {fmt_number(warm_max)} ms (compilation, allocator and cuDNN warm-up) are drawn "
            "at the top edge so that the measured steps stay readable; hover them for their time."
        )
    if summary.steps.profiled:
        caption += (
            f" {summary.steps.profiled} steps recorded by torch.profiler are in the line (slowed by the profiler) "
            "but not in the statistics."
        )
    return _section("step-time", "Step time over the run", f'<p class="caption">{caption}</p>{chart}')


def system(summary: RunSummary) -> str:
    """GPU utilisation, SM clock and power, and host CPU over time, with their averages and the derived signals;
    "" when nothing was sampled."""
    sources = [(_rank_name(r) + " · ", r.system) for r in shown_ranks(summary) if r.system] if summary.ranks else []
    if not summary.ranks and summary.system:
        sources = [("", summary.system)]
    gpu, power, cpu = [], [], []
    for prefix, sys_ in sources:
        timeline = sys_.get("timeline") or {}
        t = timeline.get("t_s") or []
        sm = [None if v is None else 100 * v for v in timeline.get("sm_clock_ratio") or []]
        gpu += _present(t, ((prefix + "GPU utilisation", timeline.get("gpu_util_pct")), (prefix + "SM clock", sm)))
        drawn = _present(t, ((prefix + "GPU power", timeline.get("power_w")),))
        limit = sum(d.get("power_limit_w") or 0.0 for d in (sys_.get("gpu") or {}).get("devices") or [])
        if drawn and limit and t:  # the timeline's power is summed over the devices: so is the limit
            drawn.append((prefix + "power limit", [t[0], t[-1]], [limit, limit]))
        power += drawn
        workers = (sys_.get("host") or {}).get("workers_max")
        cpu += _present(
            t,
            (
                (prefix + "training process", timeline.get("cpu_util_pct")),
                # no line for loader workers when the loader had none
                (prefix + "loader workers", timeline.get("workers_cpu_util_pct") if workers != 0 else None),
            ),
        )
    parts = []
    if gpu:
        parts.append("<h3>GPU utilisation and SM clock</h3>")
        parts.append(
            '<p class="caption">Utilisation: share of time a kernel was running (one tiny kernel counts as busy). '
            "SM clock: % of the maximum; a busy GPU at a low clock or power runs a trickle of small kernels.</p>"
        )
        parts.append(line_chart(gpu, x_label="time", x_unit="s", y_label="percent", y_unit="%", title="GPU"))
    if power:
        parts.append("<h3>GPU power</h3>")
        parts.append(line_chart(power, x_label="time", x_unit="s", y_label="power", y_unit="W", title="GPU power"))
    if cpu:
        parts.append("<h3>Host CPU</h3>")
        parts.append('<p class="caption">100% is one core; loader workers are summed.</p>')
        parts.append(
            line_chart(cpu, x_label="time", x_unit="s", y_label="CPU", y_unit="% of one core", title="host CPU")
        )
    parts.append(_device_table(sources))
    parts.append(_host_table(sources))
    signals = (summary.system or {}).get("signals") or []
    if signals:
        parts.append("<h3>What the samples say</h3>")
        parts.append(_list(f"{s.get('id')}: {s.get('evidence')}" for s in signals))
    notes = [note for _, sys_ in sources for note in sys_.get("notes") or []]
    if notes:
        parts.append(f'<div class="notes">{_list(notes)}</div>')
    body = "".join(parts)
    if not body:
        return ""
    interval = next((s.get("interval_s") for _, s in sources if s.get("interval_s")), None)
    caption = f"Sampled every {fmt_number(interval)} s from the first measured step." if interval else ""
    title = "GPU and host over time" if gpu or power else "Host over time"
    return _section("system", title, f'<p class="caption">{caption}</p>{body}')


def _present(t: list[float], named: Sequence[tuple[str, Sequence[float | None] | None]]) -> list[Any]:
    """The ``(name, t, values)`` series that have at least one value."""
    return [(name, t, values) for name, values in named if values and any(v is not None for v in values)]


def _device_table(sources: list[tuple[str, dict[str, Any]]]) -> str:
    headers = ["GPU", "util %", "memory util %", "SM clock %", "power W", "limit W", "energy J", "memory peak MiB",
               "max °C", "throttled"]  # fmt: skip
    rows = []
    for prefix, sys_ in sources:
        gpu = sys_.get("gpu") or {}
        for d in gpu.get("devices") or []:
            throttle = ", ".join(f"{k} {100 * v:.0f}%" for k, v in (d.get("throttle") or {}).items())
            rows.append(
                [
                    f"{prefix}{d.get('index')} {d.get('name', '')}".strip(),
                    _num(d.get("util_avg_pct")),
                    _num(d.get("mem_util_avg_pct")),
                    _num(None if d.get("sm_clock_ratio_avg") is None else 100 * d["sm_clock_ratio_avg"]),
                    _num(d.get("power_avg_w")),
                    _num(d.get("power_limit_w")),
                    _num(d.get("energy_j")),
                    _num(d.get("mem_peak_mb")),
                    _num(d.get("temp_max_c")),
                    throttle or "-",
                ]
            )
    return _table(headers, rows, numeric_from=1) if rows else ""


def _host_table(sources: list[tuple[str, dict[str, Any]]]) -> str:
    headers = ["host", "process CPU %", "workers CPU %", "busy workers", "machine CPU %", "peak RSS MiB", "cores",
               "CPU quota"]  # fmt: skip
    rows = []
    for prefix, sys_ in sources:
        host = sys_.get("host")
        if not host:
            continue
        rows.append(
            [
                prefix.rstrip(" ·") or "this run",
                _num(host.get("cpu_util_pct")),
                _num(host.get("workers_cpu_util_pct")),
                _num(host.get("workers_busy_avg")),
                _num(host.get("system_cpu_util_pct")),
                _num(host.get("peak_rss_mb")),
                _num(host.get("cores")),
                _num(host.get("cpu_quota")),
            ]
        )
    return _table(headers, rows, numeric_from=1) if rows else ""


def _loader_code(settings: dict[str, Any]) -> str:
    """A sweep setting as the DataLoader arguments to write (the terminal's and the doctor's form)."""
    return LoaderSettings(**settings).snippet()


def capacity(summary: RunSummary) -> str:
    """The loader's ceiling against training without its data waits and the realised rate; "" unless both the
    realised rate and a loader ceiling were measured."""
    realised = summary.throughput.samples_per_s
    loader = summary.dataloader or {}
    against = loader.get("against_training") or {}
    ceiling = against.get("loader_ceiling") or loader.get("cluster_sync_samples_per_s")
    if ceiling is None:
        ceiling = (loader.get("loader") or {}).get("samples_per_s")
    if realised is None or ceiling is None:
        return ""
    labels, values = ["loader alone (ceiling)"], [ceiling]
    wait = summary.phases.get("data_wait")
    if wait is not None and wait.share < 1:
        labels.append("training without data waits")
        values.append(realised / (1 - wait.share))
    labels.append("realised")
    values.append(realised)
    chart = bars(labels, values, unit="samples/s", colors=["#f28e2b", "#4e79a7", "#59a14f"], title="capacities")
    lines = [
        "The loader's ceiling is the loader iterated alone"
        + (" (ranks × the slowest rank's)" if summary.ranks else "")
        + "; training without data waits is the realised rate with the <code>data_wait</code> share removed "
        "(what the model could take if batches were free); the realised rate is what the measured steps did."
    ]
    if against.get("headroom") is not None:  # what it implies is the verdict's call (its evidence, above)
        lines.append(f"The loader alone gives {against['headroom']:.2f}× what training consumed.")
    best = loader.get("best")
    if best and best.get("samples_per_s") is not None:
        settings = best.get("settings") or {}
        gain = "" if best.get("gain") is None else f" ({100 * best['gain']:+.0f}% over the current setting)"
        lines.append(
            f"The sweep's best setting ({esc(_loader_code(settings))}) reached "
            f"{esc(fmt_number(best['samples_per_s']))} samples/s{esc(gain)}."
        )
    captions = "".join(f'<p class="caption">{line}</p>' for line in lines)
    return _section("capacity", "Input pipeline against training", captions + chart)


PIPELINE_RATES = (
    ("infer_capacity", "inference capacity"),
    ("train_capacity", "training capacity"),
    ("thru", "throughput"),
    ("inflow", "inflow"),
)
PIPELINE_FIGURES = (
    ("window_s", "window", "s"),
    ("slots", "inference slots", ""),
    ("slot_busy", "slots busy", "%"),
    ("pool", "pool (samples waiting)", ""),
    ("pool_trend", "pool trend", "samples/s"),
    ("infer_batch_time_s", "inference batch time", "s"),
    ("dispatch_wait_s", "dispatch wait", "s"),
    ("infer_calls", "inference calls", ""),
    ("infer_errors", "inference errors", ""),
    ("train_steps", "training steps", ""),
    ("samples_in", "samples in", ""),
    ("samples_out", "samples out", ""),
)


def pipeline(summary: RunSummary) -> str:
    """PipelineMonitor's figures: who starves whom, inference (I) and training (T) capacity against the
    throughput, and their history; "" when the run had no pipeline monitor."""
    p = summary.pipeline
    if not p:
        return ""
    side = f", training side: {p['training_side']}" if p.get("training_side") else ""
    confidence = f" (confidence {p.get('confidence', 'low')}{side})"
    parts = [f"<p>Bottleneck: <b>{esc(p.get('bottleneck', 'unknown'))}</b>{esc(confidence)}</p>"]
    if p.get("evidence"):
        parts.append(_list(p["evidence"]))
    rates = [(label, p[key]) for key, label in PIPELINE_RATES if p.get(key) is not None]
    if rates:
        parts.append(
            bars([label for label, _ in rates], [v for _, v in rates], unit="samples/s", title="pipeline rates")
        )
    rows = [
        [label, f"{_num(100 * p[k])}%" if unit == "%" else f"{_num(p[k])} {unit}".strip()]
        for k, label, unit in PIPELINE_FIGURES
        if p.get(k) is not None
    ]
    if rows:
        parts.append(_table(["figure", "value"], rows, numeric_from=1))
    history = p.get("history") or []
    t = [h.get("t_s") for h in history]
    lines = _present(t, [(label, [h.get(key) for h in history]) for key, label in PIPELINE_RATES])
    if lines:
        parts.append("<h3>Rates over time</h3>")
        parts.append(line_chart(lines, x_label="time", x_unit="s", y_label="rate", y_unit="samples/s", title="rates"))
    pool = _present(t, [("pool", [h.get("pool") for h in history])])
    if pool:
        parts.append("<h3>Pool over time</h3>")
        parts.append(line_chart(pool, x_label="time", x_unit="s", y_label="samples waiting", title="pool"))
    caption = (
        '<p class="caption">The realised throughput is at most the lower of the inference capacity (per-slot rate '
        "× slots) and the training capacity; a growing pool means training is the slower side.</p>"
    )
    return _section("pipeline", "Inference → training pipeline", caption + "".join(parts))


# Idle, computation and the rest (communication, copies, syncs not under computation): HTA's temporal breakdown.
TRACE_SEGMENTS = (("idle_pct", "idle", "#bab0ac"), ("compute_pct", "compute", "#4e79a7"),
                  ("non_compute_pct", "non-compute", "#e15759"))  # fmt: skip


def trace(summary: RunSummary) -> str:
    """Highlights of the torch.profiler traces captured with the run: per rank the GPU's idle/compute/non-compute
    shares with the idle causes, overlap, exposed communication, data loading and bound; the first rank's top kernels
    (or a CPU-only rank's top operators), the rank the others wait for at collectives with its cause, stragglers, the
    trace verdict and the files that could not be read; "" when the summary carries no trace."""
    t = summary.trace or {}
    ranks = t.get("ranks") or []
    if not ranks:
        return ""
    labels = _trace_labels(ranks)
    gpu = [(label, r) for label, r in zip(labels, ranks, strict=True) if r.get("idle_pct") is not None]
    caption = f"The torch.profiler traces in <code>{esc(t.get('folder', '?'))}</code>, analysed with Holistic Trace "
    if gpu:
        caption += (
            "Analysis' definitions: idle, compute and non-compute (communication, memory copies and syncs that no "
            "computation hides) are shares of the kernel span, first to last GPU kernel; host wait (the GPU waited "
            "for the host to launch) and kernel wait (launch latency) are shares of the idle gaps."
        )
    else:
        caption += "Analysis' definitions; no GPU activity: ATen ops % is the main thread's time in aten:: ops."
    caption += " Traced steps carry the profiler's overhead; <code>stepscope trace DIR</code> gives every figure."
    parts = [f'<p class="caption">{caption}</p>']
    v = t.get("verdict") or {}
    parts.append(
        f"<p>Trace verdict: <b>{esc(v.get('bound', 'unknown'))}</b> "
        f'<span class="confidence">(confidence {esc(v.get("confidence", "low"))})</span></p>'
    )
    if v.get("evidence"):
        parts.append(_list(v["evidence"]))
    if late := late_rank_lines(t):
        parts.append("<h3>Late rank</h3>" + _list(late))
    parts.append(_trace_rank_table(ranks, labels))
    if gpu:
        parts.append(
            stacked_bars(
                [label for label, _ in gpu],
                [name for _, name, _ in TRACE_SEGMENTS],
                [[r.get(key) or 0.0 for key, _, _ in TRACE_SEGMENTS] for _, r in gpu],
                unit="%",
                details=[[_span_ms(r, key) for key, _, _ in TRACE_SEGMENTS] for _, r in gpu],
                colors=[color for _, _, color in TRACE_SEGMENTS],
                title="GPU time by kind, % of the kernel span",
            )
        )
    first = next(((label, r) for label, r in zip(labels, ranks, strict=True) if r.get("top_kernels")), None)
    if first:
        label, r = first
        rows = [
            [k.get("name", ""), k.get("type", ""), _num(k.get("count")), _ms(k.get("total_ms")), _pct1(k.get("pct"))]
            for k in r["top_kernels"]
        ]
        parts.append(f"<h3>Top kernels, {esc(label)}</h3>")
        parts.append(_table(["kernel", "type", "calls", "total ms", "% kernel time"], rows, numeric_from=2))
    if ops := _top_ops(ranks, labels, t.get("late_ranks") or []):
        parts.append(ops)
    stragglers = t.get("stragglers") or []
    if stragglers:
        parts.append("<h3>Stragglers</h3>")
        parts.append(
            _list(
                f"rank {s.get('rank')}: {_ms(s.get('step_ms'))} ms per step, {_pct1(s.get('slower_pct'))}% above the "
                f"median of the other ranks ({_ms(s.get('median_step_ms'))} ms); {s.get('why', '')}"
                for s in stragglers
            )
        )
    notes = [f"{label}: {note}" for label, r in zip(labels, ranks, strict=True) for note in r.get("notes") or []]
    notes += t.get("warnings") or []
    if notes:
        parts.append(f'<div class="notes">{_list(notes)}</div>')
    skipped = t.get("skipped") or []
    if skipped:
        parts.append("<h3>Files not analysed</h3>")
        reasons = _list(f"{s.get('file')}: {s.get('reason')}" for s in skipped)
        parts.append(f'<div class="notes">{reasons}</div>')
    return _section("trace", "Trace highlights", "".join(parts))


def _top_ops(ranks: list[dict[str, Any]], labels: list[str], late: list[dict[str, Any]]) -> str:
    """The top host operators of one CPU-only rank (a late rank's first: what it did while the others waited), as
    ``prof.key_averages()`` tables them; "" when no rank is CPU-only."""
    late_keys = {(entry.get("job"), entry.get("rank")) for entry in late}
    pairs = zip(labels, ranks, strict=True)
    cpu_only = [(label, r) for label, r in pairs if r.get("top_ops") and not r.get("top_kernels")]
    if not cpu_only:
        return ""
    label, r = min(cpu_only, key=lambda pair: (pair[1].get("job"), pair[1].get("rank")) not in late_keys)
    rows = [
        [op.get("name", ""), _num(op.get("count")), _ms(op.get("self_ms")), _pct1(op.get("self_pct")),
         _ms(op.get("total_ms"))]
        for op in r["top_ops"]
    ]  # fmt: skip
    headers = ["operator", "calls", "self ms", "% self time", "total ms"]
    return f"<h3>Top operators, {esc(label)} (CPU-only trace)</h3>" + _table(headers, rows, numeric_from=1)


def _trace_labels(ranks: list[dict[str, Any]]) -> list[str]:
    """``rank N``, with its file (and subfolder) when several files hold one rank (several jobs or capture windows)."""
    labels = [f"rank {r.get('rank')}" for r in ranks]
    files = [r.get("file") if r.get("job") in (None, "", ".") else f"{r['job']}/{r.get('file')}" for r in ranks]
    return [
        f"{label} · {file}" if labels.count(label) > 1 else label for label, file in zip(labels, files, strict=True)
    ]


TRACE_GPU_COLUMNS = (
    ("idle %", lambda r: _pct1(r.get("idle_pct"))),
    ("compute %", lambda r: _pct1(r.get("compute_pct"))),
    ("non-compute %", lambda r: _pct1(r.get("non_compute_pct"))),
    ("host wait %", lambda r: _pct1((r.get("idle_breakdown") or {}).get("host_wait_pct"))),
    ("kernel wait %", lambda r: _pct1((r.get("idle_breakdown") or {}).get("kernel_wait_pct"))),
    ("overlap %", lambda r: _pct1(r.get("overlap_pct"))),
    ("exposed comm %", lambda r: _pct1(r.get("exposed_comm_pct"))),
)


def _trace_rank_table(ranks: list[dict[str, Any]], labels: list[str]) -> str:
    """One row per rank; the GPU columns when a rank had GPU activity, the ATen share when one had none."""
    columns: list[tuple[str, Any]] = [
        ("bound", lambda r: (r.get("verdict") or {}).get("bound", "unknown")),
        ("steps", lambda r: _num(r.get("steps"))),
        ("step ms", lambda r: _ms(r.get("step_ms"))),
    ]
    if any(r.get("kernel_span_ms") is not None for r in ranks):
        columns += TRACE_GPU_COLUMNS
    columns.append(("data ms/step", lambda r: _ms((r.get("data_loading") or {}).get("per_step_ms"))))
    if any(r.get("cpu") for r in ranks):
        columns.append(("ATen ops %", lambda r: _pct1((r.get("cpu") or {}).get("computation_pct"))))
    rows = [[label] + [cell(r) for _, cell in columns] for label, r in zip(labels, ranks, strict=True)]
    return _table(["rank"] + [name for name, _ in columns], rows, numeric_from=2)


def _span_ms(rank: dict[str, Any], key: str) -> str:
    share, span = rank.get(key), rank.get("kernel_span_ms")
    return "" if share is None or not span else f"{_ms(share / 100 * span)} ms of a {_ms(span)} ms kernel span"


def run_info(summary: RunSummary) -> str:
    """What ran where: command, device, versions, steps, how it ended, notes, loaders and per-step counters."""
    m, s = summary.meta, summary.steps
    rows = [
        ["command", m.command or "-"],
        ["device", f"{m.device} (timing: {m.timing})"],
        ["host", m.hostname or "-"],
        ["started", m.started_at or "-"],
        ["versions", f"stepscope {m.stepscope_version or '?'}, torch {m.torch_version or '?'}, "
                     f"Python {m.python_version or '?'}"],
        ["steps", f"{s.warmup} warm-up, {s.measured} measured"
                  + (f", {s.profiled} profiled (left out)" if s.profiled else "")
                  + (f"; a step ends at {s.boundary}" if s.boundary else "")],
    ]  # fmt: skip
    if m.world_size is not None:
        rows.append(["ranks", f"world size {m.world_size}" + (f", rank {m.rank}" if m.rank is not None else "")])
    line = exit_line(summary)
    if line:
        rows.append(["exit", line])
    line = applied_line(summary)  # `--apply`: the fixes applied to this run, and where
    if line:
        rows.append(["applied", line.removeprefix("applied: ")])
    parts = [_table(["", ""], rows, header=False)]
    if summary.notes:
        parts.append(f'<h3>Notes</h3><div class="notes">{_list(summary.notes)}</div>')
    if summary.loaders:
        headers = ["loader", "dataset", "batch", "workers", "prefetch", "pinned", "persistent", "batches", "fetch s"]
        loader_rows = [
            [str(x.index), x.dataset, _num(x.batch_size), str(x.num_workers), _num(x.prefetch_factor),
             _yes(x.pin_memory), _yes(x.persistent_workers), str(x.batches), f"{x.fetch_s:.2f}"]
            for x in summary.loaders
        ]  # fmt: skip
        parts.append("<h3>Data loaders</h3>" + _table(headers, loader_rows))
    if summary.counters:
        counter_rows = [[name.replace("_", " "), fmt_number(value)] for name, value in summary.counters.items()]
        parts.append("<h3>Per measured step</h3>" + _table(["counter", "per step"], counter_rows, numeric_from=1))
    return _section("run", "The run", "".join(parts))


def _section(section_id: str, title: str, inner: str) -> str:
    return f'<section id="{section_id}"><h2>{esc(title)}</h2>{inner}</section>\n'


def _list(items: Any) -> str:
    return "<ul>" + "".join(f"<li>{esc(item)}</li>" for item in items) + "</ul>"


def _table(
    headers: Sequence[str],
    rows: Sequence[Sequence[str]],
    numeric_from: int | None = None,
    classes: Sequence[str] | None = None,
    header: bool = True,
) -> str:
    """A table of plain-text cells (escaped here); columns from ``numeric_from`` on are right-aligned."""

    def cell(tag: str, i: int, text: str) -> str:
        numeric = numeric_from is not None and i >= numeric_from
        return f'<{tag} class="num">{esc(text)}</{tag}>' if numeric else f"<{tag}>{esc(text)}</{tag}>"

    head = "<tr>" + "".join(cell("th", i, h) for i, h in enumerate(headers)) + "</tr>" if header else ""
    body = []
    for k, row in enumerate(rows):
        css = f' class="{classes[k]}"' if classes and classes[k] else ""
        body.append(f"<tr{css}>" + "".join(cell("td", i, str(c)) for i, c in enumerate(row)) + "</tr>")
    return f"<table>{head}{''.join(body)}</table>"


def _rank_name(rank: RunSummary) -> str:
    return f"rank {rank.meta.rank if rank.meta.rank is not None else '?'}"


def _ms(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.3f}" if value < 10 else f"{value:,.1f}"


def _pct(share: float | None) -> str:
    return "-" if share is None else f"{100 * share:.1f}%"


def _pct1(value: float | None) -> str:
    """A percentage (0..100) with one decimal."""
    return "-" if value is None else f"{value:.1f}"


def _rate(value: float | None) -> str:
    return "-" if value is None else f"{value:,.1f}"


def _num(value: float | None) -> str:
    return "-" if value is None else fmt_number(value) if isinstance(value, float) else f"{value:,}"


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"
