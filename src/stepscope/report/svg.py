"""Small SVG charts for the HTML reports: stacked horizontal bars, plain horizontal bars and line charts.

Each function takes plain lists of numbers and labels and returns one ``<svg>`` element as a string, sized by its
``viewBox`` so that the page can scale it to its column. No dependency and no script: a point's or a segment's
value is shown on hover by an SVG ``<title>``. Every label is HTML-escaped here, so callers pass user text as is.
Text is laid out without a text engine, from an estimated glyph width; long labels are shortened with "…" (the
full text stays in the hover title). Line charts have a linear or a log₂ x axis, with round ticks or ticks at given
values (the world sizes of a scaling report), and can draw some series dashed (a reference such as ideal scaling).
"""

from __future__ import annotations

import html
import math
from collections.abc import Callable, Collection, Sequence

# Tableau 10: distinguishable, colour-blind friendly enough for a handful of series.
PALETTE = (
    "#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#b07aa1", "#ff9da7", "#9c755f", "#bab0ac",
)  # fmt: skip
FONT_PX = 12
CHAR_PX = 6.6  # mean glyph width of a sans-serif at FONT_PX, for laying out text without measuring it
AXIS_COLOR = "#888"
GRID_COLOR = "#e6e6e6"
SHADE_COLOR = "#ececec"
MARKER_MAX_POINTS = 40  # series with at most this many points get visible markers
HOVER_MAX_POINTS = 4000  # a chart with more points draws lines only: a hover target each would bloat the page
LOG_MAX_TICKS = 8  # a log₂ axis without given ticks labels at most about this many powers of two
DASH = "5 4"  # stroke-dasharray of a dashed series (px on, px off)
LABEL_MAX_PX = 200  # bar labels wider than this are shortened

Series = tuple[str, Sequence[float], Sequence[float | None]]  # (name, x values, y values; None leaves a gap)


def esc(text: object) -> str:
    """``text`` as HTML/SVG text or attribute value: ``& < > " '`` escaped."""
    return html.escape(str(text), quote=True)


def nice_ticks(lo: float, hi: float, count: int = 5) -> list[float]:
    """About ``count`` round tick values (steps of 1, 2, 2.5 or 5 × a power of ten) whose first is at or below
    ``lo`` and whose last is at or above ``hi``; the axis then spans the first to the last tick."""
    if not (math.isfinite(lo) and math.isfinite(hi)):
        raise ValueError(f"ticks need finite bounds, got {lo} and {hi}")
    if hi <= lo:
        hi = lo + (abs(lo) or 1.0)
    raw = (hi - lo) / max(count, 1)
    magnitude = 10 ** math.floor(math.log10(raw))
    step = next(m * magnitude for m in (1, 2, 2.5, 5, 10) if m * magnitude >= raw * (1 - 1e-9))
    first, last = math.floor(lo / step + 1e-9), math.ceil(hi / step - 1e-9)
    return [_clean(k * step) for k in range(first, last + 1)]


def tick_text(value: float, step: float) -> str:
    """A tick value with as many decimals as the tick step needs and thousands separators: 1,500 · 0.25."""
    decimals = max(0, -math.floor(math.log10(step) + 1e-9)) if step > 0 else 0
    if step > 0 and round(step, decimals) != step:  # a 2.5 × 10^k step needs one decimal more
        decimals += 1
    return f"{value:,.{decimals}f}"


def fmt_number(value: float) -> str:
    """A value for a label or tooltip, to about three significant figures: 42,202 · 12.3 · 7.6 · 0.0123."""
    size = abs(value)
    if size >= 100:
        return f"{value:,.0f}"
    if size >= 10:
        return f"{value:.1f}"
    if size >= 1:
        return f"{value:.2f}".rstrip("0").rstrip(".")
    if size >= 0.001 or size == 0:
        return f"{value:.3g}"
    return f"{value:.2e}"


