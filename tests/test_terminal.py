"""The plain-text phase table (a StringIO is not a TTY, so output has no colour)."""

import io

import pytest

from stepscope import PhaseStats, RunSummary, Verdict
from stepscope.report.terminal import print_summary, throughput_line
from stepscope.summary import Meta, Steps, Throughput


@pytest.fixture(autouse=True)
def no_ci(monkeypatch):
    monkeypatch.delenv("CI", raising=False)


def host_summary():
    return RunSummary(
        steps=Steps(warmup=20, measured=480),
        phases={
            "data_wait": PhaseStats(mean_ms=61.4, median_ms=60.0, p95_ms=80.6, share=0.614, steps=480),
            "forward": PhaseStats(mean_ms=20.0, median_ms=19.5, p95_ms=25.0, share=0.2, steps=480),
            "attention": PhaseStats(mean_ms=8.0, median_ms=8.0, p95_ms=9.0, share=0.08, steps=480, nested=True),
            "other": PhaseStats(mean_ms=0.5, median_ms=0.25, p95_ms=1.0, share=0.006, steps=480),
            "total": PhaseStats(mean_ms=100.0, median_ms=99.0, p95_ms=120.0, share=1.0, steps=480),
        },
        throughput=Throughput(steps_per_s=10.0, samples_per_s=320.0, step_time_ms=100.0),
        meta=Meta(command="train.py --lr 0.1", device="cpu", timing="host"),
    )


def render(summary):
    out = io.StringIO()
    print_summary(summary, file=out)
    return out.getvalue()


def row(text, name):
    """The table line whose first cell is ``name`` (leading indentation kept)."""
    lines = [line for line in text.splitlines() if line.split()[:1] == [name]]
    assert len(lines) == 1, text
    return lines[0]


def test_phase_rows_with_formatted_figures():
    text = render(host_summary())
    # under 10 ms: three decimals; from 10 ms: one decimal; share in percent with one decimal
    assert row(text, "data_wait").split() == ["data_wait", "61.4", "60.0", "80.6", "61.4%"]
    assert row(text, "forward").split() == ["forward", "20.0", "19.5", "25.0", "20.0%"]
    assert row(text, "attention").split() == ["attention", "8.000", "8.000", "9.000", "8.0%"]
    assert row(text, "other").split() == ["other", "0.500", "0.250", "1.000", "0.6%"]
    assert row(text, "total").split() == ["total", "100.0", "99.0", "120.0", "100.0%"]
    assert row(text, "phase").split() == ["phase", "mean", "ms", "median", "ms", "p95", "ms", "share"]
    assert "gpu" not in text
    assert "\x1b[" not in text  # no colour codes


def test_rows_in_summary_order():
    text = render(host_summary())
    positions = [text.index(row(text, name)) for name in ("data_wait", "forward", "attention", "other", "total")]
    assert positions == sorted(positions)


def test_nested_phase_is_indented_by_two_spaces():
    text = render(host_summary())
    assert row(text, "attention").startswith("  attention ")
    for name in ("data_wait", "forward", "other", "total"):
        assert row(text, name).startswith(name)


def test_title_throughput_and_bound_lines():
    lines = render(host_summary()).splitlines()
    assert lines[0] == "stepscope · train.py --lr 0.1 · cpu · timing: host clock"
    assert "throughput: 10.00 steps/s, 320.0 samples/s over 480 measured steps (warm-up 20)" in lines
    assert "bound: unknown [confidence low]" in lines


def test_verdict_evidence_and_notes():
    summary = host_summary()
    summary.verdict = Verdict(bound="data", confidence="high", evidence=["data_wait 61%", "GPU idle [58%]"])
    summary.notes = ["first [note]", "second"]
    lines = render(summary).splitlines()
    assert "bound: data [confidence high] (data_wait 61%; GPU idle [58%])" in lines
    assert lines[-2:] == ["note: first [note]", "note: second"]


@pytest.mark.parametrize(
    ("throughput", "expected"),
    [
        (Throughput(steps_per_s=10.0, samples_per_s=320.0), "10.00 steps/s, 320.0 samples/s"),
        (Throughput(steps_per_s=2.345), "2.35 steps/s"),
        (Throughput(), "no rate"),
    ],
)
def test_throughput_line(throughput, expected):
    summary = RunSummary(steps=Steps(warmup=3, measured=7), throughput=throughput)
    assert throughput_line(summary) == f"throughput: {expected} over 7 measured steps (warm-up 3)"


def test_cuda_summary_adds_gpu_columns():
    summary = host_summary()
    summary.meta.timing = "cuda"
    summary.meta.device = "cuda:0 (H100)"
    forward = summary.phases["forward"]
    forward.device_mean_ms, forward.device_share = 18.0, 0.18
    attention = summary.phases["attention"]
    attention.device_mean_ms, attention.device_share = 7.5, 0.075
    text = render(summary)
    assert text.splitlines()[0] == (
        "stepscope · train.py --lr 0.1 · cuda:0 (H100) · timing: CUDA events (gpu columns) + host clock"
    )
    header = row(text, "phase").split()
    assert header == ["phase", "mean", "ms", "median", "ms", "p95", "ms", "share", "gpu", "mean", "ms", "gpu", "share"]
    assert row(text, "forward").split() == ["forward", "20.0", "19.5", "25.0", "20.0%", "18.0", "18.0%"]
    assert row(text, "attention").split() == ["attention", "8.000", "8.000", "9.000", "8.0%", "7.500", "7.5%"]
    assert row(text, "attention").startswith("  attention ")
    # phases without device time show a dash
    assert row(text, "data_wait").split() == ["data_wait", "61.4", "60.0", "80.6", "61.4%", "-", "-"]
    assert row(text, "total").split() == ["total", "100.0", "99.0", "120.0", "100.0%", "-", "-"]


