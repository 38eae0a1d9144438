"""The HTML report of a RunSummary: one self-contained page (inline CSS and SVG, no script, no network).

The verdict and the ranked fixes come first, then the figures behind them: the phase breakdown (per rank), step
time over the run, the sampled GPU and host timelines, the loader ceiling against training, the pipeline monitor's
figures, the highlights of the run's torch.profiler traces, and what was run where. A section whose figures the
summary does not carry is left out. Every string from the run (commands, module, kernel and phase names, evidence,
notes) is escaped; a Content-Security-Policy forbids scripts and any fetch, so the page stays inert even if a
string slipped through.
"""

from __future__ import annotations

from pathlib import Path

from stepscope.report import html_sections as sections
from stepscope.report.svg import esc
from stepscope.summary import RunSummary

CSP = "default-src 'none'; style-src 'unsafe-inline'; img-src data:"

CSS = """
:root { --ink: #1f2328; --mute: #59636e; --line: #d8dee4; --card: #fff; --bg: #f6f8fa; --accent: #0969da; }
* { box-sizing: border-box; }
body { margin: 0; background: var(--bg); color: var(--ink);
       font: 14px/1.5 system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; }
main { max-width: 1100px; margin: 0 auto; padding: 24px 20px 40px; }
header h1 { margin: 0; font-size: 22px; }
header p { margin: 2px 0 0; color: var(--mute); overflow-wrap: anywhere; }
section { background: var(--card); border: 1px solid var(--line); border-radius: 8px; padding: 16px 20px;
          margin-top: 16px; }
h2 { margin: 0 0 10px; font-size: 17px; }
h3 { margin: 14px 0 6px; font-size: 14px; }
p.caption { margin: 4px 0 10px; color: var(--mute); font-size: 13px; }
svg { display: block; width: 100%; height: auto; margin: 6px 0; }
table { border-collapse: collapse; margin: 6px 0 10px; font-size: 13px; }
th, td { padding: 3px 10px 3px 0; text-align: left; vertical-align: top; border-bottom: 1px solid #eef1f4; }
th { color: var(--mute); font-weight: 600; }
td.num, th.num { text-align: right; font-variant-numeric: tabular-nums; }
tr.total td { border-top: 1px solid var(--line); font-weight: 600; }
code { font: 12.5px ui-monospace, SFMono-Regular, Menlo, Consolas, monospace; background: #eff2f5;
       padding: 1px 4px; border-radius: 4px; overflow-wrap: anywhere; }
ul { margin: 4px 0; padding-left: 20px; }
.verdict-line { display: flex; align-items: baseline; gap: 12px; flex-wrap: wrap; }
.bound { font-size: 28px; font-weight: 700; padding: 0 12px; border-radius: 6px; color: #fff; background: #57606a; }
.bound-data { background: #d4700b; } .bound-compute { background: #0969da; } .bound-optimizer { background: #1a7f37; }
.bound-host { background: #cf222e; } .bound-comms { background: #8250df; } .bound-memory { background: #9a6700; }
.bound-inference, .bound-training { background: #bf3989; } .bound-balanced { background: #2da44e; }
.confidence { color: var(--mute); }
.meaning { font-size: 15px; margin: 8px 0; }
.figures { display: flex; flex-wrap: wrap; gap: 10px; margin-top: 12px; }
.figure { border: 1px solid var(--line); border-radius: 6px; padding: 6px 12px; min-width: 120px; }
.figure b { display: block; font-size: 18px; }
.figure span { color: var(--mute); font-size: 12px; }
ol.fixes { list-style: none; padding: 0; margin: 0; }
ol.fixes > li { border-top: 1px solid var(--line); padding: 10px 0; }
ol.fixes > li:first-child { border-top: none; }
.fix-title { font-weight: 600; font-size: 15px; }
.tag { display: inline-block; font-size: 12px; padding: 0 7px; border-radius: 10px; margin-left: 6px;
       border: 1px solid var(--line); color: var(--mute); }
.tag.cost-config { color: #1a7f37; border-color: #1a7f37; } .tag.cost-code { color: #9a6700; border-color: #9a6700; }
.tag.cost-infra { color: #cf222e; border-color: #cf222e; } .tag.gain { color: var(--ink); font-weight: 600; }
.tag.measured { color: #1a7f37; border-color: #1a7f37; font-weight: 600; }
.gainbar { display: inline-block; width: 120px; height: 8px; background: #eaeef2; border-radius: 4px;
           vertical-align: middle; margin-left: 8px; }
.gainbar i { display: block; height: 8px; background: var(--accent); border-radius: 4px; }
dl.fix { display: grid; grid-template-columns: 70px 1fr; gap: 2px 10px; margin: 6px 0 0; }
dl.fix dt { color: var(--mute); } dl.fix dd { margin: 0; }
.notes li, .warn { color: #9a6700; }
#trace td:first-child { white-space: nowrap; }
#trace h3 + table td:first-child { white-space: normal; overflow-wrap: anywhere; }
footer { color: var(--mute); font-size: 12px; margin-top: 16px; text-align: center; }
"""


def render_html(summary: RunSummary) -> str:
    """The report page of ``summary`` as one self-contained HTML document (UTF-8 text)."""
    meta = summary.meta
    title = f"stepscope · {meta.command or 'run'} · {summary.verdict.bound}"
    subtitle = " · ".join(x for x in (meta.command, meta.device, meta.hostname, meta.started_at) if x)
    body = "".join(
        part
        for part in (
            sections.verdict(summary),
            sections.fixes(summary),
            sections.phases(summary),
            sections.hotspots(summary),
            sections.evaluation(summary),
            sections.step_time(summary),
            sections.system(summary),
            sections.capacity(summary),
            sections.pipeline(summary),
            sections.trace(summary),
            sections.run_info(summary),
        )
        if part
    )
    return (
        "<!DOCTYPE html>\n"
        '<html lang="en"><head><meta charset="utf-8">'
        f'<meta http-equiv="Content-Security-Policy" content="{CSP}">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{esc(title)}</title><style>{CSS}</style></head>\n"
        f"<body><main><header><h1>stepscope report</h1><p>{esc(subtitle)}</p></header>\n{body}"
        f"<footer>stepscope {esc(meta.stepscope_version or '')} · summary schema {summary.schema_version}</footer>"
        "</main></body></html>\n"
    )


def write_html(summary: RunSummary, path: str | Path) -> Path:
    """Write ``render_html(summary)`` to ``path`` (parent folders created); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render_html(summary), encoding="utf-8")
    return path