def with_unit(value: float, unit: str) -> str:
    """``fmt_number(value)`` followed by the unit ("%" attached, others after a space)."""
    if not unit:
        return fmt_number(value)
    return f"{fmt_number(value)}{unit}" if unit == "%" else f"{fmt_number(value)} {unit}"


def stacked_bars(
    labels: Sequence[str],
    segments: Sequence[str],
    values: Sequence[Sequence[float]],
    *,
    unit: str = "",
    details: Sequence[Sequence[str]] | None = None,
    colors: Sequence[str] | None = None,
    width: int = 1000,
    title: str = "",
) -> str:
    """Horizontal bars, one per label, each stacked from ``segments`` (legend on top, value axis below).

    ``values[i][j]`` is segment ``j`` of bar ``i`` in ``unit`` (negative values count as 0); ``details[i][j]``, when
    given, is added to that cell's hover text. The axis runs from 0 to the longest bar. Returns "" when there is
    no bar to draw.
    """
    if not labels or not segments:
        return ""
    palette = list(colors or PALETTE)
    bar_h, gap = 22, 10
    left = _label_width(labels)
    legend_svg, legend_h = _legend(list(segments), palette, 10, 6, width - 20)
    top = legend_h + 12
    plot_w = width - left - 20
    longest = max(sum(max(v, 0.0) for v in row) for row in values)
    ticks = nice_ticks(0.0, longest or 1.0)
    scale = plot_w / ticks[-1]
    height = top + len(labels) * (bar_h + gap) + 36
    parts = [_svg_open(width, height, title), legend_svg]
    for tick in ticks:
        x = left + tick * scale
        parts.append(_line(x, top - 4, x, top + len(labels) * (bar_h + gap), GRID_COLOR))
    for i, (label, row) in enumerate(zip(labels, values, strict=True)):
        y = top + i * (bar_h + gap)
        parts.append(_text(left - 8, y + bar_h / 2 + 4, _shorten(label, LABEL_MAX_PX), "end", full=label))
        x = left
        for j, value in enumerate(row):
            w = max(value, 0.0) * scale
            if w <= 0:
                continue
            tip = f"{label} · {segments[j]}: {with_unit(value, unit)}"
            if details is not None and details[i][j]:
                tip += f" ({details[i][j]})"
            color = palette[j % len(palette)]
            parts.append(
                f'<rect x="{_n(x)}" y="{_n(y)}" width="{_n(w)}" height="{bar_h}" fill="{color}">'
                f"<title>{esc(tip)}</title></rect>"
            )
            inside = f"{value:.1f}%" if unit == "%" else with_unit(value, unit)
            if w >= len(inside) * CHAR_PX + 6:
                parts.append(_text(x + w / 2, y + bar_h / 2 + 4, inside, "middle", fill="#fff"))
            x += w
    axis_y = top + len(labels) * (bar_h + gap) - gap / 2
    parts.append(_line(left, axis_y, left + plot_w, axis_y, AXIS_COLOR))
    step = ticks[1] - ticks[0]
    for tick in ticks:
        text = tick_text(tick, step) + ("%" if unit == "%" else "")
        parts.append(_text(left + tick * scale, axis_y + 16, text, "middle", fill="#555"))
    if unit and unit != "%":
        parts.append(_text(left + plot_w, axis_y + 30, unit, "end", fill="#555"))
    parts.append("</svg>")
    return "".join(parts)


