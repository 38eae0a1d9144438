"""The scaling report as one self-contained HTML page (`stepscope scale --html PATH`).

Inline CSS and SVG only (no script, no network): it opens from disk and can be attached to an issue. Per label:
the findings, the table, and three charts over world size: samples/s against ideal linear scaling, parallel
efficiency, and each phase's per-rank ms per step. Every user string (labels, phase names, file names) is
escaped.
"""

from __future__ import annotations

from pathlib import Path

from stepscope import __version__
from stepscope.analyses.scale import ScaleGroup, ScaleReport
from stepscope.report.scale import config_rows, scaling_words
from stepscope.report.svg import esc, line_chart

PAGE_CSS = """
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", sans-serif; color: #222; margin: 2em auto;
       max-width: 860px; padding: 0 1em; }
h1 { font-size: 1.5em; margin-bottom: .2em; } h2 { font-size: 1.2em; margin-top: 2em; }
h3 { font-size: 1em; color: #444; margin: 1.4em 0 .4em; }
.sub { color: #666; margin-top: 0; }
table { border-collapse: collapse; margin: .6em 0; font-variant-numeric: tabular-nums; }
th, td { padding: .25em .6em; border-bottom: 1px solid #e3e3e3; text-align: right; white-space: nowrap; }
th:first-child, td:first-child { text-align: left; }
th { font-weight: 600; border-bottom: 1px solid #999; }
ul.findings li { margin: .2em 0; }
.notes { color: #555; }
svg { max-width: 100%; height: auto; }
details { margin-top: .6em; color: #555; }
"""


def _rows(group: ScaleGroup) -> str:
    """The configurations as an HTML table (the terminal table's rows)."""
    headers, rows = config_rows(group)
    lines = ["<table><thead><tr>", *(f"<th>{esc(h)}</th>" for h in headers), "</tr></thead><tbody>"]
    for row in rows:
        lines += ["<tr>", *(f"<td>{esc(cell)}</td>" for cell in row), "</tr>"]
    lines.append("</tbody></table>")
    return "".join(lines)


def _ranks(world: float) -> str:
    """A world size in a hover text: "1 rank", "8 ranks"."""
    return f"{world:,.0f} rank{'s' * (world != 1)}"


def _world_chart(worlds: list[int], series: list[tuple[str, list[float]]], **kwargs) -> str:
    """``series`` (one value per world size) over ``worlds`` on a log₂ axis with a tick at each world size."""
    return line_chart(
        [(name, worlds, ys) for name, ys in series],
        x_label="world size",
        x_unit="ranks",
        x_log2=True,
        x_ticks=worlds,
        x_hover=_ranks,
        width=760,
        **kwargs,
    )


def _charts(group: ScaleGroup) -> str:
    """samples/s vs ideal linear scaling, efficiency, and per-phase ms, each over world size."""
    worlds = [c.world_size for c in group.configs]
    base = group.configs[0]
    ideal = "ideal linear scaling"
    throughput = _world_chart(
        worlds,
        [
            ("measured (median)", [c.samples_per_s.median for c in group.configs]),
            (ideal, [base.samples_per_s.median * w / base.world_size for w in worlds]),
        ],
        y_label="samples/s",
        dashed=[ideal],
        title="samples/s vs world size",
    )
    efficiency = _world_chart(
        worlds,
        [("parallel efficiency", [100 * c.efficiency for c in group.configs])],
        y_label="efficiency",
        y_unit="%",
        title="parallel efficiency vs world size",
    )
    phases = _world_chart(
        worlds,
        [(name, [c.phases_ms[name] for c in group.configs]) for name in base.phases_ms],
        y_label="per rank per step",
        y_unit="ms",
        title="phase time per rank vs world size",
    )
    return (
        f"<h3>samples/s (cluster) and ideal linear scaling</h3>{throughput}"
        f"<h3>parallel efficiency</h3>{efficiency}"
        f"<h3>phase time per rank per step</h3>{phases}"
    )


def _group_html(report: ScaleReport, group: ScaleGroup) -> str:
    title = "all runs" if group.label is None else f"{report.by}={group.label}"
    scaling = scaling_words(group)
    findings = "".join(f"<li>{esc(line)}</li>" for line in group.findings)
    sources = "".join(f"<li>{c.world_size} rank(s): {esc(', '.join(c.sources))}</li>" for c in group.configs)
    return (
        f"<section><h2>{esc(title)}</h2><p class='sub'>{esc(scaling)}</p>"
        f"<ul class='findings'>{findings}</ul>{_rows(group)}{_charts(group)}"
        f"<details><summary>summary files</summary><ul>{sources}</ul></details></section>"
    )


def scale_html(report: ScaleReport) -> str:
    """The whole page."""
    groups = "".join(_group_html(report, g) for g in report.groups)
    notes = [f"skipped: {s.reason}" for s in report.skipped] + [f"note: {n}" for n in report.notes]
    notes_html = f"<ul class='notes'>{''.join(f'<li>{esc(n)}</li>' for n in notes)}</ul>" if notes else ""
    by = "" if report.by is None else f" · grouped by {report.by}"
    return (
        "<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>"
        "<meta name='viewport' content='width=device-width, initial-scale=1'>"
        f"<title>stepscope scale</title><style>{PAGE_CSS}</style></head><body>"
        f"<h1>stepscope scale</h1><p class='sub'>{esc(f'stepscope {__version__}{by}')}</p>"
        f"{groups}{notes_html}</body></html>\n"
    )


def write_scale_html(report: ScaleReport, path: str | Path) -> None:
    """Write the page to ``path`` (parents created)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(scale_html(report), encoding="utf-8")
