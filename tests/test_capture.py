"""Trace capture: `Scope(profile=ProfileWindow(...))`, the phase ranges, the Nsight window, and `stepscope run --trace`.

Everything here runs the real torch.profiler (CPU activities) and reads the traces back with `analyze_trace`.

Step numbering (scope.py, profile.py): training steps count from 0; the profiler starts when the first measured step
begins (step ``W`` for ``Scope(warmup=W)``) and its schedule counts from there, so ``ProfileWindow(wait=1, warmup=1,
active=3)`` under ``warmup=2`` measures step 2, profiles step 3 (discarded) and records steps 4, 5, 6:
``rank0.step4-6.pt.trace.json.gz``. The profiler's warm-up and active steps are left out of the statistics.
"""

from __future__ import annotations

import gzip
import io
import json
import os
import subprocess
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from run_helpers import run_env, script, stepscope_cmd, stepscope_here, stepscope_run, torchrun
from torch import nn
from torch.utils.data import DataLoader, Dataset

from stepscope import NsysWindow, ProfileWindow, Scope, analyze_trace

PHASES = ("data_wait", "forward", "backward", "optimizer")
CUDA = torch.cuda.is_available()


@pytest.fixture(autouse=True)
def one_thread():
    """One intra-op thread, as `stepscope run`'s scripts get (OMP_NUM_THREADS=1): spinning OpenMP threads on a busy
    2-core machine stretch a 0.3 ms forward to tens of ms, and the timing checks below would measure that."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class SleepyDataset(Dataset):
    """Every sample sleeps ``sample_ms`` in ``__getitem__``: a batch of B samples takes at least B x sample_ms."""

    def __init__(self, n: int = 256, sample_ms: float = 0.0) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 16, generator=g)
        self.y = torch.randint(0, 4, (n,), generator=g)
        self.sample_s = sample_ms / 1000

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        if self.sample_s:
            time.sleep(self.sample_s)
        return self.x[i], self.y[i]


def train(scope, steps: int, sample_ms: float = 0.0, batch_size: int = 4) -> None:
    """``steps`` training steps with the canonical phases and ``scope.data`` around a real DataLoader."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    loader = DataLoader(SleepyDataset(sample_ms=sample_ms), batch_size=batch_size, shuffle=False)
    done = 0
    while done < steps:
        for x, y in scope.data(loader):
            with scope.phase("forward"):
                loss = F.cross_entropy(model(x), y)
            with scope.phase("backward"):
                loss.backward()
            with scope.phase("optimizer"):
                optimizer.step()
                optimizer.zero_grad()
            scope.step(batch_size=batch_size)
            done += 1
            if done == steps:
                break


def trace_events(path: Path) -> list[dict]:
    """The traceEvents of a gzipped Kineto trace (checks the gzip magic first)."""
    raw = path.read_bytes()
    assert raw[:2] == b"\x1f\x8b", f"{path} is not gzip"
    data = json.loads(gzip.decompress(raw))
    assert isinstance(data.get("traceEvents"), list) and data["traceEvents"], f"{path} has no traceEvents"
    return data["traceEvents"]


def names(events: list[dict], prefix: str, cat: str | None = None) -> list[str]:
    return [e["name"] for e in events if e.get("name", "").startswith(prefix) and (cat is None or e.get("cat") == cat)]


def trace_files(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir()) if directory.exists() else []


def one_line(text: str) -> str:
    """Whitespace collapsed: the terminal report wraps long lines."""
    return " ".join(text.split())


# -- the library: Scope(profile=ProfileWindow(...)) --------------------------------------------------------------