def bars(
    labels: Sequence[str],
    values: Sequence[float],
    *,
    unit: str = "",
    colors: Sequence[str] | None = None,
    width: int = 1000,
    title: str = "",
) -> str:
    """Horizontal bars, one per label, from 0 to ``values[i]`` (in ``unit``), each with its value written after
    it. Returns "" when there is no bar to draw."""
    if not labels:
        return ""
    palette = list(colors or PALETTE)
    bar_h, gap = 22, 10
    left = _label_width(labels)
    texts = [with_unit(v, unit) for v in values]
    plot_w = width - left - 20 - max(len(t) for t in texts) * CHAR_PX - 8
    longest = max(max(values), 0.0) or 1.0
    height = 8 + len(labels) * (bar_h + gap)
    parts = [_svg_open(width, height, title)]
    for i, (label, value) in enumerate(zip(labels, values, strict=True)):
        y = 8 + i * (bar_h + gap)
        w = max(value, 0.0) / longest * plot_w
        parts.append(_text(left - 8, y + bar_h / 2 + 4, _shorten(label, LABEL_MAX_PX), "end", full=label))
        parts.append(
            f'<rect x="{_n(left)}" y="{_n(y)}" width="{_n(w)}" height="{bar_h}" fill="{palette[i % len(palette)]}">'
            f"<title>{esc(f'{label}: {texts[i]}')}</title></rect>"
        )
        parts.append(_text(left + w + 6, y + bar_h / 2 + 4, texts[i], "start"))
    parts.append("</svg>")
    return "".join(parts)


def interval_chart(
    labels: Sequence[str],
    values: Sequence[float | None],
    intervals: Sequence[tuple[float, float] | None],
    *,
    reference: float = 1.0,
    colors: Sequence[str] | None = None,
    width: int = 1000,
    title: str = "",
) -> str:
    """A point with its interval per label (a forest plot) on one linear axis that spans them and ``reference``,
    drawn as a vertical line (1.0: no change, for speedups); a label whose value is None gets no point. Returns ""
    when there is nothing to draw."""
    known = [v for v in values if v is not None] + [x for i in intervals if i is not None for x in i]
    if not labels or not known:
        return ""
    palette = list(colors or PALETTE)
    row_h = 22
    left = _label_width(labels)
    right_px = 90  # the value's text after the axis
    ticks = nice_ticks(min(*known, reference), max(*known, reference))
    lo, hi = ticks[0], ticks[-1]
    plot_w = width - left - right_px
    height = 8 + len(labels) * row_h + 28

    def x(value: float) -> float:
        return left + (value - lo) / (hi - lo) * plot_w

    parts = [_svg_open(width, height, title)]
    bottom = 8 + len(labels) * row_h
    step = ticks[1] - ticks[0] if len(ticks) > 1 else 1.0
    for tick in ticks:
        parts.append(_line(x(tick), 8, x(tick), bottom, GRID_COLOR))
        parts.append(_text(x(tick), bottom + 16, tick_text(tick, step), "middle", fill=AXIS_COLOR))
    parts.append(_line(x(reference), 4, x(reference), bottom, AXIS_COLOR))
    for i, (label, value, interval) in enumerate(zip(labels, values, intervals, strict=True)):
        y = 8 + i * row_h + row_h / 2
        color = palette[i % len(palette)]
        parts.append(_text(left - 8, y + 4, _shorten(label, LABEL_MAX_PX), "end", full=label))
        if value is None:
            parts.append(_text(left + 4, y + 4, "not measured", "start", fill=AXIS_COLOR))
            continue
        text = fmt_number(value) + (f" ({fmt_number(interval[0])}–{fmt_number(interval[1])})" if interval else "")
        if interval is not None:
            parts.append(
                f'<line x1="{_n(x(interval[0]))}" y1="{_n(y)}" x2="{_n(x(interval[1]))}" y2="{_n(y)}" '
                f'stroke="{color}" stroke-width="3"/>'
            )
        parts.append(
            f'<circle cx="{_n(x(value))}" cy="{_n(y)}" r="5" fill="{color}"><title>{esc(f"{label}: {text}")}</title>'
            "</circle>"
        )
        parts.append(_text(width - right_px + 8, y + 4, fmt_number(value), "start"))
    parts.append("</svg>")
    return "".join(parts)