def test_empty_summary_prints_title_and_notes_only():
    summary = RunSummary(notes=["no measured steps: warm-up was 20 steps and 3 step(s) ran"])
    lines = render(summary).splitlines()
    assert lines == [
        "stepscope · run · cpu · timing: host clock",
        "note: no measured steps: warm-up was 20 steps and 3 step(s) ran",
    ]


def test_plain_output_table_is_ascii():
    # terminal.py promises "plain text (no colour, ASCII-safe box) when the output is not a TTY".
    lines = render(host_summary()).splitlines()
    table = lines[1:-2]  # between the title line and the throughput/bound lines
    assert table
    for line in table:
        assert line.isascii(), repr(line)


def test_command_with_brackets_is_printed_verbatim():
    # The command line comes from sys.argv (Hydra-style overrides use brackets); it is text, not rich markup.
    summary = host_summary()
    summary.meta.command = "train.py model=[resnet] data.paths=[/data/a]"
    lines = render(summary).splitlines()
    assert lines[0] == "stepscope · train.py model=[resnet] data.paths=[/data/a] · cpu · timing: host clock"


def test_custom_phase_name_with_brackets_is_printed_verbatim():
    summary = host_summary()
    summary.phases = {
        "ema[update]": PhaseStats(mean_ms=2.0, median_ms=2.0, p95_ms=2.0, share=0.02, steps=480),
        "total": summary.phases["total"],
    }
    text = render(summary)
    assert row(text, "ema[update]").split() == ["ema[update]", "2.000", "2.000", "2.000", "2.0%"]


def test_pipeline_and_trace_highlights_get_their_lines():
    summary = host_summary()
    summary.pipeline = {
        "thru": 12.06,
        "infer_capacity": 18.5,
        "train_capacity": 13.24,
        "dispatch_wait_s": 0.1,
        "pool": 24.0,
        "bottleneck": "inference",
    }
    summary.trace = {
        "ranks": [
            {
                "rank": 0,
                "idle_pct": 79.8,
                "compute_pct": 15.0,
                "non_compute_pct": 5.2,
                "idle_breakdown": {"host_wait_pct": 99.0},
                "cpu": None,
                "verdict": {"bound": "host"},
            },
            {"rank": 1, "cpu": {"computation_pct": 61.25}, "verdict": {"bound": "compute"}},
        ],
        "verdict": {"bound": "host", "evidence": ["the GPU waited for the host 79.8% of the time"]},
    }
    text = render(summary)
    assert (
        "pipeline: thru 12.1/s · inference capacity 18.5/s · training capacity 13.2/s · wait 100 ms/step · pool 24 · "
        "bottleneck inference"
    ) in " ".join(text.split())  # the console may wrap the line
    assert "trace: rank 0: GPU idle 79.8% (host wait 99.0%), compute 15.0%, non-compute 5.2% · bound host" in text
    assert "trace: rank 1: ATen ops 61.2% of the main thread (CPU-only trace) · bound compute" in text
    assert "trace verdict: host (the GPU waited for the host 79.8% of the time)" in text
    assert "trace:" not in render(host_summary()) and "pipeline:" not in render(host_summary())


def test_trace_highlights_name_the_late_rank_and_its_cause():
    summary = host_summary()
    late = {
        "job": "[red]node1[/red]", "rank": 1, "cause": "host", "collectives": 8, "last_at": 8, "late_ms": 20.5,
        "waited_ms": 19.75, "wait_share_pct": 92.4, "wait_pct": 48.0, "cause_ms": 21.0, "others_cause_ms": 0.5,
        "unit": "per step",
    }  # fmt: skip
    ranks = [{"rank": r, "cpu": {"computation_pct": 3.0}, "verdict": {"bound": "unknown"}} for r in (0, 1)]
    summary.trace = {"ranks": ranks, "verdict": {"bound": "host", "evidence": ["rank 1 starts 8 of 8 last"]},
                     "late_ranks": [late]}  # fmt: skip
    text = " ".join(render(summary).split())  # the console may wrap the line
    assert (
        "trace verdict: host (rank 1 starts 8 of 8 last) trace late rank: in [red]node1[/red], rank 1 arrives last "
        "at 8 of 8 collectives in the traces, on average 20.50 ms after the others; they wait 19.75 ms per step for "
        "it (92% of their communication time), while it spends 21.00 ms per step on host work (Python, launches, "
        "waits) against their 0.50 ms"
    ) in text, "printed as it is (no console markup), after the trace's verdict"
    summary.trace = {**summary.trace, "late_ranks": []}
    assert "late rank" not in render(summary)