def test_profile_window_records_the_active_steps_with_phase_ranges(tmp_path):
    sample_ms, batch = 6.0, 4
    known_ms = sample_ms * batch  # the Dataset's sleep per step: far above the model's ~1 ms
    scope = Scope(warmup=2, profile=ProfileWindow(wait=1, warmup=1, active=3, dir=str(tmp_path)))
    train(scope, steps=10, sample_ms=sample_ms, batch_size=batch)
    summary = scope.summary()
    table = io.StringIO()
    scope.print_table(file=table)
    scope.close()

    # warm-up 0-1, step 2 measured (the profiler's wait), 3 profiled and discarded, 4-6 recorded, 7-9 measured
    assert trace_files(tmp_path) == ["rank0.step4-6.pt.trace.json.gz"]
    events = trace_events(tmp_path / "rank0.step4-6.pt.trace.json.gz")
    annotations = set(names(events, "stepscope/", cat="user_annotation"))
    assert {f"stepscope/{p}" for p in PHASES} <= annotations, annotations
    steps = [e for e in events if e.get("name", "").startswith("ProfilerStep#")]
    assert len({e["name"] for e in steps}) == 3, sorted({e["name"] for e in steps})  # one per active step
    for phase in PHASES:  # one range per recorded step, each inside a ProfilerStep
        ranges = [e for e in events if e.get("name") == f"stepscope/{phase}"]
        assert len(ranges) == 3, (phase, len(ranges))
        for r in ranges:
            assert any(s["ts"] <= r["ts"] and r["ts"] + r["dur"] <= s["ts"] + s["dur"] + 1 for s in steps), (phase, r)

    assert summary.steps.warmup == 2
    assert summary.steps.profiled == 4  # the window's warmup + active
    assert summary.steps.measured == 10 - 2 - 4
    assert summary.phases["total"].steps == summary.steps.measured
    assert summary.phases["data_wait"].mean_ms >= 0.95 * known_ms
    assert "4 profiled left out" in one_line(table.getvalue()), table.getvalue()

    analysis = analyze_trace(tmp_path / "rank0.step4-6.pt.trace.json.gz")
    assert [f.ok for f in analysis.files] == [True], analysis.files
    (rank,) = analysis.ranks
    assert rank.rank == 0 and rank.rank_source == "file name"
    assert rank.steps == 2  # HTA's window drops the last ProfilerStep
    assert set(PHASES) <= set(rank.phases_ms), rank.phases_ms
    # the sleep per step, within what a loaded 2-core box adds (the profiler slows the recorded steps a little)
    assert 0.95 * known_ms <= rank.phases_ms["data_wait"] <= 3 * known_ms + 10, rank.phases_ms
    assert all(rank.phases_ms[phase] > 0 for phase in PHASES), rank.phases_ms
    assert rank.data_loading is not None and rank.data_loading.per_step_ms >= 0.95 * known_ms, rank.data_loading
    assert rank.cpu is not None and rank.kernel_span_ms is None  # a CPU-only trace
    assert rank.verdict.bound == "data", rank.verdict
    assert analysis.verdict.bound == "data"


@pytest.mark.parametrize(
    ("scope_warmup", "window", "expected", "profiled"),
    [
        (2, (1, 1, 3), "rank0.step4-6", 4),
        (0, (0, 1, 2), "rank0.step1-2", 3),
        (0, (0, 0, 1), "rank0.step0-0", 1),
        (3, (2, 0, 2), "rank0.step5-6", 2),
    ],
)
def test_trace_files_are_named_by_training_step(tmp_path, scope_warmup, window, expected, profiled):
    wait, warmup, active = window
    steps = scope_warmup + wait + warmup + active + 3
    scope = Scope(
        warmup=scope_warmup,
        system_interval_s=None,
        profile=ProfileWindow(wait=wait, warmup=warmup, active=active, dir=str(tmp_path)),
    )
    train(scope, steps=steps)
    summary = scope.summary()
    scope.close()
    assert trace_files(tmp_path) == [f"{expected}.pt.trace.json.gz"]
    assert summary.steps.profiled == profiled
    assert summary.steps.measured == steps - scope_warmup - profiled
    step_names = set(names(trace_events(tmp_path / f"{expected}.pt.trace.json.gz"), "ProfilerStep#"))
    assert len(step_names) == active, step_names


def test_repeat_writes_one_file_per_window(tmp_path):
    scope = Scope(
        warmup=2, system_interval_s=None, profile=ProfileWindow(wait=1, warmup=1, active=2, repeat=2, dir=str(tmp_path))
    )
    train(scope, steps=12)
    summary = scope.summary()
    scope.close()
    # profiler steps 0 wait, 1 warmup, 2-3 active, 4 wait, 5 warmup, 6-7 active; training steps are 2 later
    assert trace_files(tmp_path) == ["rank0.step4-5.pt.trace.json.gz", "rank0.step8-9.pt.trace.json.gz"]
    assert summary.steps.profiled == 2 * (1 + 2)
    assert summary.steps.measured == 12 - 2 - 6
    analysis = analyze_trace(tmp_path)
    assert len(analysis.files) == 2 and all(f.ok for f in analysis.files), analysis.files