def line_chart(
    series: Sequence[Series],
    *,
    x_label: str,
    y_label: str,
    x_unit: str = "",
    y_unit: str = "",
    shades: Sequence[tuple[float, float, str]] = (),
    y_max: float | None = None,
    x_log2: bool = False,
    x_ticks: Sequence[float] | None = None,
    x_hover: Callable[[float], str] | None = None,
    dashed: Collection[str] = (),
    colors: Sequence[str] | None = None,
    width: int = 1000,
    height: int = 240,
    title: str = "",
) -> str:
    """Lines over a shared x axis, one per ``(name, xs, ys)`` series (legend on top), the y axis from 0 (or the
    lowest value, when negative).

    ``shades`` are ``(x0, x1, label)`` ranges drawn as grey bands behind the lines. ``y_max`` caps the y axis:
    points above it are drawn on the top edge (their hover text keeps the true value) so that a few outliers,
    such as a compile step, do not flatten the rest. ``None`` values break a line. Units go in the axis titles
    and hover texts; a chart of more than ``HOVER_MAX_POINTS`` points has no per-point hover text on its long
    series. Returns "" when no series has a point.

    The x axis spans the data, the shades and ``x_ticks``. By default it is linear, starts at 0 when the data
    starts just after 0, and has round ticks. ``x_log2`` makes it logarithmic (base 2; every x value, shade
    bound and tick must be > 0, else ValueError) with ", log scale" added to its title and, without
    ``x_ticks``, ticks at powers of two. ``x_ticks`` puts a tick at each of these x values instead (in
    ``x_unit``, such as each world size measured), labelled with the value (1 · 16 · 1,024 · 0.5).
    A point's hover text is "{name}: {y and y_unit} at {x}", where the x part is ``x_hover(x)`` when given ("8
    ranks"), else ``x_label`` then the value and ``x_unit`` ("GPU power: 310 W at time 12.5 s"). Series whose
    name is in ``dashed`` are drawn dashed, their legend swatch too. ``width`` and ``height`` are the SVG's size in
    px (the page may scale it).
    """
    points = [(x, y) for _, xs, ys in series for x, y in zip(xs, ys, strict=True) if y is not None]
    if not points:
        return ""
    palette = list(colors or PALETTE)
    legend_svg, legend_h = _legend([name for name, _, _ in series], palette, 10, 6, width - 20, dashed)
    left, right, top, bottom = 64, 16, legend_h + 14, 44
    plot_w, plot_h = width - left - right, height - top - bottom
    xs_all = [x for x, _ in points] + [x for lo, hi, _ in shades for x in (lo, hi)] + list(x_ticks or ())
    if x_log2 and min(xs_all) <= 0:
        raise ValueError(f"a log-scale x axis needs x values above 0, got {min(xs_all)}")
    axis: Callable[[float], float] = math.log2 if x_log2 else _same
    # The x axis spans the data (and shades and given ticks) exactly, in axis units (log₂ of x on a log axis).
    x_lo, x_hi = min(axis(x) for x in xs_all), max(axis(x) for x in xs_all)
    if not x_log2 and x_ticks is None and 0 < x_lo <= 0.1 * (x_hi - x_lo):
        x_lo = 0.0  # a time or step axis that starts just after 0: start it at 0
    if x_hi <= x_lo:
        x_lo, x_hi = x_lo - 0.5, x_hi + 0.5
    x_tick_labels = _x_tick_labels(x_lo, x_hi, x_log2, x_ticks)
    y_top = y_max if y_max is not None else max(y for _, y in points)
    y_ticks = nice_ticks(min(0.0, min(y for _, y in points)), y_top)
    if y_max is not None:  # the cap is the top of the axis, not the next round tick above it
        y_ticks = [t for t in y_ticks if t <= y_max] or y_ticks[:1]
        y_hi = y_max
    else:
        y_hi = y_ticks[-1]
    y_lo = y_ticks[0]

    def sx(x: float) -> float:
        return left + (axis(x) - x_lo) / (x_hi - x_lo) * plot_w

    def sy(y: float) -> float:
        y = min(max(y, y_lo), y_hi)
        return top + plot_h - (y - y_lo) / ((y_hi - y_lo) or 1.0) * plot_h

    parts = [_svg_open(width, height, title), legend_svg]
    for lo, hi, label in shades:
        x0, x1 = sx(lo), sx(hi)
        parts.append(
            f'<rect x="{_n(x0)}" y="{top}" width="{_n(max(x1 - x0, 0.5))}" height="{plot_h}" fill="{SHADE_COLOR}">'
            f"<title>{esc(label)}</title></rect>"
        )
        if x1 - x0 >= len(label) * CHAR_PX + 4:
            parts.append(_text((x0 + x1) / 2, top + 14, label, "middle", fill="#777"))
    for tick, text in x_tick_labels:
        x = sx(tick)
        parts.append(_line(x, top, x, top + plot_h, GRID_COLOR))
        parts.append(_text(x, top + plot_h + 16, text, "middle", fill="#555"))
    y_step = y_ticks[1] - y_ticks[0] if len(y_ticks) > 1 else y_hi - y_lo
    for tick in y_ticks:
        y = sy(tick)
        parts.append(_line(left, y, left + plot_w, y, GRID_COLOR))
        parts.append(_text(left - 6, y + 4, tick_text(tick, y_step), "end", fill="#555"))
    parts.append(_line(left, top + plot_h, left + plot_w, top + plot_h, AXIS_COLOR))
    parts.append(_line(left, top, left, top + plot_h, AXIS_COLOR))
    x_title = _axis_title(x_label, ", ".join(filter(None, (x_unit, "log scale" if x_log2 else ""))))
    parts.append(_text(left + plot_w / 2, height - 6, x_title, "middle"))
    y_mid = top + plot_h / 2
    parts.append(
        f'<text x="14" y="{_n(y_mid)}" text-anchor="middle" transform="rotate(-90 14 {_n(y_mid)})">'
        f"{esc(_axis_title(y_label, y_unit))}</text>"
    )
    hover = len(points) <= HOVER_MAX_POINTS
    for k, (name, xs, ys) in enumerate(series):
        color = palette[k % len(palette)]
        parts.append(_polyline(xs, ys, sx, sy, color, dashed=name in dashed))
        count = sum(y is not None for y in ys)
        if not hover and count > MARKER_MAX_POINTS:
            continue
        radius = 2.5 if count <= MARKER_MAX_POINTS else 3.0
        opacity = "1" if count <= MARKER_MAX_POINTS else "0"  # invisible, but still a hover target
        for x, y in zip(xs, ys, strict=True):
            if y is None:
                continue
            at = x_hover(x) if x_hover is not None else f"{x_label} {with_unit(x, x_unit)}"
            tip = f"{name}: {with_unit(y, y_unit)} at {at}"
            parts.append(
                f'<circle cx="{_n(sx(x))}" cy="{_n(sy(y))}" r="{radius}" fill="{color}" fill-opacity="{opacity}">'
                f"<title>{esc(tip)}</title></circle>"
            )
    parts.append("</svg>")
    return "".join(parts)


