"""`stepscope tune --html PATH`: the search as one self-contained HTML page (inline CSS and SVG, no script).

The headline (the best combination against the baseline, with its interval), the trials as a chart (each trial's
speedup against the best so far at its round, with its 95% interval, coloured by what happened to it), the table,
how to keep the best, and where a kept setting changes numerics the loss of the same steps, baseline and tuned.
Every user string (settings, notes, the command) is escaped.
"""

from __future__ import annotations

from pathlib import Path

from stepscope import __version__
from stepscope.instrument.tune import LossComparison, Trial, TuneResult, run_line
from stepscope.report.scale_html import PAGE_CSS
from stepscope.report.svg import esc, interval_chart, line_chart
from stepscope.report.tune import interval_text, loss_headline, loss_rows, number_text

KEPT, PROMOTED, REJECTED, SLOWER_COLOR = "#59a14f", "#4e79a7", "#bab0ac", "#e15759"


def _color(trial: Trial) -> str:
    if trial.kept:
        return KEPT
    if trial.reason == "promoted":
        return PROMOTED
    return SLOWER_COLOR if trial.reason == "slower" else REJECTED


def _table(result: TuneResult) -> str:
    head = "".join(f"<th>{h}</th>" for h in ("round", "stage", "setting", "steps/s", "speedup", "95% CI", "outcome"))
    rows = []
    for t in result.trials:
        speedup = "-" if t.speedup is None else f"{t.speedup:.2f}x"
        rate, interval = number_text(t.steps_per_s), interval_text(t.ci_low, t.ci_high)
        cells = (str(t.round), t.stage, t.candidate, rate, speedup, interval, t.reason or t.verdict)
        rows.append("<tr>" + "".join(f"<td>{esc(c)}</td>" for c in cells) + "</tr>")
    return f"<table><tr>{head}</tr>{''.join(rows)}</table>"


def _loss_html(loss: LossComparison | None) -> str:
    """The loss of the same steps, baseline and tuned, as a chart and its first and last rows, where a kept
    setting changes numerics."""
    if loss is None or not loss.numerics:
        return ""
    chart = line_chart(
        [("baseline", loss.steps, loss.baseline), ("tuned", loss.steps, loss.tuned)],
        x_label="measured step",
        y_label="loss",
        dashed={"tuned"},
        title="the loss of the same steps",
    )
    return f"<h3>{esc(loss_headline(loss))}</h3>{chart}<pre>{esc(chr(10).join(loss_rows(loss)))}</pre>"


def tune_html(result: TuneResult, command: list[str]) -> str:
    """The whole page."""
    if result.best_apply:
        interval = "" if result.ci_low is None else f" (95% CI {interval_text(result.ci_low, result.ci_high)})"
        headline = (
            f"<p><b>best: {esc(', '.join(result.best_apply))}</b> · {number_text(result.best_steps_per_s)} steps/s · "
            f"{number_text(result.speedup)}x the baseline{esc(interval)}</p>"
            f"<pre>{esc(run_line(result.best_apply, command))}</pre>"
            f"<h3>keep it in the script</h3><ul>{''.join(f'<li><code>{esc(k)}</code></li>' for k in result.keep)}</ul>"
            f"{_loss_html(result.loss)}"
        )
    else:
        headline = "<p><b>best: the script as it is</b>; no setting measured faster.</p>"
    labels = [f"{t.round}·{t.stage}: {t.candidate}" for t in result.trials]
    chart = interval_chart(
        labels,
        [t.speedup for t in result.trials],
        [(t.ci_low, t.ci_high) if t.ci_low is not None and t.ci_high is not None else None for t in result.trials],
        colors=[_color(t) for t in result.trials],
        title="speedup of each trial against the best so far, with its 95% interval",
    )
    legend = (
        f"<p class='sub'>speedup against the best so far at its round (&gt; 1: faster), with its 95% interval; "
        f"<span style='color:{KEPT}'>kept</span> · <span style='color:{PROMOTED}'>promoted to full runs</span> · "
        f"<span style='color:{SLOWER_COLOR}'>slower</span> · <span style='color:#888'>not kept</span></p>"
    )
    notes = [*(f"note: {n}" for n in result.notes), *([result.stopped] if result.stopped else [])]
    what = f"stepscope {__version__} · {' '.join(command)}"
    notes_html = f"<ul class='notes'>{''.join(f'<li>{esc(n)}</li>' for n in notes)}</ul>" if notes else ""
    return (
        "<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>"
        "<meta name='viewport' content='width=device-width, initial-scale=1'>"
        f"<title>stepscope tune</title><style>{PAGE_CSS}</style></head><body>"
        f"<h1>stepscope tune</h1><p class='sub'>{esc(what)}</p>"
        f"<p>baseline: {number_text(result.baseline_steps_per_s)} steps/s · {result.rounds} round(s)</p>{headline}"
        f"<h2>trials</h2>{legend}{chart}{_table(result)}{notes_html}</body></html>\n"
    )


def write_tune_html(result: TuneResult, command: list[str], path: str | Path) -> None:
    """Write the page to ``path`` (parents created)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(tune_html(result, command), encoding="utf-8")