def test_a_run_that_ends_inside_the_window_names_the_steps_it_recorded(tmp_path):
    """The loop ends after step 4, the first active step: close() writes the window so far. Steps 2 (measured) and 3
    (the profiler's warm-up, discarded) are not in the trace, so the file must not claim them."""
    window = ProfileWindow(wait=1, warmup=1, active=3, dir=str(tmp_path))
    scope = Scope(warmup=2, system_interval_s=None, profile=window)
    train(scope, steps=5)
    scope.close()
    (name,) = trace_files(tmp_path)
    assert name.startswith("rank0.step4-"), name


def test_writing_the_trace_is_not_charged_to_the_next_measured_step(tmp_path):
    """on_trace_ready exports (JSON + gzip) inside the step() that ends the window: that time is stepscope's, not the
    time of the measured step that follows the window, which would otherwise carry the whole export (here ~100x a
    step). Two windows, so that one step slowed by a busy machine cannot fail the test."""
    x = torch.ones(8)
    scope = Scope(
        warmup=2,
        window=1,  # metrics() then reads the last measured step alone
        system_interval_s=None,
        profile=ProfileWindow(wait=1, warmup=1, active=3, repeat=2, dir=str(tmp_path)),
    )
    step_ms = {}
    for step in range(14):
        with scope.phase("forward"):
            for _ in range(300):  # enough events that exporting them costs far more than running them
                x.add(1)
        scope.step()
        if scope.metrics():
            step_ms[step] = scope.metrics()["perf/step_time"] * 1e3  # a profiled step leaves the last measured one
    scope.close()
    assert trace_files(tmp_path) == ["rank0.step4-6.pt.trace.json.gz", "rank0.step9-11.pt.trace.json.gz"]
    # measured: 2 (wait), 7 (after window 1, wait of window 2), 12 (after window 2), 13
    after = {7: step_ms[7], 12: step_ms[12]}
    others = {2: step_ms[2], 13: step_ms[13]}
    limit = 5 * max(others.values()) + 20
    assert min(after.values()) < limit, f"steps after the windows took {after} ms, other measured steps {others} ms"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"active": 0}, "ProfileWindow.active must be >= 1, got 0"),
        ({"active": -2}, "ProfileWindow.active must be >= 1, got -2"),
        ({"wait": -1}, "ProfileWindow.wait must be >= 0, got -1"),
        ({"warmup": -1}, "ProfileWindow.warmup must be >= 0, got -1"),
        ({"repeat": -1}, "ProfileWindow.repeat must be >= 0, got -1"),
    ],
)
def test_profile_window_rejects_bad_counts(kwargs, message):
    with pytest.raises(ValueError, match=message.replace(".", r"\.")):
        ProfileWindow(**kwargs)


def test_profile_window_defaults_keep_traces_small():
    window = ProfileWindow()
    assert (window.wait, window.warmup, window.active, window.repeat) == (1, 1, 3, 1)
    assert not (window.record_shapes or window.with_stack or window.profile_memory)


@pytest.mark.parametrize("record_shapes", [False, True])
def test_record_shapes_puts_input_dims_in_the_trace(tmp_path, record_shapes):
    scope = Scope(
        warmup=0,
        system_interval_s=None,
        profile=ProfileWindow(wait=0, warmup=1, active=1, dir=str(tmp_path), record_shapes=record_shapes),
    )
    train(scope, steps=3)
    scope.close()
    (name,) = trace_files(tmp_path)
    events = trace_events(tmp_path / name)
    assert any("Input Dims" in e.get("args", {}) for e in events) == record_shapes


def test_with_stack_records_python_frames(tmp_path):
    scope = Scope(
        warmup=0, system_interval_s=None, profile=ProfileWindow(wait=0, warmup=1, active=1, dir=str(tmp_path))
    )
    train(scope, steps=3)
    scope.close()
    stacked = tmp_path / "stacked"
    scope = Scope(
        warmup=0,
        system_interval_s=None,
        profile=ProfileWindow(wait=0, warmup=1, active=1, dir=str(stacked), with_stack=True),
    )
    train(scope, steps=3)
    scope.close()
    plain_events = trace_events(next(tmp_path.glob("*.gz")))
    stacked_events = trace_events(next(stacked.glob("*.gz")))
    assert not any(e.get("cat") == "python_function" for e in plain_events)
    assert any(e.get("cat") == "python_function" for e in stacked_events)