def _x_tick_labels(lo: float, hi: float, log2: bool, given: Sequence[float] | None) -> list[tuple[float, str]]:
    """The x ticks as (x value, label) between the axis bounds ``lo`` and ``hi`` (in axis units: log₂ of x on a
    log axis): the ``given`` values, powers of two on a log axis, else the round ticks inside the bounds."""
    if given is not None:
        return [(x, _value_text(x)) for x in sorted(set(given))]
    if log2:
        powers = range(math.ceil(lo - 1e-9), math.floor(hi + 1e-9) + 1)
        every = max(1, math.ceil(len(powers) / LOG_MAX_TICKS))  # 1, 4, 16, 64 ... rather than crowded labels
        return [(2.0**k, _value_text(2.0**k)) for k in powers if k % every == 0]
    ticks = nice_ticks(lo, hi)
    step = ticks[1] - ticks[0]
    return [(t, tick_text(t, step)) for t in ticks if lo - 1e-9 * step <= t <= hi + 1e-9 * step]


def _polyline(
    xs: Sequence[float],
    ys: Sequence[float | None],
    sx: Callable[[float], float],
    sy: Callable[[float], float],
    color: str,
    dashed: bool = False,
) -> str:
    """One path for a series, dashed or solid: a gap (None) starts a new sub-path."""
    commands, pen_down = [], False
    for x, y in zip(xs, ys, strict=True):
        if y is None:
            pen_down = False
            continue
        commands.append(f"{'L' if pen_down else 'M'}{_n(sx(x))},{_n(sy(y))}")
        pen_down = True
    dash = f' stroke-dasharray="{DASH}"' if dashed else ""
    return (
        f'<path d="{" ".join(commands)}" fill="none" stroke="{color}" stroke-width="1.6" stroke-linejoin="round"'
        f"{dash}/>"
    )