@pytest.mark.parametrize("enabled", [True, False])
def test_a_scope_without_profile_adds_no_ranges(enabled):
    """The null path: phases and data() of a Scope not capturing (or disabled) leave nothing in a user's own trace."""
    from torch.profiler import ProfilerActivity, profile

    scope = Scope(enabled=enabled, warmup=0, system_interval_s=None)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        train(scope, steps=4)
    names_seen = {e.name for e in prof.events()}
    assert any(n.startswith("aten::") for n in names_seen)  # the profiler did record the loop
    assert not [n for n in names_seen if n.startswith("stepscope/")], sorted(names_seen)
    assert scope.summary().steps.profiled == 0


def test_the_profiler_starts_only_at_the_first_measured_step(tmp_path):
    """Nothing of the Scope's warm-up is recorded, however long it is: with a window that starts at once, the first
    recorded step is the first measured one."""
    scope = Scope(
        warmup=5, system_interval_s=None, profile=ProfileWindow(wait=0, warmup=0, active=2, dir=str(tmp_path))
    )
    train(scope, steps=4)  # still warming up: no trace
    assert trace_files(tmp_path) == []
    train(scope, steps=4)
    scope.close()
    assert trace_files(tmp_path) == ["rank0.step5-6.pt.trace.json.gz"]


# -- Nsight Systems window and NVTX ------------------------------------------------------------------------------


def test_nsys_window_parses_start_stop():
    assert NsysWindow.parse("3:5") == NsysWindow(3, 5)
    assert NsysWindow.parse("0:1") == NsysWindow(0, 1)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("5:3", "0 <= START < STOP, got 5:3"),
        ("3:3", "0 <= START < STOP, got 3:3"),
        ("-1:3", "0 <= START < STOP, got -1:3"),
        ("a:b", "expected START:STOP step numbers like 20:30, got 'a:b'"),
        ("3", "expected START:STOP step numbers like 20:30, got '3'"),
        ("1:2:3", "expected START:STOP step numbers like 20:30, got '1:2:3'"),
        ("", "expected START:STOP"),
    ],
)
def test_nsys_window_rejects_bad_text(text, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        NsysWindow.parse(text)


def test_a_bad_nsys_window_is_refused_by_scope():
    with pytest.raises(ValueError, match="START < STOP"):
        Scope(nsys_window="5:3", system_interval_s=None)


@pytest.mark.skipif(CUDA, reason="checks the refusal without CUDA")
@pytest.mark.parametrize("kwargs", [{"nsys_window": "1:3"}, {"nsys_window": NsysWindow(1, 3)}, {"nvtx": True}])
def test_nvtx_and_nsys_need_cuda(kwargs):
    with pytest.raises(ValueError, match="CUDA"):
        Scope(system_interval_s=None, **kwargs)


@pytest.mark.skipif(CUDA, reason="checks the refusal without CUDA")
def test_nvtx_without_cuda_is_refused_with_a_profile_window_too(tmp_path):
    with pytest.raises(ValueError, match="CUDA"):
        Scope(system_interval_s=None, nvtx=True, profile=ProfileWindow(dir=str(tmp_path)))
    assert trace_files(tmp_path) == []


# -- stepscope run --trace ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def trace_run(tmp_path_factory):
    """basic.py under `stepscope run --trace DIR --trace-window 1:1:2 --trace-shapes`, warm-up 2, 8 measured steps:
    step 2 measured (wait), 3 profiled and discarded, 4-5 recorded. Read by the tests of the trace file and of the
    per-step counts, which hold whatever the window."""
    tmp = tmp_path_factory.mktemp("trace_run")
    return stepscope_here(
        tmp, "--trace", str(tmp / "traces"), "--trace-window", "1:1:2", "--trace-shapes", script("basic.py"),
        warmup=2, steps=8,
    )  # fmt: skip


def test_run_trace_writes_one_rank_file_and_leaves_profiled_steps_out(trace_run):
    r = trace_run
    traces = r.json_path.parent / "traces"
    assert r.returncode == 0, r.describe()
    # step 2 measured (wait), 3 profiled and discarded, 4-5 recorded
    assert trace_files(traces) == ["rank0.step4-5.pt.trace.json.gz"], r.describe()
    assert "trace of steps 4-5 written to" in r.stderr, r.describe()
    s = r.summary
    assert s.steps.warmup == 2 and s.steps.measured == 8, s.steps
    assert s.steps.profiled == 3, s.steps  # the window's warmup + active
    assert s.phases["total"].steps == 8
    assert "3 profiled left out" in one_line(r.stdout), r.describe()

    events = trace_events(traces / "rank0.step4-5.pt.trace.json.gz")
    assert any("Input Dims" in e.get("args", {}) for e in events)  # --trace-shapes
    annotations = set(names(events, "stepscope/", cat="user_annotation"))
    expected = {"stepscope/data_wait", "stepscope/forward", "stepscope/backward", "stepscope/optimizer"}
    assert expected <= annotations, annotations
    (rank,) = analyze_trace(traces).ranks
    assert rank.rank == 0 and rank.steps == 1, rank
    assert {"data_wait", "forward", "backward", "optimizer", "clip"} <= set(rank.phases_ms), rank.phases_ms
    assert rank.data_loading is not None


def test_run_trace_leaves_the_profiled_steps_out_of_the_per_step_counts(trace_run):
    """basic.py does one batch, forward, backward and optimizer step per step: the per-step counts must stay 1 when
    profiled steps are left out (their events must not be divided by the measured steps alone)."""
    r = trace_run
    assert r.returncode == 0, r.describe()
    s = r.summary
    assert s.steps.measured == 8 and s.steps.profiled == 3, s.steps
    for name in ("batches", "forward_calls", "backward_calls", "optimizer_steps"):
        assert s.counters[name] == pytest.approx(1.0), (name, s.counters)


def test_run_trace_stores_the_highlights_in_the_summary_and_the_page(tmp_path):
    traces = tmp_path / "traces"
    traces.mkdir()
    stale = traces / "rank0.step90-92.pt.trace.json.gz"  # an earlier run's capture in the same folder
    stale.write_bytes(gzip.compress(b'{"traceEvents": []}'))
    old = time.time() - 3600
    os.utime(stale, (old, old))
    page = tmp_path / "page.html"
    r = stepscope_here(
        tmp_path, "--trace", str(traces), "--trace-window", "0:1:2", "--html", str(page), script("basic.py"),
        warmup=2, steps=8,
    )  # fmt: skip
    assert r.returncode == 0, r.describe()
    trace = r.summary.trace
    assert trace["folder"] == str(traces.resolve()) and trace["skipped"] == [], trace
    (rank,) = trace["ranks"]
    assert (rank["rank"], rank["file"], rank["steps"]) == (0, "rank0.step3-4.pt.trace.json.gz", 1), rank
    assert {"data_wait", "forward", "backward", "optimizer"} <= set(rank["phases_ms"]), rank["phases_ms"]
    assert rank["data_loading"]["per_step_ms"] > 0 and rank["verdict"]["bound"]
    if not CUDA:
        assert rank["cpu"]["computation_pct"] > 0 and rank["idle_pct"] is None
    assert trace["warnings"] == [
        "1 trace file(s) older than this run were left out: rank0.step90-92.pt.trace.json.gz"
    ], "only this run's capture"  # fmt: skip
    text = page.read_text()
    section = text[text.index('<section id="trace">') : text.index('<section id="run">')]  # before the run's section
    assert "<h2>Trace highlights</h2>" in section and "<td>rank 0</td>" in section


def test_run_trace_that_wrote_no_trace_keeps_the_run_and_says_why(tmp_path):
    traces = tmp_path / "traces"
    page = tmp_path / "page.html"
    r = stepscope_here(
        tmp_path, "--trace", str(traces), "--trace-window", "3:1:2", "--html", str(page), script("basic.py"),
        warmup=2, steps=2,
    )  # fmt: skip
    assert r.returncode == 0, r.describe()
    s = r.summary
    assert s.steps.measured == 2 and s.trace == {}, s
    note = (
        f"The run wrote no trace to {traces.resolve()} (it ended before the profiler's window, --trace-window, "
        "recorded a step), so the summary has no trace highlights."
    )
    assert note in s.notes, s.notes
    assert note in one_line(r.stdout), r.describe()  # the terminal report prints the notes
    text = page.read_text()
    assert '<section id="trace">' not in text and "The run wrote no trace to" in text


@pytest.mark.parametrize("window", ["1:1", "0:0:0", "1:1:0:1", "a:b:c", "1:-1:2", "1:1:2:3:4"])
def test_run_refuses_a_bad_trace_window_before_the_script_runs(tmp_path, window):
    r = stepscope_here(tmp_path, "--trace", str(tmp_path / "t"), "--trace-window", window, script("basic.py"))
    assert r.returncode == 2, r.describe()
    assert "--trace-window" in r.stderr and "WAIT:WARMUP:ACTIVE" in r.stderr, r.describe()
    assert "basic:" not in r.stdout + r.stderr, r.describe()  # the script never started
    assert not (tmp_path / "t").exists()


def test_run_refuses_a_bad_nsys_window_before_the_script_runs(tmp_path):
    r = stepscope_here(tmp_path, "--nsys-window", "5:3", script("basic.py"))
    assert r.returncode == 2, r.describe()
    assert "--nsys-window" in r.stderr and "5:3" in r.stderr, r.describe()
    assert "basic:" not in r.stdout + r.stderr, r.describe()


@pytest.mark.skipif(CUDA, reason="checks the fallback without CUDA")
@pytest.mark.parametrize("capture", [["--nvtx"], ["--nsys-window", "3:5"]])
def test_run_measures_without_a_capture_that_cannot_start(tmp_path, capture):
    r = stepscope_here(tmp_path, *capture, script("basic.py"), "--exit-code", "3", "--iters", "12", warmup=2, steps=50)
    assert r.returncode == 3, r.describe()  # the script's own exit code: it ran to its end
    s = r.summary
    assert s.steps.measured == 10 and s.steps.profiled == 0, s.steps
    warnings = [line for line in r.stderr.splitlines() if "could not set up the trace capture" in line]
    assert len(warnings) == 1, r.describe()
    assert "CUDA" in warnings[0] and warnings[0].endswith("measuring without it."), warnings


def test_doctor_takes_the_trace_options_too(tmp_path):
    traces = tmp_path / "traces"
    r = stepscope_here(
        tmp_path, "--trace", str(traces), "--trace-window", "0:1:1", script("basic.py"), warmup=2, steps=6,
        verb="doctor",
    )  # fmt: skip
    assert r.returncode == 0, r.describe()
    assert trace_files(traces) == ["rank0.step3-3.pt.trace.json.gz"], r.describe()
    assert r.summary.steps.profiled == 2 and r.summary.steps.measured == 6
    assert [rank["file"] for rank in r.summary.trace["ranks"]] == ["rank0.step3-3.pt.trace.json.gz"]
    # stepscope's own capture is not a profiler the script left running (the doctor's debug.profiler fix)
    assert r.summary.facts["torch"]["profiler"] is False
    assert "debug.profiler" not in [fix.id for fix in r.summary.fixes], r.describe()


def test_torchrun_ranks_write_their_own_traces(tmp_path):
    traces = tmp_path / "traces"
    launcher = [
        *torchrun(),
        script("ddp.py"),
        "--sample-ms",
        "0.1",
        "--extra-ms",
        "0",
    ]
    r = stepscope_run(
        tmp_path, "--trace", str(traces), "--trace-window", "1:1:2", "--", *launcher, warmup=2, steps=6, timeout=120
    )
    assert r.returncode == 0, r.describe()
    assert trace_files(traces) == ["rank0.step4-5.pt.trace.json.gz", "rank1.step4-5.pt.trace.json.gz"], r.describe()
    s = r.summary
    assert len(s.ranks) == 2, r.describe()
    for rank_summary in s.ranks:
        assert rank_summary.steps.measured == 6 and rank_summary.steps.profiled == 3, rank_summary.steps

    analysis = analyze_trace(traces)
    assert [f.ok for f in analysis.files] == [True, True], analysis.files
    assert [rank.rank for rank in analysis.ranks] == [0, 1]
    assert not analysis.warnings, analysis.warnings  # no two files claim one rank
    for rank in analysis.ranks:
        assert rank.rank_source in ("distributedInfo", "file name"), rank.rank_source
        assert {"data_wait", "forward", "backward", "optimizer"} <= set(rank.phases_ms), (rank.rank, rank.phases_ms)
        assert Path(rank.file).name.startswith(f"rank{rank.rank}.")


def test_run_trace_help_names_the_options():
    done = subprocess.run(
        stepscope_cmd(None, "--help", warmup=None, steps=None), env=run_env(), capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    text = one_line(done.stdout)
    for option in ("--trace DIR", "--trace-window WAIT:WARMUP:ACTIVE[:REPEAT]", "--trace-shapes", "--trace-stack"):
        assert option in text, option
    assert "--nvtx" in text and "--nsys-window START:STOP" in text