def _legend(
    names: list[str], palette: list[str], x0: float, y0: float, max_w: float, dashed: Collection[str] = ()
) -> tuple[str, float]:
    """Swatches and names in rows that wrap at ``max_w``; returns the SVG and the height it takes. A name in
    ``dashed`` gets a dashed stroke for a swatch instead of a square."""
    parts, x, y = [], x0, y0
    for k, name in enumerate(names):
        shown = _shorten(name, 260)
        swatch_w = 16 if name in dashed else 10
        item_w = swatch_w + 4 + len(shown) * CHAR_PX + 16
        if x > x0 and x + item_w > x0 + max_w:
            x, y = x0, y + 18
        color = palette[k % len(palette)]
        if name in dashed:
            parts.append(
                f'<line x1="{_n(x)}" y1="{_n(y + 7)}" x2="{_n(x + swatch_w)}" y2="{_n(y + 7)}" stroke="{color}" '
                f'stroke-width="2.5" stroke-dasharray="4 3"/>'
            )
        else:
            parts.append(f'<rect x="{_n(x)}" y="{_n(y + 2)}" width="10" height="10" fill="{color}"/>')
        parts.append(_text(x + swatch_w + 4, y + 11, shown, "start", full=name))
        x += item_w
    return "".join(parts), (y - y0 + 18 if names else 0.0)


def _svg_open(width: int, height: float, title: str) -> str:
    label = f' aria-label="{esc(title)}"' if title else ""
    head = f"<title>{esc(title)}</title>" if title else ""
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {width} {_n(height)}" width="{width}" '
        f'height="{_n(height)}" role="img"{label} font-family="system-ui, -apple-system, Segoe UI, sans-serif" '
        f'font-size="{FONT_PX}" fill="#222">{head}'
    )


def _text(x: float, y: float, text: str, anchor: str, fill: str = "#222", full: str = "") -> str:
    """A text element; when it is a shortened ``full``, the full text goes in its hover title."""
    tip = f"<title>{esc(full)}</title>" if full and full != text else ""
    return f'<text x="{_n(x)}" y="{_n(y)}" text-anchor="{anchor}" fill="{fill}">{tip}{esc(text)}</text>'


def _line(x1: float, y1: float, x2: float, y2: float, color: str) -> str:
    return f'<line x1="{_n(x1)}" y1="{_n(y1)}" x2="{_n(x2)}" y2="{_n(y2)}" stroke="{color}" stroke-width="1"/>'


def _label_width(labels: Sequence[str]) -> float:
    return min(max(len(label) for label in labels) * CHAR_PX, LABEL_MAX_PX) + 16


def _shorten(text: str, max_px: float) -> str:
    limit = int(max_px / CHAR_PX)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _axis_title(label: str, unit: str) -> str:
    return f"{label} ({unit})" if unit else label


def _value_text(value: float) -> str:
    """A given tick value: whole numbers in full with thousands separators (1,024), others as ``fmt_number``."""
    return f"{value:,.0f}" if float(value).is_integer() else fmt_number(value)


def _same(value: float) -> float:
    return value


def _clean(value: float) -> float:
    """Drop the float noise of ``k * step`` (0.30000000000000004 → 0.3)."""
    return float(f"{value:.12g}")


def _n(value: float) -> str:
    """An SVG coordinate: one decimal, no trailing ".0"."""
    text = f"{value:.1f}"
    return text[:-2] if text.endswith(".0") else text
